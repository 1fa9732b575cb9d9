"""int8 K/V on AMX tiles (decode_native.cpp, "int8 on AMX tiles"), against the float64 oracle over the dequantized
cache: where the CPU has AMX-INT8 and Linux grants the tiles, an int8 cache's scores and weighted values are integer
dot products of fixed-point digits of q and of the weights. These tests check that path where it runs (the library
says so: ``amx``), its edges (partial blocks and groups, masks, rows copied because they are not evenly spaced,
non-finite and extreme scales, extreme q) and that explain() names it. Elsewhere they skip; the same calls' vector
paths are checked by tests/test_decode_native.py (its AVX-512 build has no AMX)."""

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
from tests.paged_cases import decode_pages_match, shuffled_pages
from tests.test_batch_invariance import paged, requests
from tests.test_decode_native import oracle
from tests.test_paged_quantized import dequantized_pool, quantized_pool

LIBRARY = load_native()
AMX = not isinstance(LIBRARY, str) and LIBRARY.amx
pytestmark = pytest.mark.skipif(not AMX, reason="no AMX tiles here (a CPU without AMX-INT8, or not granted)")


def call(q_rows, kq, vq, visible):
    """The kernel on q rows ``[B, Hkv, R, D]`` (already scaled) and int8 K/V: (out, lse), checked to return OK."""
    b, hkv, rows, _ = q_rows.shape
    out, lse = torch.zeros(b, hkv, rows, vq.shape[-1]), torch.zeros(b, hkv, rows)
    assert _call(LIBRARY, q_rows, 1.0, (kq.data, kq.scale), (vq.data, vq.scale), visible, out, lse) == 0
    return out, lse


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 16), s=st.integers(1, 300), d=st.sampled_from([64, 128]), dv=st.sampled_from([64, 128, 192]),
       masked=st.booleans(), seed=st.integers(0, 2**16))
def test_int8_on_amx_tiles_matches_the_float64_oracle(rows, s, d, dv, masked, seed):
    # every block shape: S from 1 (a group of one key) past several blocks, blocks masked or run unmasked; 1-4 rows a
    # KV head in one group of tiles, up to 16 in four (a G 8 decode: two; an fp32 q here, so 16 rows too)
    g = torch.Generator().manual_seed(seed)
    q_rows = torch.randn(2, 2, rows, d, generator=g) * 0.3
    kq = quantize(torch.randn(2, 2, s, d, generator=g), torch.int8)
    vq = quantize(torch.randn(2, 2, s, dv, generator=g), torch.int8)
    visible = torch.rand(2, 1, rows, s, generator=g) > 0.3 if masked else torch.ones(2, 1, rows, s, dtype=torch.bool)
    out, lse = call(q_rows, kq, vq, visible)
    want, want_lse = oracle(q_rows, kq.dequantize(torch.float64), vq.dequantize(torch.float64), visible, 1.0)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("magnitude", [0.0, 1e-36, 1e-20, 1.0, 1e15])
def test_q_rows_of_any_magnitude_match_the_oracle(magnitude):
    # q's fixed point is relative to each row's largest |q|: zero rows, rows too small for it (below 2^-100: the
    # vector path) and large ones (scores far past the max: one key takes all the weight)
    g = torch.Generator().manual_seed(1)
    q_rows = torch.randn(1, 2, 8, 128, generator=g)
    q_rows[:, :, 1] *= magnitude
    q_rows[:, :, 6] *= magnitude  # (a row of the second group of tiles)
    kq, vq = (quantize(torch.randn(1, 2, 200, 128, generator=g), torch.int8) for _ in range(2))
    visible = torch.ones(1, 1, 8, 200, dtype=torch.bool)
    out, lse = call(q_rows, kq, vq, visible)
    want, want_lse = oracle(q_rows.double(), kq.dequantize(torch.float64), vq.dequantize(torch.float64), visible, 1.0)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def test_value_scales_of_any_magnitude_match_the_oracle():
    # the weights' fixed point is relative to each block's largest weight times its value scale: a block of tiny
    # scales (below 2^-100 after the softmax: the vector path), one of huge ones
    g = torch.Generator().manual_seed(2)
    q_rows = torch.randn(1, 1, 4, 64, generator=g)
    kq = quantize(torch.randn(1, 1, 256, 64, generator=g), torch.int8)
    vq = quantize(torch.randn(1, 1, 256, 64, generator=g), torch.int8)
    vq.scale[..., :64] *= 1e-35
    vq.scale[..., 128:192] *= 1e20
    visible = torch.ones(1, 1, 4, 256, dtype=torch.bool)
    out, _ = call(q_rows, kq, vq, visible)
    want, _ = oracle(q_rows, kq.dequantize(torch.float64), vq.dequantize(torch.float64), visible, 1.0)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=want.abs().max().item() * 1e-6)


def test_non_finite_scales_poison_only_the_rows_that_see_them():
    # a NaN key scale makes the rows that see the key NaN (lse -inf); a NaN value scale the channels of the rows that
    # see it (the block's values then take the vector path); rows that do not see them are untouched
    g = torch.Generator().manual_seed(3)
    q_rows = torch.randn(1, 1, 4, 128, generator=g)
    kq, vq = (quantize(torch.randn(1, 1, 150, 128, generator=g), torch.int8) for _ in range(2))
    kq.scale[0, 0, 10] = float("nan")
    vq.scale[0, 0, 100] = float("inf")
    visible = torch.ones(1, 1, 4, 150, dtype=torch.bool)
    visible[0, 0, 0:2, 10] = False  # rows 0, 1 do not see the NaN key
    visible[0, 0, 0, 100] = False   # row 0 does not see the inf value
    out, lse = call(q_rows, kq, vq, visible)
    assert bool(out[0, 0, 2:].isnan().all()) and bool(torch.isneginf(lse[0, 0, 2:]).all())
    assert bool(out[0, 0, 1].isnan().all())
    clean_k = kq.dequantize(torch.float64).nan_to_num(0.0)
    clean_v = vq.dequantize(torch.float64).nan_to_num(0.0, 0.0, 0.0)
    want, want_lse = oracle(q_rows, clean_k, clean_v, visible, 1.0)
    torch.testing.assert_close(out[0, 0, 0].double(), want[0, 0, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[0, 0, :2].double(), want_lse[0, 0, :2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size", [16, 24, 5])
def test_pages_of_any_size_match_the_oracle(page_size):
    # pages of 16 give each group of 16 keys one evenly spaced run (read in place by the tile loads); pages of 24
    # or 5 give groups spanning pages, copied into 16 evenly spaced rows first
    g = torch.Generator().manual_seed(page_size)
    lengths = [300, 77]
    num_pages, table = shuffled_pages(lengths, page_size, g)
    kq, vq = (quantized_pool(torch.randn(num_pages, page_size, 2, 128, generator=g), torch.int8) for _ in range(2))
    kv_lens, indptr = torch.tensor(lengths), torch.tensor([0, 1, 2])
    q = torch.randn(2, 8, 128, generator=g)  # one query per sequence, G 4: four rows per KV head
    text = engine.explain_paged(q, kq, vq, table, kv_lens, indptr)
    assert "decode_native reads K/V in place" in text, text
    decode_pages_match(q, kq, vq, table, lengths, dequantized_pool, rtol=1e-5, atol=1e-5)


def test_explain_names_the_tiles_where_they_run():
    q, k = torch.randn(1, 8, 1, 128), quantize(torch.randn(1, 2, 300, 128), torch.int8)
    assert "AMX tiles" not in str(engine.explain(q, k, k))  # K and V one tensor (a latent's): the vector path
    v = quantize(torch.randn(1, 2, 300, 128), torch.int8)
    assert "AMX tiles" in str(engine.explain(q, k, v))
    assert "int8 K/V on AMX tiles" in str(engine.explain(torch.randn(1, 16, 1, 128), k, v))  # G 8: two groups of 4
    assert "int8 K/V on AMX tiles" in str(engine.explain(torch.randn(1, 32, 1, 128), k, v))  # G 16, an fp32 q
    assert "AMX tiles" not in str(engine.explain(torch.randn(1, 48, 1, 128), k, v))  # G 24, an fp32 q: the vectors
    if LIBRARY.bf16_tiles:  # G 16 of a bf16 q: the bf16 tiles
        text = str(engine.explain(torch.randn(1, 32, 1, 128).bfloat16(), k, v))
        assert "AMX-BF16 tiles" in text and "int8 K/V on AMX tiles" not in text, text
    k96, v96 = (quantize(torch.randn(1, 2, 300, 96), torch.int8) for _ in range(2))
    assert "AMX tiles" not in str(engine.explain(torch.randn(1, 8, 1, 96), k96, v96))  # D 96: not in 64-channel tiles


def test_a_rows_result_on_the_tiles_is_bitwise_the_same_with_masked_keys_after_its_last():
    # batch invariance: a row's keys end a block alone, or sit before masked padding in a batch (the tiles then
    # read the padding's rows, weighted 0, and the block's largest weight is still the row's own)
    g = torch.Generator().manual_seed(9)
    for rows in (4, 3, 8, 14):  # (one group of rows; two or four)
        for n in (17, 18, 66, 131):
            q_rows = torch.randn(1, 2, rows, 64, generator=g)
            kq, vq = (quantize(torch.randn(1, 2, n + 21, 64, generator=g), torch.int8) for _ in range(2))
            alone = call(q_rows, *(QuantizedKV(x.data[:, :, :n], x.scale[:, :, :n]) for x in (kq, vq)),
                         torch.ones(1, 1, rows, n, dtype=torch.bool))
            visible = (torch.arange(n + 21) < n).expand(1, 1, rows, n + 21).contiguous()
            padded = call(q_rows, kq, vq, visible)
            assert torch.equal(alone[0], padded[0]) and torch.equal(alone[1], padded[1]), (rows, n)


@pytest.mark.parametrize("page_size", [16, 24])
def test_a_request_on_the_tiles_is_bitwise_the_same_paged_or_contiguous_alone_or_batched(page_size):
    # its rows read in place (pages of 16) or copied into evenly spaced ones (24): the same integers either way
    batch = requests([2100, 300, 77], torch.float32, seed=11, d=128)  # Hq 8 / Hkv 2: four rows per KV head
    out = paged(batch, page_size, quantized=True)
    for b, (q, k, v) in enumerate(batch):
        alone = causal_attention(q[None], quantize(k[None], torch.int8), quantize(v[None], torch.int8))[0, :, 0]
        assert torch.equal(out[b], alone), b
