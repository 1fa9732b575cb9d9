"""bf16 K/V of 8-15 query rows a KV head (a G 8 decode), or 16 of Dv up to 128, with their scores on AMX-BF16 tiles
(decode_native.cpp, ``scores_only``), against the float64 oracle: where the CPU has AMX-BF16 and Linux grants the
tiles, and q's values are all bf16 numbers, the tiles compute the scores and the vector path the softmax and the
weighted values, for every block, masked or not. These tests check that path where it runs, its edges (rows 8-16,
partial blocks and key groups, masks, key rows copied because pages do not keep them a stride apart, non-finite keys
and values hidden or seen), that a request's result does not depend on its batch, that batch-invariant mode and rows
below 8 keep the vector path, and explain(). Elsewhere they skip; the vector path is checked by
tests/test_decode_native.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine import causal_attention, paged_attention
from tests import test_batch_invariance as batch_invariance
from tests.test_decode_bf16_tiles import LIBRARY, TILES, bf16_numbers, call
from tests.test_decode_native import oracle

pytestmark = pytest.mark.skipif(not TILES, reason="no AMX-BF16 tiles here (a CPU without AMX-BF16, or not granted)")


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(8, 16), s=st.integers(1, 300), d=st.sampled_from([32, 64, 96, 128]),
       dv=st.sampled_from([32, 64, 160]), masked=st.sampled_from(["none", "some", "blocks"]),
       seed=st.integers(0, 2**16))
def test_the_score_tiles_match_the_float64_oracle(rows, s, d, dv, masked, seed):
    g = torch.Generator().manual_seed(seed)
    q_rows = bf16_numbers(2, 2, rows, d, generator=g)
    k, v = bf16_numbers(2, 2, s, d, generator=g).bfloat16(), bf16_numbers(2, 2, s, dv, generator=g).bfloat16()
    visible = torch.ones(2, 1, rows, s, dtype=torch.bool)
    if masked == "some":
        visible = torch.rand(2, 1, rows, s, generator=g) > 0.3
    elif masked == "blocks":  # every other block of 64 keys hidden from the odd rows
        visible[:, :, 1::2] = (torch.arange(s) // 64 % 2 == 0)
    out, lse = call(q_rows, k, v, visible, d ** -0.5)
    want, want_lse = oracle(q_rows, k.double(), v.double(), visible, d ** -0.5)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def test_the_score_tiles_agree_with_the_vector_path():
    # a bf16 model's G 8 decode, bf16 output: each path within one bf16 rounding of the oracle's and of the other's
    g = torch.Generator().manual_seed(4)
    q = bf16_numbers(1, 64, 1, 128, generator=g).bfloat16()  # Hq 64 / Hkv 8 (Llama 3 70B's)
    k, v = (bf16_numbers(1, 8, 1500, 128, generator=g).bfloat16() for _ in "kv")
    tiles = causal_attention(q, k, v)
    LIBRARY.use_bf16_tiles(False)
    try:
        vector = causal_attention(q, k, v)
    finally:
        LIBRARY.use_bf16_tiles(True)
    every_key = torch.ones(1, 1, 1, 1500, dtype=torch.bool)
    want, _ = oracle(q, k.repeat_interleave(8, 1), v.repeat_interleave(8, 1), every_key, 128 ** -0.5)
    for out in (tiles, vector):
        torch.testing.assert_close(out.double(), want, rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(tiles.float(), vector.float(), rtol=2**-7, atol=1e-6)
    assert not torch.equal(tiles, vector)  # (two paths: sums in another order somewhere)


def test_non_finite_keys_and_values_poison_only_the_rows_that_see_them():
    # a NaN key makes the rows that see it NaN (lse -inf), an inf value the channel of the rows that see it; a hidden
    # key's NaN score and a hidden inf value stay out of the rows that hide them
    g = torch.Generator().manual_seed(3)
    q_rows = bf16_numbers(1, 1, 8, 64, generator=g)
    k, v = bf16_numbers(1, 1, 200, 64, generator=g), bf16_numbers(1, 1, 200, 64, generator=g)
    k[0, 0, 10, 5] = float("nan")
    v[0, 0, 100, 7] = float("inf")
    visible = torch.ones(1, 1, 8, 200, dtype=torch.bool)
    visible[0, 0, 0:2, 10] = False   # rows 0, 1 do not see the NaN key
    visible[0, 0, 0, 100] = False    # row 0 does not see the inf value
    out, lse = call(q_rows, k.bfloat16(), v.bfloat16(), visible, 0.125)
    assert bool(out[0, 0, 2:].isnan().all()) and bool(torch.isneginf(lse[0, 0, 2:]).all())
    assert bool(out[0, 0, 1, 7].isnan()) and not bool(out[0, 0, 0].isnan().any())
    want, want_lse = oracle(q_rows, k.nan_to_num(0.0), v.nan_to_num(0.0, 0.0, 0.0), visible, 0.125)
    torch.testing.assert_close(out[0, 0, 0].double(), want[0, 0, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[0, 0, :2].double(), want_lse[0, 0, :2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size", [16, 24, 5])
def test_pages_of_any_size_match_the_oracle(page_size):
    # pages of 16 keep each group of 16 keys a stride apart (read in place by the tile loads); pages of 24 or 5 give
    # groups spanning pages, copied into rows a stride apart first
    g = torch.Generator().manual_seed(page_size)
    lengths = [300, 77]
    pages_per = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_per) + 3
    k_pool, v_pool = (bf16_numbers(num_pages, page_size, 2, 64, generator=g).bfloat16() for _ in "kv")
    order = torch.randperm(num_pages, generator=g)
    table = torch.zeros(2, max(pages_per), dtype=torch.int64)
    table[0, :pages_per[0]], table[1, :pages_per[1]] = order[:pages_per[0]], order[pages_per[0]:sum(pages_per)]
    q = bf16_numbers(2, 24, 64, generator=g).bfloat16()  # one query per sequence, G 12: 12 rows per KV head
    out = paged_attention(q, k_pool, v_pool, table, torch.tensor(lengths), torch.tensor([0, 1, 2]))
    for b, n in enumerate(lengths):
        pages = table[b, torch.arange(n) // page_size]
        k_seq = k_pool[pages, torch.arange(n) % page_size].permute(1, 0, 2)[None].double()  # [1, Hkv, n, D]
        v_seq = v_pool[pages, torch.arange(n) % page_size].permute(1, 0, 2)[None].double()
        want, _ = oracle(q[b][None, :, None], k_seq, v_seq, torch.ones(1, 1, 1, n, dtype=torch.bool), 64 ** -0.5)
        torch.testing.assert_close(out[b].double(), want[0, :, 0], rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("window", [None, 1300], ids=["full", "window"])
def test_a_request_is_bitwise_the_same_alone_in_any_batch_contiguous_or_paged(window, monkeypatch):
    # 8 rows a KV head (Hq 16 / Hkv 2): a request's blocks alone, padded in a batch, or paged in pages of any size
    monkeypatch.setattr(batch_invariance, "HQ", 16)
    mine, *others = batch_invariance.requests([777, 3000, 40, 2100], torch.bfloat16, seed=2)
    alone = batch_invariance.contiguous([mine], window)[0]
    for n in (1, 2):
        with batch_invariance.threads(n):
            for batch in ([mine] + others, others + [mine]):
                at = next(i for i, r in enumerate(batch) if r is mine)
                assert torch.equal(batch_invariance.contiguous(batch, window)[at], alone), (n, window)
                for page_size in (16, 24, 256):
                    assert torch.equal(batch_invariance.paged(batch, page_size, window=window)[at], alone)


def test_batch_invariant_mode_and_fewer_rows_keep_the_vector_path():
    q, k = torch.randn(1, 16, 1, 128).bfloat16(), torch.randn(1, 2, 300, 128).bfloat16()
    previous = engine.set_batch_invariant(True)
    try:
        assert "AMX-BF16" not in str(engine.explain(q, k, k))
        inside = causal_attention(q, k, k)
    finally:
        engine.set_batch_invariant(previous)
    LIBRARY.use_bf16_tiles(False)
    try:
        assert torch.equal(inside, causal_attention(q, k, k))  # (the vector path's result, bitwise)
        assert "AMX-BF16" not in str(engine.explain(q, k, k))  # turned off
    finally:
        LIBRARY.use_bf16_tiles(True)
    assert "scores on AMX-BF16 tiles" in str(engine.explain(q, k, k))  # G 8
    q16 = torch.randn(1, 32, 1, 128).bfloat16()
    assert "scores on AMX-BF16 tiles" in str(engine.explain(q16, k, k))  # G 16, Dv 128
    v256 = torch.randn(1, 2, 300, 256).bfloat16()
    assert "blocks whose rows see the same keys" in str(engine.explain(q16, k, v256))  # G 16, Dv 256: whole tiles
    assert "AMX-BF16" not in str(engine.explain(q[:, :14], k, k))  # G 7
    assert "AMX-BF16" not in str(engine.explain(q.float(), k.float(), k.float()))  # fp32 K
    # fp32 outputs: 7 rows give the vector path's bits with the tiles on or off, 8 rows other bits (the tiles ran)
    g = torch.Generator().manual_seed(8)
    kv = bf16_numbers(1, 1, 700, 128, generator=g).bfloat16()
    visible = torch.ones(1, 1, 8, 700, dtype=torch.bool)
    for rows, same in ((7, True), (8, False)):
        q_rows = bf16_numbers(1, 1, rows, 128, generator=g)
        on = call(q_rows, kv, kv, visible[:, :, :rows], 0.1)[0]
        LIBRARY.use_bf16_tiles(False)
        try:
            off = call(q_rows, kv, kv, visible[:, :, :rows], 0.1)[0]
        finally:
            LIBRARY.use_bf16_tiles(True)
        assert torch.equal(on, off) == same, rows
