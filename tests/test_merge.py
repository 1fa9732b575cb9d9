"""merge_attention_states: partial results over disjoint key sets combine exactly, empty parts included."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.attention import causal_attention
from engine.kernels.merge import merge_attention_states, merge_into


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
    # Tolerances of fp32: they hold whether the kernels' lse is fp32 or fp64 (the float64 property below is exact).
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), full_lse.double(), rtol=1e-6, atol=1e-6)


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


OUT, LSE = torch.zeros(2, 3), torch.zeros(2)  # one well-formed part: output [T=2, Dv=3], lse [2]


@pytest.mark.parametrize("outputs,lses,match", [
    ([OUT], [], r"as many outputs as lses.*got 1 and 0"),
    ([], [], r"at least one; got 0 and 0"),
    (OUT, LSE, r"outputs must be an iterable of tensors.*got Tensor"),  # one tensor would split along axis 0
    ([OUT], LSE, r"lses must be an iterable of tensors.*got Tensor"),
    (None, [LSE], r"outputs must be an iterable.*got NoneType"),
    ([OUT.tolist()], [LSE], r"outputs\[0\] must be a floating-point tensor, got list"),
    ([OUT.long()], [LSE], r"outputs\[0\] must be a floating-point tensor, got dtype torch.int64"),
    ([OUT, OUT.long()], [LSE, LSE], r"outputs\[1\] must be a floating-point tensor, got dtype torch.int64"),
    ([OUT], [LSE.long()], r"lses\[0\] must be a floating-point tensor, got dtype torch.int64"),
    ([OUT], [LSE.bool()], r"lses\[0\] must be a floating-point tensor, got dtype torch.bool"),
    ([torch.tensor(1.0)], [torch.tensor(0.0)], r"outputs\[0\] must have at least one axis \[..., Dv\], got a 0-d"),
    ([OUT, torch.zeros(3, 3)], [LSE, torch.zeros(3)], r"shape of outputs\[0\], \(2, 3\); outputs\[1\] has \(3, 3\)"),
    ([OUT, torch.zeros(2, 4)], [LSE, LSE], r"shape of outputs\[0\], \(2, 3\); outputs\[1\] has \(2, 4\)"),
    ([OUT, OUT.double()], [LSE, LSE], r"dtype of outputs\[0\], torch.float32; outputs\[1\] has torch.float64"),
    ([OUT, OUT.to("meta")], [LSE, LSE], r"device of outputs\[0\], cpu; outputs\[1\] has meta"),
    ([OUT], [torch.zeros(3)],
     r"output's shape without the last axis, \(2,\) for output \(2, 3\); lses\[0\] has \(3,\)"),
    ([OUT], [torch.zeros(2, 1)], r"lses\[0\] has \(2, 1\)"),
    ([OUT], [LSE.to("meta")], r"lse must be on its output's device cpu; lses\[0\] is on meta"),
])
def test_bad_parts_are_refused_with_what_was_expected_and_given(outputs, lses, match):
    with pytest.raises(ValueError, match=match):
        merge_attention_states(outputs, lses)


def test_any_iterable_of_parts_is_read_once_and_merges_like_a_list():
    outs = [torch.randn(2, 3, dtype=torch.float64) for _ in range(3)]
    lses = [torch.randn(2, dtype=torch.float64) for _ in range(3)]
    expected_out = sum(torch.exp(lse - torch.logsumexp(torch.stack(lses), 0))[:, None] * out
                       for out, lse in zip(outs, lses))  # float64 weights exp(lse_i - lse), written out
    for merged, merged_lse in (merge_attention_states(iter(outs), (lse for lse in lses)),
                               merge_attention_states(tuple(outs), tuple(lses))):
        torch.testing.assert_close(merged, expected_out, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(merged_lse, torch.logsumexp(torch.stack(lses), 0), rtol=1e-14, atol=1e-14)


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


def _float64_attention_with_lse(q, k, v, query_positions, key_positions, causal):
    """Float64 attention written out here (no engine code): ``(out [B, Hq, T, Dv], lse [B, Hq, T])``."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, Hq, S, D|Dv]
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(q.shape[-1])  # [B, Hq, T, S]
    if causal:
        visible = key_positions[None, :] <= query_positions[:, None]  # [T, S]
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, T]; -inf where a query sees nothing
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # [B, Hq, T, S]; empty rows: 0
    return weights @ v, lse


@settings(max_examples=30)
@given(part_of_key=st.lists(st.integers(0, 3), min_size=1, max_size=12), queries=st.integers(1, 4),
       causal=st.booleans(), seed=st.integers(0, 2**16))
def test_property_merging_random_key_splits_equals_attention_over_all_keys_in_float64(
        part_of_key, queries, causal, seed):
    # Key j goes to part part_of_key[j]: parts are arbitrary (not contiguous) key sets, and an unused part
    # id is an empty part. Queries sit at random positions -1..S, so some see no key (out 0, lse -inf).
    g = torch.Generator().manual_seed(seed)
    s, dv = len(part_of_key), 3
    q = torch.randn(2, 4, queries, 5, generator=g, dtype=torch.float64)  # [B, Hq, T, D]
    k = torch.randn(2, 2, s, 5, generator=g, dtype=torch.float64)  # [B, Hkv, S, D]: GQA, G = 2
    v = torch.randn(2, 2, s, dv, generator=g, dtype=torch.float64)  # [B, Hkv, S, Dv]
    query_positions = torch.randint(-1, s + 1, (queries,), generator=g)  # [T]
    key_positions = torch.randperm(s, generator=g)  # [S]: keys in any order
    outs, lses = [], []
    parts = max(part_of_key) + 2  # one more part than used: at least one empty part, at a random place
    for part in torch.randperm(parts, generator=g).tolist():
        keys = torch.tensor([j for j, p in enumerate(part_of_key) if p == part], dtype=torch.long)  # [S_part]
        out, lse = causal_attention(q, k[:, :, keys], v[:, :, keys], query_positions, key_positions[keys],
                                    causal=causal, return_lse=True, kernel="reference")
        outs.append(out)
        lses.append(lse)
    merged, merged_lse = merge_attention_states(outs, lses)
    expected, expected_lse = _float64_attention_with_lse(q, k, v, query_positions, key_positions, causal)
    torch.testing.assert_close(merged, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged_lse, expected_lse, rtol=1e-12, atol=1e-12)  # also fails if not fp64


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 6), st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
       st.integers(0, 10_000))
def test_the_in_place_running_merge_equals_the_merge_of_both_parts(heads, rows, part_dtype, seed):
    # empty rows on either side, both, or neither: the running merge of a ring step equals the two-part merge
    g = torch.Generator().manual_seed(seed)
    compute = torch.float64 if part_dtype == torch.float64 else torch.float32
    out, part_out = torch.randn(heads, rows, 5, generator=g, dtype=compute), torch.randn(heads, rows, 5, generator=g)
    lse, part_lse = torch.randn(heads, rows, generator=g, dtype=compute) * 3, torch.randn(heads, rows, generator=g) * 3
    empty, part_empty = torch.rand(heads, rows, generator=g) < 0.3, torch.rand(heads, rows, generator=g) < 0.3
    out, lse = out.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, -math.inf)
    part_out = part_out.masked_fill(part_empty[..., None], 0.0).to(part_dtype)
    part_lse = part_lse.masked_fill(part_empty, -math.inf).to(compute)
    want_out, want_lse = merge_attention_states([out, part_out.to(compute)], [lse, part_lse])
    merge_into(out, lse, part_out, part_lse)
    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
    assert torch.equal(lse.isneginf(), want_lse.isneginf()) and not bool(out.isnan().any())
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
