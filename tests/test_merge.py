"""merge_attention_states: partial results over disjoint key sets combine exactly, empty parts included."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.attention import causal_attention
from engine.kernels.merge import merge_attention_states


def test_the_docstring_example_weights_three_to_one():
    # Part a: three scores of 0 (lse log 3); part b: one visible score of 0 (lse log 1).
    out, lse = merge_attention_states([torch.tensor([[1.0]]), torch.tensor([[5.0]])],
                                      [torch.tensor([math.log(3.0)]), torch.tensor([0.0])])
    torch.testing.assert_close(out, torch.tensor([[2.0]]))  # 3/4 * 1 + 1/4 * 5
    torch.testing.assert_close(lse, torch.tensor([math.log(4.0)]))


def _split_run(q, k, v, cuts, **kwargs):
    """Attention over each key range [cuts[i], cuts[i+1]) alone (a key mask), then merged."""
    s = k.shape[2]
    outs, lses = [], []
    for j0, j1 in zip(cuts[:-1], cuts[1:]):
        part = (torch.arange(s) >= j0) & (torch.arange(s) < j1)  # [S]
        out, lse = causal_attention(q, k, v, allowed=part, return_lse=True, **kwargs)
        outs.append(out)
        lses.append(lse)
    return merge_attention_states(outs, lses)


@given(st.lists(st.integers(0, 60), min_size=0, max_size=4), st.booleans())
def test_split_then_merge_round_trips(inner_cuts, causal):
    g = torch.Generator().manual_seed(len(inner_cuts))
    q, k, v = torch.randn(1, 2, 20, 8, generator=g, dtype=torch.float64), \
        torch.randn(1, 1, 60, 8, generator=g, dtype=torch.float64), torch.randn(1, 1, 60, 8, generator=g,
                                                                                 dtype=torch.float64)
    cuts = [0, *sorted(inner_cuts), 60]  # repeated cuts give empty parts
    full, full_lse = causal_attention(q, k, v, causal=causal, return_lse=True)
    out, lse = _split_run(q, k, v, cuts, causal=causal)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)  # the parts' lse is fp32 by contract
    torch.testing.assert_close(lse.float(), full_lse)


def test_parts_that_see_nothing_change_nothing_and_all_empty_gives_zero():
    out = torch.randn(2, 3, 4)
    lse = torch.randn(2, 3)
    empty_out, empty_lse = torch.zeros(2, 3, 4), torch.full((2, 3), float("-inf"))
    merged, merged_lse = merge_attention_states([empty_out, out, empty_out], [empty_lse, lse, empty_lse])
    assert torch.equal(merged, out) and torch.equal(merged_lse, lse)
    none, none_lse = merge_attention_states([empty_out, empty_out], [empty_lse, empty_lse])
    assert torch.equal(none, torch.zeros_like(none)) and bool(torch.isneginf(none_lse).all())


def test_merging_is_stable_for_huge_log_sum_exps():
    out, lse = merge_attention_states([torch.ones(1, 2), 3 * torch.ones(1, 2)],
                                      [torch.tensor([1000.0]), torch.tensor([1000.0])])
    torch.testing.assert_close(out, 2 * torch.ones(1, 2))
    torch.testing.assert_close(lse, torch.tensor([1000.0 + math.log(2.0)]))


def test_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError, match="as many outputs as lses"):
        merge_attention_states([torch.zeros(2, 3)], [])
    with pytest.raises(ValueError, match="without the last axis"):
        merge_attention_states([torch.zeros(2, 3)], [torch.zeros(3)])


def test_merging_float64_parts_is_exact_to_float64_rounding():
    g = torch.Generator().manual_seed(3)
    scores, values = torch.randn(5, 40, generator=g, dtype=torch.float64), torch.randn(40, 3, generator=g,
                                                                                        dtype=torch.float64)
    full = torch.softmax(scores, dim=-1) @ values  # [5, 3]
    parts = [(0, 7), (7, 8), (8, 40)]
    outs = [torch.softmax(scores[:, a:b], dim=-1) @ values[a:b] for a, b in parts]
    lses = [torch.logsumexp(scores[:, a:b], dim=-1) for a, b in parts]
    out, lse = merge_attention_states(outs, lses)
    assert lse.dtype == torch.float64  # the merge keeps fp64, so merges chain without rounding
    torch.testing.assert_close(out, full, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), rtol=1e-13, atol=1e-13)
