"""Top-k sparse attention on a paged call: ``paged_attention(..., key_indices=[Nq, Hkv|1, K])`` lists each query's
keys of its own sequence (-1 none, a repeat once), with the rule, the window and the other options. Checked against
the float64 oracle that reads every key through the page table (tests/paged_cases.py), its ``allowed`` built from
the indices, over the paged batches' strategy (shuffled and shared pages, NaN in every unowned slot, windows,
softcap, sinks, ALiBi, per-token positions), whole and a run of pages at a time; and read in place by the native
kernel (engine.kernels.decode.native_paged_listed: each query row's listed keys as one-key pages of the pools) in
fp32, bf16 and on int8 pools, against the same oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import explain_paged, paged_attention, plan_paged
from engine.kernels.decode.native_build import native_unavailable
from engine.quantized import QuantizedKV
from tests.paged_cases import oracle, paged_batches
from tests.test_paged import small_runs
from tests.test_paged_quantized import dequantized_pool, quantized_pool


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
    text = explain_paged(q, pool, pool, table, lens, indptr, key_indices=torch.tensor([[[5, 0]], [[7, -1]]]),
                         kernel="tiled")
    assert "own call" in text and "kernel='tiled' forced" in text
    k_odd = torch.randn(8, 4, 1, 8)[::2]  # K's pages with a gap between them, V's not: no id names both rows
    text = explain_paged(q, k_odd, pool, table, lens, indptr, key_indices=torch.tensor([[[5, 0]], [[7, -1]]]))
    assert "own call" in text and "step pages, slots and heads differently" in text


@pytest.mark.skipif(native_unavailable() is not None, reason=f"{native_unavailable()}")
@settings(max_examples=60, deadline=None)
@given(problem=paged_batches(dtype=torch.float32), top=st.integers(1, 12), per_head=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int8]), head_major=st.booleans(),
       seed=st.integers(0, 1000))
def test_paged_key_indices_read_in_place_equal_the_oracle(problem, top, per_head, dtype, head_major, seed):
    args, options = problem
    options = {name: value for name, value in options.items() if name in ("window", "sinks", "softcap")}  # it takes
    q, k_pages, v_pages = args[:3]
    if head_major:  # [num_pages, Hkv, page_size, E] memory seen as [num_pages, page_size, Hkv, E]: a PagePool's
        k_pages, v_pages = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k_pages, v_pages))
    kv_heads, group = k_pages.shape[2], q.shape[1] // k_pages.shape[2]
    if dtype == torch.int8:  # per-token scales, laid out as a PagePool's; the oracle reads them dequantised
        k_pages, v_pages = (p if head_major else QuantizedKV(p.data.contiguous(), p.scale.contiguous())
                            for p in (quantized_pool(k_pages, dtype), quantized_pool(v_pages, dtype)))
        full_k, full_v = dequantized_pool(k_pages), dequantized_pool(v_pages)
    elif dtype == torch.bfloat16:  # (.to keeps the layout)
        k_pages, v_pages, q = (x.to(torch.bfloat16) for x in (k_pages, v_pages, q))
        full_k, full_v = k_pages.float(), v_pages.float()
    else:
        full_k, full_v = k_pages, v_pages
    listed = listed_for(args, top, kv_heads if per_head else 1, seed)
    listed[:, :, -1] = listed[:, :, 0]  # a repeat counts once
    step = plan_paged(q, k_pages, v_pages, *args[3:6], args[6], key_indices=listed, **options)
    assert step.path == "native in place" and "listed keys read, in place" in str(step), str(step)
    out, lse = step.run(q, k_pages, v_pages, return_lse=True)
    width = max(int(args[4].max()) if args[4].numel() else 0, 1)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for h in range(kv_heads):
        want, want_lse = oracle(q.float(), full_k, full_v, *args[3:], **options, allowed=dense_of(listed, width, h))
        heads = slice(h * group, (h + 1) * group)
        assert torch.isfinite(out[:, heads]).all()
        assert (out[:, heads].double() - want[:, heads]).abs().max().item() <= tolerance if out.numel() else True
        assert torch.equal(lse[:, heads].isneginf(), want_lse[:, heads].isneginf())
