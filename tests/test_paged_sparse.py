"""Top-k sparse attention on a paged call: ``paged_attention(..., key_indices=[Nq, Hkv|1, K])`` lists each query's
keys of its own sequence (-1 none, a repeat once), with the rule, the window and the other options. Checked against
the float64 oracle that reads every key through the page table (tests/paged_cases.py), its ``allowed`` built from
the indices, over the paged batches' strategy (shuffled and shared pages, NaN in every unowned slot, windows,
softcap, sinks, ALiBi, per-token positions), whole and a run of pages at a time."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import explain_paged, paged_attention
from tests.paged_cases import oracle, paged_batches
from tests.test_paged import small_runs


def listed_for(args, top: int, heads: int, seed: int) -> torch.Tensor:
    """int64 ``[Nq, heads, top]``: each query's indices drawn in [-1, its sequence's key count)."""
    _, _, _, _, kv_lens, indptr, _ = args
    g = torch.Generator().manual_seed(seed)
    counts = (indptr[1:] - indptr[:-1]).tolist()
    rows = [torch.randint(-1, max(int(n), 0) or 1, (c, heads, top), generator=g).clamp(max=max(int(n) - 1, -1))
            for n, c in zip(kv_lens.tolist(), counts)]
    return torch.cat(rows) if rows else torch.zeros(0, heads, top, dtype=torch.long)


def dense_of(listed: torch.Tensor, width: int, head: int) -> torch.Tensor:
    """bool ``[Nq, width]``: key j listed for the row (KV head ``head``'s list)."""
    out = torch.zeros(listed.shape[0], width + 1, dtype=torch.bool)
    idx = listed[:, head if listed.shape[1] > 1 else 0]
    return out.scatter_(1, torch.where(idx >= 0, idx, width), True)[:, :width]


@settings(max_examples=40, deadline=None)
@given(problem=paged_batches(), top=st.integers(1, 12), per_head=st.booleans(), run_keys=st.sampled_from([3, 4096]),
       kernel=st.sampled_from(["auto", "tiled", "reference"]), seed=st.integers(0, 1000))
def test_paged_key_indices_equal_the_oracle_reading_through_the_page_table(problem, top, per_head, run_keys,
                                                                           kernel, seed):
    args, options = problem
    q, k_pages = args[0], args[1]
    kv_heads = k_pages.shape[2]
    listed = listed_for(args, top, kv_heads if per_head else 1, seed)
    ours = dict(options)
    if "alibi" in ours:
        ours["alibi_slopes"] = ours.pop("alibi")
    with small_runs(run_keys):
        out, lse = paged_attention(*args, return_lse=True, key_indices=listed, kernel=kernel, **ours)
    width = max(int(args[4].max()) if args[4].numel() else 0, 1)
    group = q.shape[1] // kv_heads
    for h in range(kv_heads):  # the oracle's allowed is one per row: one KV head's query heads at a time
        want, want_lse = oracle(*args, **options, allowed=dense_of(listed, width, h))
        heads = slice(h * group, (h + 1) * group)
        assert torch.isfinite(out[:, heads]).all()
        torch.testing.assert_close(out[:, heads], want[:, heads].to(out.dtype), rtol=1e-9, atol=1e-9)
        assert torch.equal(lse[:, heads].isneginf(), want_lse[:, heads].isneginf())


def test_bad_paged_key_indices_are_refused_and_explain_says_the_path():
    pool = torch.randn(4, 4, 1, 8)
    table, lens, indptr = torch.tensor([[0, 1], [2, 3]]), torch.tensor([6, 8]), torch.tensor([0, 1, 2])
    q = torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match=r"\[-1, kv_len\) of each query's sequence"):
        paged_attention(q, pool, pool, table, lens, indptr, key_indices=torch.tensor([[[6]], [[0]]]))  # seq 0: 6 keys
    with pytest.raises(ValueError, match=r"\[Nq, Hkv\|1, K\]"):
        paged_attention(q, pool, pool, table, lens, indptr, key_indices=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="cascade=True with allowed, score_mod or key_indices"):
        paged_attention(q, pool, pool, table, lens, indptr, key_indices=torch.zeros(2, 1, 2, dtype=torch.long),
                        cascade=True)
    text = explain_paged(q, pool, pool, table, lens, indptr, key_indices=torch.tensor([[[5, 0]], [[7, -1]]]))
    assert "own call" in text and "key_indices: not computed" in text
