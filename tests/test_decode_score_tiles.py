"""bf16 K/V of 8-15 query rows a KV head (a G 8 decode), or 16 of Dv up to 128, and fp8 e4m3 K/V of 4-15 rows (a G 4
decode; D and Dv multiples of 64), with their scores on AMX-BF16 tiles (decode_native.cpp, ``scores_only``), against
the float64 oracle: where the CPU has AMX-BF16 and Linux grants the tiles, and q's values are all bf16 numbers, the
tiles compute the scores and the vector path the softmax and the weighted values, for every block, masked or not.
These tests check that path where it runs, its edges (rows 8-16, fp8's 4-15, partial blocks and key groups, masks,
key rows copied because pages do not keep them a stride apart, fp8's NaN codes), that fewer rows keep the vector
path, and explain(); bf16's non-finite keys and values, a request's result alone or in any batch, and
batch-invariant mode are checked in tests/test_decode_bf16_tiles.py. Elsewhere they skip; the vector path is checked
by tests/test_decode_native.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine import causal_attention
from engine.kernels.decode.native_build import f8_words_built
from engine.quantized import quantize
from tests import test_batch_invariance as batch_invariance
from tests.paged_cases import decode_pages_match, shuffled_pages
from tests.test_decode_bf16_tiles import (
    LIBRARY,
    TILES,
    bf16_numbers,
    fp8_nan_codes_poison_only_their_rows,
    matches_the_oracle,
    tiles_change_the_bits,
)
from tests.test_decode_native import oracle
from tests.test_paged_quantized import dequantized_pool, quantized_pool

FP8 = torch.float8_e4m3fn

pytestmark = pytest.mark.skipif(not TILES, reason="no AMX-BF16 tiles here (a CPU without AMX-BF16, or not granted)")


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(8, 16), s=st.integers(1, 300), d=st.sampled_from([32, 64, 96, 128]),
       dv=st.sampled_from([32, 64, 160]), masked=st.sampled_from(["none", "some", "blocks"]),
       seed=st.integers(0, 2**16))
def test_the_score_tiles_match_the_float64_oracle(rows, s, d, dv, masked, seed):
    g = torch.Generator().manual_seed(seed)
    q_rows = bf16_numbers(2, 2, rows, d, generator=g)
    k, v = bf16_numbers(2, 2, s, d, generator=g).bfloat16(), bf16_numbers(2, 2, s, dv, generator=g).bfloat16()
    matches_the_oracle(q_rows, k, v, masked, g)


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


@pytest.mark.parametrize("page_size", [16, 24, 5])
def test_pages_of_any_size_match_the_oracle(page_size):
    # pages of 16 keep each group of 16 keys a stride apart (read in place by the tile loads); pages of 24 or 5 give
    # groups spanning pages, copied into rows a stride apart first
    g = torch.Generator().manual_seed(page_size)
    lengths = [300, 77]
    num_pages, table = shuffled_pages(lengths, page_size, g)
    k_pool, v_pool = (bf16_numbers(num_pages, page_size, 2, 64, generator=g).bfloat16() for _ in "kv")
    q = bf16_numbers(2, 24, 64, generator=g).bfloat16()  # one query per sequence, G 12: 12 rows per KV head
    decode_pages_match(q, k_pool, v_pool, table, lengths, torch.Tensor.double, rtol=2**-8, atol=1e-6)


def test_fewer_rows_keep_the_vector_path_and_explain_says_which_tiles():
    # (batch-invariant mode keeps the vector path: tests/test_decode_bf16_tiles.py)
    q, k = torch.randn(1, 16, 1, 128).bfloat16(), torch.randn(1, 2, 300, 128).bfloat16()
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
    for rows, ran in ((7, False), (8, True)):
        q_rows = bf16_numbers(1, 1, rows, 128, generator=g)
        assert tiles_change_the_bits(q_rows, kv, torch.ones(1, 1, rows, 700, dtype=torch.bool)) == ran, rows


fp8_words = pytest.mark.skipif(not f8_words_built(), reason="fp8 is read as bf16 words only with AVX512-VBMI")


@fp8_words
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(4, 15), s=st.integers(1, 400), d=st.sampled_from([64, 128, 192]),
       dv=st.sampled_from([64, 128, 192]), masked=st.sampled_from(["none", "some", "blocks"]),
       seed=st.integers(0, 2**16))
def test_fp8_score_tiles_match_the_float64_oracle(rows, s, d, dv, masked, seed):
    # fp8 K rows widened into tile rows in the words' channel order (q's tiles alike), the per-key scales on the sums;
    # S from one key past whole blocks and key groups
    g = torch.Generator().manual_seed(seed)
    q_rows = bf16_numbers(2, 2, rows, d, generator=g)
    k, v = quantize(torch.randn(2, 2, s, d, generator=g), FP8), quantize(torch.randn(2, 2, s, dv, generator=g), FP8)
    matches_the_oracle(q_rows, k, v, masked, g)


@fp8_words
def test_fp8_nan_codes_on_the_score_tiles_poison_only_the_rows_that_see_them():
    # a NaN code in K makes the rows that see it NaN (lse -inf), one in V the channel of the rows that see it
    fp8_nan_codes_poison_only_their_rows(4, 300, seed=6)


@fp8_words
@pytest.mark.parametrize("page_size", [16, 24, 5])
def test_fp8_pages_of_any_size_match_the_oracle(page_size):
    g = torch.Generator().manual_seed(page_size)
    lengths = [300, 77]
    num_pages, table = shuffled_pages(lengths, page_size, g)
    k_pool, v_pool = (quantized_pool(torch.randn(num_pages, page_size, 2, 128, generator=g), FP8) for _ in "kv")
    q = bf16_numbers(2, 8, 128, generator=g).bfloat16()  # one query per sequence, G 4: 4 rows per KV head
    decode_pages_match(q, k_pool, v_pool, table, lengths, dequantized_pool, rtol=2**-8, atol=1e-6)


@fp8_words
def test_fp8_of_fewer_rows_keeps_the_vector_path_and_explain_says_which():
    q, kv = torch.randn(1, 8, 1, 128).bfloat16(), quantize(torch.randn(1, 2, 300, 128), FP8)
    assert "fp8 e4m3 K/V, 4 rows a KV head: scores on AMX-BF16 tiles" in str(engine.explain(q, kv, kv))  # G 4
    assert "AMX-BF16" not in str(engine.explain(q[:, :6], kv, kv))  # G 3
    assert "AMX-BF16" not in str(engine.explain(q.float(), kv, kv))  # an fp32 q
    k96 = quantize(torch.randn(1, 2, 300, 96), FP8)
    assert "AMX-BF16" not in str(engine.explain(q[..., :96], k96, k96))  # D 96: not read as words
    # fp32 outputs: 3 rows give the vector path's bits with the tiles on or off, 4 rows other bits (the tiles ran)
    g = torch.Generator().manual_seed(9)
    kv = quantize(torch.randn(1, 1, 700, 128, generator=g), FP8)
    for rows, ran in ((3, False), (4, True)):
        q_rows = bf16_numbers(1, 1, rows, 128, generator=g)
        assert tiles_change_the_bits(q_rows, kv, torch.ones(1, 1, rows, 700, dtype=torch.bool)) == ran, rows


@fp8_words
def test_an_fp8_request_is_bitwise_the_same_alone_or_beside_longer_ones(monkeypatch):
    # G 4 (Hq 8 / Hkv 2), D 64: whether the score tiles run depends on the call's rows and kinds, not on its keys, so a
    # short request runs the same path alone as beside requests of thousands of keys; q fp32 holding bf16 numbers
    # (the tiles take it), so the outputs are fp32 and show the two paths' last bits apart
    monkeypatch.setattr(batch_invariance, "HQ", 8)
    mine, *others = ((q.float(), k, v) for q, k, v in batch_invariance.requests([200, 3000, 40], torch.bfloat16,
                                                                              seed=3, d=64))
    alone = batch_invariance.paged([mine], 16, quantized=FP8)[0]
    for n in (1, 2):
        with batch_invariance.threads(n):
            for batch in ([mine] + others, others + [mine]):
                at = next(i for i, r in enumerate(batch) if r is mine)
                for page_size in (16, 24):
                    assert torch.equal(batch_invariance.paged(batch, page_size, quantized=FP8)[at], alone)
