"""bf16 K/V of many query rows a KV head on AMX-BF16 tiles (decode_native.cpp, "bf16 on AMX tiles, many rows"),
against the float64 oracle: where the CPU has AMX-BF16 and Linux grants the tiles, a call with at least 16 query rows
per KV head (a latent's heads, a tree's nodes x G, a top-k prefill's group) whose q values are all bf16 numbers runs
its unmasked blocks' scores and weighted values as tile products. These tests check that path where it runs (the
library says so: ``bf16_tiles``), its edges (rows past a multiple of 16, partial blocks and key groups, masked blocks
beside unmasked ones, key rows copied because pages do not keep them a stride apart, non-finite keys and values),
that it agrees with the same library's vector path, and that explain() names it. Elsewhere they skip; the vector path
is checked by tests/test_decode_native.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine import causal_attention
from engine.kernels.decode.decode_native import _call
from engine.kernels.decode.native_build import load_native
from engine.quantized import QuantizedKV, quantize
from tests import test_batch_invariance as batch_invariance
from tests.paged_cases import decode_pages_match, shuffled_pages
from tests.test_decode_native import oracle
from tests.test_paged_quantized import dequantized_pool, quantized_pool

KINDS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}

LIBRARY = load_native()
TILES = not isinstance(LIBRARY, str) and LIBRARY.bf16_tiles
pytestmark = pytest.mark.skipif(not TILES, reason="no AMX-BF16 tiles here (a CPU without AMX-BF16, or not granted)")


@pytest.fixture
def vector_path():
    """Runs the test's calls with the tiles turned off, and turns them back on after (even if the test fails)."""
    LIBRARY.use_bf16_tiles(False)
    yield
    LIBRARY.use_bf16_tiles(True)


def call(q_rows, k, v, visible, scale):
    """The kernel on q rows ``[B, Hkv, R, D]`` (fp32 holding bf16 numbers: an fp32 output, the weights in three
    pieces) and bf16 or QuantizedKV K / V: (out, lse), checked to return OK."""
    b, hkv, rows, _ = q_rows.shape
    out, lse = torch.zeros(b, hkv, rows, v.shape[-1]), torch.zeros(b, hkv, rows)
    keys, values = ((x.data, x.scale) if isinstance(x, QuantizedKV) else (x, None) for x in (k, v))
    assert _call(LIBRARY, q_rows, scale, keys, values, visible, out, lse) == 0
    return out, lse


def cache(x: torch.Tensor, kind: str):
    """x as the kind's K or V: bf16, or int8 / fp8 e4m3 with per-key scales (QuantizedKV)."""
    return x.bfloat16() if kind == "bf16" else quantize(x, KINDS[kind])


def exact(x) -> torch.Tensor:
    return x.dequantize(torch.float64) if isinstance(x, QuantizedKV) else x.double()


def bf16_numbers(*shape, generator, scale=1.0):
    return (torch.randn(*shape, generator=generator) * scale).bfloat16().float()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(16, 40), s=st.integers(1, 300), d=st.sampled_from([32, 64, 96, 128]),
       dv=st.sampled_from([32, 64, 160]), masked=st.sampled_from(["none", "some", "blocks"]),
       kind=st.sampled_from(["bf16", "int8", "fp8"]), seed=st.integers(0, 2**16))
def test_the_tiles_match_the_float64_oracle(rows, s, d, dv, masked, kind, seed):
    # rows past a multiple of 16 (a partial row group), S from one key past several blocks (partial key groups),
    # Dv past a slice of 128 channels; blocks masked (the vector path) beside unmasked ones (the tiles); bf16, int8
    # and fp8 caches (their scales applied to the scores and the weights)
    g = torch.Generator().manual_seed(seed)
    q_rows = bf16_numbers(2, 2, rows, d, generator=g)
    k, v = cache(torch.randn(2, 2, s, d, generator=g), kind), cache(torch.randn(2, 2, s, dv, generator=g), kind)
    matches_the_oracle(q_rows, k, v, masked, g)


def matches_the_oracle(q_rows, k, v, masked: str, generator) -> None:
    """The kernel on ``q_rows [2, 2, R, D]`` and K / V (bf16 or QuantizedKV) equals the float64 oracle within 1e-5,
    every key visible (``masked`` "none"), each hidden at random ("some"), or every other block of 64 keys hidden from
    the odd rows ("blocks")."""
    rows, d, s = q_rows.shape[2], q_rows.shape[3], k.shape[2]
    visible = torch.ones(2, 1, rows, s, dtype=torch.bool)
    if masked == "some":
        visible = torch.rand(2, 1, rows, s, generator=generator) > 0.3
    elif masked == "blocks":
        visible[:, :, 1::2] = (torch.arange(s) // 64 % 2 == 0)
    out, lse = call(q_rows, k, v, visible, d ** -0.5)
    want, want_lse = oracle(q_rows, exact(k), exact(v), visible, d ** -0.5)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def test_a_bf16_output_is_within_its_rounding_and_agrees_with_the_vector_path(vector_path):
    # a bf16 q (a bf16 model's): the output is bf16, the weights in two pieces (2^-17 of each), so the tiles' output
    # is the oracle's rounded to bf16 give or take one rounding, as the vector path's
    g = torch.Generator().manual_seed(4)
    q = bf16_numbers(1, 32, 4, 128, generator=g).bfloat16()  # Hq 32 / Hkv 2, T 4: 64 rows a KV head
    k, v = (bf16_numbers(1, 2, 700, 128, generator=g).bfloat16() for _ in "kv")
    vector = causal_attention(q, k, v)
    LIBRARY.use_bf16_tiles(True)
    tiles = causal_attention(q, k, v)
    visible = torch.arange(700) <= torch.arange(696, 700)[:, None]
    want, _ = oracle(q, k, v, visible[None, None], 128 ** -0.5)
    for out in (tiles, vector):
        torch.testing.assert_close(out.double(), want, rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(tiles.float(), vector.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("heads", [16, 20, 128])
def test_a_latent_step_reads_shared_rows_on_the_tiles(heads):
    # absorbed MLA: every head on one latent row of 576, V its first 512 (each row read once)
    g = torch.Generator().manual_seed(heads)
    q = bf16_numbers(1, heads, 1, 576, generator=g, scale=0.2)
    rows = bf16_numbers(1, 1, 333, 576, generator=g)
    out, lse = call(q.view(1, 1, heads, 576), rows.bfloat16(), rows.bfloat16()[..., :512],
                    torch.ones(1, 1, heads, 333, dtype=torch.bool), 0.05)
    want, want_lse = oracle(q, rows, rows[..., :512], torch.ones(1, 1, 1, 333, dtype=torch.bool), 0.05)
    torch.testing.assert_close(out.view(1, heads, 1, 512).double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.view(1, heads, 1).double(), want_lse, rtol=1e-5, atol=1e-5)
    assert "AMX-BF16 tiles" in str(engine.explain(q.bfloat16(), rows.bfloat16(), rows.bfloat16()[..., :512]))


@pytest.mark.parametrize(("rows", "dv"), [(16, 160), (8, 64)], ids=["16 rows, whole tiles", "8 rows, score tiles"])
def test_non_finite_keys_and_values_poison_only_the_rows_that_see_them(rows, dv):
    # a NaN key makes the rows that see it NaN (lse -inf), an inf value the channel of the rows that see it; rows that
    # do not see them (their blocks masked: the vector path; the score tiles' values: any block) are untouched, and an
    # unmasked block's inf value reaches every row (on the tiles)
    g = torch.Generator().manual_seed(3)
    q_rows = bf16_numbers(1, 1, rows, 64, generator=g)
    k, v = bf16_numbers(1, 1, 200, 64, generator=g), bf16_numbers(1, 1, 200, dv, generator=g)
    k[0, 0, 10, 5] = float("nan")
    v[0, 0, 100, 7] = float("inf")
    v[0, 0, 150, 9] = float("inf")  # block 2: seen whole by every row
    visible = torch.ones(1, 1, rows, 200, dtype=torch.bool)
    visible[0, 0, 0:2, 10] = False   # rows 0, 1 do not see the NaN key
    visible[0, 0, 0, 100] = False    # row 0 does not see the first inf value
    out, lse = call(q_rows, k.bfloat16(), v.bfloat16(), visible, 0.125)
    assert bool(out[0, 0, 2:].isnan().all()) and bool(torch.isneginf(lse[0, 0, 2:]).all())
    assert bool(out[0, 0, 1, 7].isnan()) and not bool(out[0, 0, 0, 7].isnan())
    assert bool(out[0, 0, :2, 9].isnan().all())
    clean = [c for c in range(dv) if c not in (7, 9)]
    want, want_lse = oracle(q_rows, k.nan_to_num(0.0), v.nan_to_num(0.0, 0.0, 0.0), visible, 0.125)
    torch.testing.assert_close(out[0, 0, :2, clean].double(), want[0, 0, :2, clean], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[0, 0, :2].double(), want_lse[0, 0, :2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size", [16, 24, 5])
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_pages_of_any_size_match_the_oracle(page_size, kind):
    # pages of 16 keep each group of 16 bf16 keys a stride apart (read in place by the tile loads); pages of 24 or 5
    # give groups spanning pages, copied into rows a stride apart first (int8 rows: widened into them); D 160: the
    # whole tiles (16 rows of Dv up to 128 take the score tiles: tests/test_decode_score_tiles.py)
    g = torch.Generator().manual_seed(page_size)
    lengths = [300, 77]
    num_pages, table = shuffled_pages(lengths, page_size, g)
    k_pool, v_pool = (bf16_numbers(num_pages, page_size, 2, 160, generator=g).bfloat16() for _ in "kv")
    if kind == "int8":
        k_pool, v_pool = (quantized_pool(x.float(), torch.int8) for x in (k_pool, v_pool))
    q = bf16_numbers(2, 32, 160, generator=g).bfloat16()  # one query per sequence, G 16: 16 rows per KV head
    exact = dequantized_pool if kind == "int8" else torch.Tensor.double
    decode_pages_match(q, k_pool, v_pool, table, lengths, exact, rtol=2**-8, atol=1e-6)


def test_explain_names_the_tiles_where_they_run(vector_path):
    q, k = torch.randn(1, 32, 1, 128).bfloat16(), torch.randn(1, 2, 300, 128).bfloat16()
    LIBRARY.use_bf16_tiles(True)
    assert "AMX-BF16 tiles" in str(engine.explain(q, k, k))  # G 16: 16 rows a KV head
    assert "blocks whose rows" not in str(engine.explain(q[:, :16], k, k))  # G 8: its scores alone (score tiles)
    assert "AMX-BF16 tiles" not in str(engine.explain(q.float(), k.float(), k.float()))  # fp32 K
    assert "AMX-BF16 tiles" not in str(engine.explain(q[..., :72], k[..., :72], k[..., :72]))  # D 72
    for kind, name in (("int8", "int8 K/V, 16 rows"), ("fp8", "fp8 e4m3 K/V, 16 rows")):
        kq, vq = (cache(torch.randn(1, 2, 300, 128), kind) for _ in "kv")
        assert name in str(engine.explain(q, kq, vq))
        assert "AMX-BF16 tiles" not in str(engine.explain(q.float(), kq, vq))  # an fp32 q: the vector path
    qt, listed = torch.randn(1, 32, 40, 128).bfloat16(), torch.randint(0, 300, (1, 1, 40, 64))
    text = str(engine.explain(qt, k, k, torch.arange(260, 300), torch.arange(300), key_indices=listed))
    assert "listed keys" in text and "16 rows a KV head" in text  # each query its own list: G rows
    LIBRARY.use_bf16_tiles(False)
    assert "AMX-BF16 tiles" not in str(engine.explain(q, k, k))  # turned off


def test_fp8_nan_codes_poison_only_the_rows_that_see_them():
    # e4m3's NaN codes (0x7F, 0xFF) widened to bf16 NaN on the tiles: a NaN key makes its rows NaN, a NaN value its
    # channel; rows whose blocks hide them (the vector path) are untouched
    fp8_nan_codes_poison_only_their_rows(16, 200, seed=5)


def fp8_nan_codes_poison_only_their_rows(rows: int, s: int, seed: int) -> None:
    """An fp8 call of ``rows`` query rows over ``s`` keys (D 64): a NaN code in key 20, hidden from row 0, makes every
    other row NaN (lse -inf); one in value 150's channel 9 makes that channel of row 0 NaN, and nothing else of it."""
    g = torch.Generator().manual_seed(seed)
    q_rows = bf16_numbers(1, 1, rows, 64, generator=g)
    k, v = (quantize(torch.randn(1, 1, s, 64, generator=g), torch.float8_e4m3fn) for _ in "kv")
    k.data.view(torch.uint8)[0, 0, 20, 3] = 0x7F
    v.data.view(torch.uint8)[0, 0, 150, 9] = 0xFF
    visible = torch.ones(1, 1, rows, s, dtype=torch.bool)
    visible[0, 0, 0, 20] = False  # row 0 does not see the NaN key
    out, lse = call(q_rows, k, v, visible, 0.125)
    assert bool(out[0, 0, 1:].isnan().all()) and bool(torch.isneginf(lse[0, 0, 1:]).all())
    assert bool(out[0, 0, 0, 9].isnan()) and not bool(out[0, 0, 0, :9].isnan().any())
    want, want_lse = oracle(q_rows, exact(k).nan_to_num(0.0), exact(v).nan_to_num(0.0), visible, 0.125)
    torch.testing.assert_close(out[0, 0, 0, :9].double(), want[0, 0, 0, :9], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[0, 0, 0].double(), want_lse[0, 0, 0], rtol=1e-5, atol=1e-5)


def tiles_change_the_bits(q_rows, kv, visible) -> bool:
    """Whether the kernel's fp32 output for ``q_rows`` over ``kv`` (K and V alike) differs with the tiles turned off:
    the tiles ran (sums in another order)."""
    on = call(q_rows, kv, kv, visible, 0.1)[0]
    LIBRARY.use_bf16_tiles(False)
    try:
        off = call(q_rows, kv, kv, visible, 0.1)[0]
    finally:
        LIBRARY.use_bf16_tiles(True)
    return not torch.equal(on, off)


@pytest.mark.parametrize("window", [None, 1300], ids=["full", "window"])
@pytest.mark.parametrize(("hq", "d"), [(32, 160), (16, 32)], ids=["16 rows, whole tiles", "8 rows, score tiles"])
def test_a_request_on_the_tiles_is_bitwise_the_same_alone_in_any_batch_contiguous_or_paged(window, hq, d, monkeypatch):
    # 16 rows a KV head (Hq 32 / Hkv 2) of Dv 160: a request's last block alone (partial, unmasked) and in a padded
    # batch (the padding hidden from every row: still on the tiles, its rows never read) compute alike; so do pages of
    # any size. 8 rows (Hq 16): the scores alone on the tiles (tests/test_decode_score_tiles.py), any block
    monkeypatch.setattr(batch_invariance, "HQ", hq)
    mine, *others = batch_invariance.requests([777, 3000, 40, 2100], torch.bfloat16, seed=2, d=d)  # (mine padded)
    alone = batch_invariance.contiguous([mine], window)[0]
    for n in (1, 2):
        with batch_invariance.threads(n):
            for batch in ([mine] + others, others + [mine]):
                at = next(i for i, r in enumerate(batch) if r is mine)
                assert torch.equal(batch_invariance.contiguous(batch, window)[at], alone), (n, window)
                for page_size in (16, 24, 256):
                    assert torch.equal(batch_invariance.paged(batch, page_size, window=window)[at], alone)
    mine_int8 = batch_invariance.paged([mine], 16, quantized=True)[0]
    assert torch.equal(batch_invariance.paged(others + [mine], 24, quantized=True)[-1], mine_int8)


@pytest.mark.parametrize(("hq", "d"), [(32, 160), (16, 128)], ids=["16 rows, whole tiles", "8 rows, score tiles"])
def test_batch_invariant_mode_keeps_every_row_off_the_tiles(hq, d):
    # there a row's result must not depend on how many rows share its call (a prefill chunked or whole), and the
    # tiles take a call's rows 16 at a time: the vector path runs, and explain() says so
    q, k = torch.randn(1, hq, 1, d).bfloat16(), torch.randn(1, 2, 300, d).bfloat16()
    assert "AMX-BF16 tiles" in str(engine.explain(q, k, k))
    previous = engine.set_batch_invariant(True)
    try:
        assert "AMX-BF16 tiles" not in str(engine.explain(q, k, k))
        inside = causal_attention(q, k, k)
    finally:
        engine.set_batch_invariant(previous)
    LIBRARY.use_bf16_tiles(False)
    try:
        assert torch.equal(inside, causal_attention(q, k, k))
    finally:
        LIBRARY.use_bf16_tiles(True)


def test_a_key_hidden_from_every_row_keeps_its_nan_scales_out():
    # padding every row hides (a block of uniform visibility: on the tiles) whose int8 scales are NaN: its weight is
    # 0 and its value row never read, so nothing reaches the rows
    g = torch.Generator().manual_seed(6)
    q_rows = bf16_numbers(1, 1, 16, 64, generator=g)
    k, v = (quantize(torch.randn(1, 1, 130, 64, generator=g), torch.int8) for _ in "kv")
    k.scale[0, 0, 120:] = float("nan")
    v.scale[0, 0, 120:] = float("nan")
    visible = (torch.arange(130) < 120).expand(1, 1, 16, 130).contiguous()
    out, lse = call(q_rows, k, v, visible, 0.125)
    want, want_lse = oracle(q_rows, exact(k).nan_to_num(0.0), exact(v).nan_to_num(0.0), visible, 0.125)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_a_non_finite_key_every_row_sees_makes_those_rows_nan_on_the_tiles(kind):
    # the block holding it is one every row sees (on the tiles): its KV head's rows are NaN with lse -inf; the other
    # KV head's rows, and a later call without it, are untouched
    g = torch.Generator().manual_seed(7)
    q_rows = bf16_numbers(1, 2, 16, 64, generator=g)
    k, v = cache(torch.randn(1, 2, 200, 64, generator=g), kind), cache(torch.randn(1, 2, 200, 64, generator=g), kind)
    if kind == "bf16":
        k[0, 0, 70, 5] = float("inf")
    else:
        k.data.view(torch.uint8)[0, 0, 70, 5] = 0x7F  # an e4m3 NaN code
    visible = torch.ones(1, 1, 16, 200, dtype=torch.bool)
    out, lse = call(q_rows, k, v, visible, 0.125)
    assert bool(out[0, 0].isnan().all()) and bool(torch.isneginf(lse[0, 0]).all())
    want, want_lse = oracle(q_rows[:, 1:], exact(k)[:, 1:], exact(v)[:, 1:], visible, 0.125)
    torch.testing.assert_close(out[:, 1:].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[:, 1:].double(), want_lse, rtol=1e-5, atol=1e-5)
