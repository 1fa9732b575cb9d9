"""Scores as AVX512-BF16 pair dot products (decode_native.cpp, DN_BF16_DOT), against the float64 oracle: where the
CPU has AVX512-BF16, a bf16, int8 or fp8 cache read by a q whose values are all bf16 numbers (a bf16 model's) has
each score summed by vdpbf16ps (bf16 K as stored, int8 / fp8 widened exactly to bf16), from the unscaled q, the
softmax scale applied to each sum. These tests check that path where it runs (the library says so: ``bf16_dot``),
its edges (remainder keys and rows, masks, non-finite keys and codes, extreme q, a scale other than 1) and that
explain() names it; a q with other values takes the FMA path. The library takes the path only where vdpbf16ps costs
about an FMA's time (``dot_rates``, timed as it loads): these tests force it on where the build has it, and check the
choice. Elsewhere they skip; the same calls' other paths are checked by tests/test_decode_native.py (its AVX-512 build
has no AVX512-BF16)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine import causal_attention
from engine.kernels.decode import native_build
from engine.kernels.decode.decode_native import _call
from engine.kernels.decode.native_build import load_native, native_amx, native_bf16_dot
from engine.quantized import QUANTIZED_DTYPES, quantize
from tests.test_batch_invariance import paged, requests
from tests.test_decode_native import oracle

LIBRARY = load_native()
DOT = not isinstance(LIBRARY, str) and LIBRARY.dot_rates is not None  # (the build has the path)
pytestmark = pytest.mark.skipif(not DOT, reason="no AVX512-BF16 here (or no native library)")


@pytest.fixture(autouse=True)
def dot_products():
    """The path forced on (the library would take the FMAs where vdpbf16ps costs more than about an FMA), then set
    back as it was (by the rates, or as ATTENTION_ENGINE_BF16_DOT forced it); the AMX-BF16 tiles, which take bf16 K
    of 8 rows and more and fp8 of 4 and more where the CPU has them (tests/test_decode_score_tiles.py), turned off
    meanwhile, so that these calls take the dot products."""
    before, tiles = LIBRARY.dot_mode, LIBRARY.bf16_tiles
    assert LIBRARY.use_bf16_dot(True)
    LIBRARY.use_bf16_tiles(False)
    yield
    LIBRARY.use_bf16_dot(before)
    LIBRARY.use_bf16_tiles(tiles)


QUANTIZED = [kind for kind in QUANTIZED_DTYPES if kind != torch.int8 or not native_amx()]  # (int8: not the tiles)
FP8 = getattr(torch, "float8_e4m3fn", None)


def call(q_rows, k, v, visible, scale):
    """The kernel on q rows ``[B, Hkv, R, D]`` (fp32, unscaled) and bf16 K/V or QuantizedKV: (out, lse), checked to
    return OK."""
    b, hkv, rows, _ = q_rows.shape
    operands = [(x.data, x.scale) if hasattr(x, "scale") else (x, None) for x in (k, v)]
    out, lse = torch.zeros(b, hkv, rows, v.shape[-1]), torch.zeros(b, hkv, rows)
    assert _call(LIBRARY, q_rows, scale, *operands, visible, out, lse) == 0
    return out, lse


def bf16_numbers(*shape, generator, magnitude=1.0):
    return (torch.randn(*shape, generator=generator) * magnitude).bfloat16().float()


PATH = "pair dot products"  # (the FMA path's words name vdpbf16ps too: its timing)


def test_explain_names_the_path():
    assert native_bf16_dot()  # (tests/test_decode_native.py checks the two agree everywhere)
    k = torch.randn(1, 2, 300, 128).bfloat16()
    assert PATH in str(engine.explain(torch.randn(1, 8, 1, 128).bfloat16(), k, k))  # G 4: four rows
    assert PATH in str(engine.explain(torch.randn(1, 4, 2, 128).bfloat16(), k, k))  # G 2, T 2: four rows
    assert PATH not in str(engine.explain(torch.randn(1, 4, 1, 128).bfloat16(), k, k))  # two rows a KV head
    assert PATH not in str(engine.explain(torch.randn(1, 8, 1, 128), k.float(), k.float()))  # fp32 K
    k48 = torch.randn(1, 2, 300, 48).bfloat16()
    assert PATH not in str(engine.explain(torch.randn(1, 8, 1, 48).bfloat16(), k48, k48))  # D 48
    for kind in QUANTIZED:
        kq = quantize(torch.randn(1, 2, 300, 128), kind)
        assert PATH in str(engine.explain(torch.randn(1, 8, 1, 128).bfloat16(), kq, kq)), kind
        assert PATH not in str(engine.explain(torch.randn(1, 8, 1, 128), kq, kq)), kind  # an fp32 q


@settings(max_examples=40, deadline=None)
@given(rows=st.sampled_from([4, 8]), s=st.integers(1, 300), d=st.sampled_from([32, 64, 128]),
       dv=st.sampled_from([32, 64, 96]), masked=st.booleans(), seed=st.integers(0, 2**16))
def test_bf16_q_and_k_match_the_float64_oracle(rows, s, d, dv, masked, seed):
    # S from 1 (the two-key and one-key passes alone) past several blocks; 4 or 8 rows; the scale applied to sums
    g = torch.Generator().manual_seed(seed)
    q_rows = bf16_numbers(2, 2, rows, d, generator=g)
    k, v = torch.randn(2, 2, s, d, generator=g).bfloat16(), torch.randn(2, 2, s, dv, generator=g).bfloat16()
    visible = torch.rand(2, 1, rows, s, generator=g) > 0.3 if masked else torch.ones(2, 1, rows, s, dtype=torch.bool)
    scale = d ** -0.5
    out, lse = call(q_rows, k, v, visible, scale)
    want, want_lse = oracle(q_rows.double(), k.double(), v.double(), visible, scale)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(QUANTIZED), rows=st.sampled_from([4, 8]), s=st.integers(1, 300),
       d=st.sampled_from([32, 64, 128]), dv=st.sampled_from([16, 48, 64]), masked=st.booleans(),
       seed=st.integers(0, 2**16))
def test_bf16_q_and_a_quantized_cache_match_the_float64_oracle(kind, rows, s, d, dv, masked, seed):
    # int8 / fp8 keys widened to bf16 exactly: the oracle over the dequantized cache, per-key scales times the scale
    g = torch.Generator().manual_seed(seed)
    q_rows = bf16_numbers(2, 2, rows, d, generator=g)
    kq, vq = quantize(torch.randn(2, 2, s, d, generator=g), kind), quantize(torch.randn(2, 2, s, dv, generator=g), kind)
    visible = torch.rand(2, 1, rows, s, generator=g) > 0.3 if masked else torch.ones(2, 1, rows, s, dtype=torch.bool)
    out, lse = call(q_rows, kq, vq, visible, d ** -0.5)
    want, want_lse = oracle(q_rows.double(), kq.dequantize(torch.float64), vq.dequantize(torch.float64), visible,
                            d ** -0.5)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
def test_an_e4m3_nan_code_in_a_full_block_poisons_the_rows_that_see_it():
    # the code 0x7F reads as NaN through the widening to bf16 too; a hidden one leaves its rows the oracle's
    g = torch.Generator().manual_seed(7)
    q_rows = bf16_numbers(2, 2, 4, 64, generator=g, magnitude=0.125)
    kq, vq = (quantize(torch.randn(2, 2, 256, 64, generator=g), FP8) for _ in range(2))
    codes = kq.data.view(torch.uint8)
    codes[0, 0, 70, 5] = codes[1, 1, 200, 0] = 0x7F
    visible = torch.ones(2, 1, 4, 256, dtype=torch.bool)
    visible[1, ..., 200] = False
    out, lse = call(q_rows, kq, vq, visible, 1.0)
    assert bool(out[0, 0].isnan().all()) and bool((lse[0, 0] == float("-inf")).all())
    clean = ~out.isnan().all(-1)
    assert int(clean.sum()) == 2 * 2 * 4 - 4
    want, want_lse = oracle(q_rows.double(), kq.dequantize(torch.float64).nan_to_num(0.0),
                            vq.dequantize(torch.float64), visible, 1.0)
    torch.testing.assert_close(out[clean].double(), want[clean], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[clean].double(), want_lse[clean], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("magnitude", [0.0, 1e-38, 1e-20, 1.0, 1e15])
def test_q_rows_of_any_magnitude_match_the_oracle(magnitude):
    # zero rows, rows near bf16's smallest normal (the dot product reads subnormals as 0), huge scores (one key takes
    # all the weight)
    g = torch.Generator().manual_seed(1)
    q_rows = bf16_numbers(1, 2, 4, 128, generator=g)
    q_rows[:, :, 1] = (q_rows[:, :, 1] * magnitude).bfloat16().float()
    k, v = (torch.randn(1, 2, 200, 128, generator=g).bfloat16() for _ in range(2))
    visible = torch.ones(1, 1, 4, 200, dtype=torch.bool)
    out, lse = call(q_rows, k, v, visible, 0.125)
    want, want_lse = oracle(q_rows.double(), k.double(), v.double(), visible, 0.125)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def test_a_nan_or_inf_key_in_a_full_block_poisons_the_rows_that_see_it_and_no_other():
    # no mask over full 64-key blocks: a NaN key (KV head 0) and an inf key (KV head 1) of batch row 0 make those
    # heads' rows NaN with lse -inf; a NaN key hidden from every row of batch row 1 leaves it the oracle's
    g = torch.Generator().manual_seed(6)
    q_rows = bf16_numbers(2, 2, 4, 64, generator=g, magnitude=0.125)
    k, v = (torch.randn(2, 2, 256, 64, generator=g) for _ in range(2))
    k[0, 0, 70, 5] = float("nan")
    k[0, 1, 130, :] = float("inf")
    k[1, 0, 200, 3] = float("nan")
    visible = torch.ones(2, 1, 4, 256, dtype=torch.bool)
    visible[1, ..., 200] = False
    out, lse = call(q_rows, k.bfloat16(), v.bfloat16(), visible, 1.0)
    assert bool(out[0].isnan().all()) and bool((lse[0] == float("-inf")).all())
    want, want_lse = oracle(q_rows.double(), k.bfloat16().double().nan_to_num(0.0), v.bfloat16().double(), visible,
                            1.0)
    torch.testing.assert_close(out[1].double(), want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[1].double(), want_lse[1], rtol=1e-5, atol=1e-5)


def test_q_values_that_are_not_bf16_numbers_take_the_fma_path_and_both_match_the_oracle():
    # the kernel decides from q's values: one value off a bf16 number (its low bits set) sends the call to the FMA
    # path; both within fp32's error of the oracle, and apart only by rounding
    g = torch.Generator().manual_seed(3)
    q_rows = bf16_numbers(1, 2, 4, 128, generator=g)
    k, v = (torch.randn(1, 2, 500, 128, generator=g).bfloat16() for _ in range(2))
    visible = torch.ones(1, 1, 4, 500, dtype=torch.bool)
    nudged = q_rows.clone()
    nudged[0, 1, 3, 7] = torch.nextafter(nudged[0, 1, 3, 7], torch.tensor(2.0))
    for q in (q_rows, nudged):
        out, lse = call(q, k, v, visible, 0.09)
        want, want_lse = oracle(q.double(), k.double(), v.double(), visible, 0.09)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size", [16, 5])
def test_a_bf16_request_is_bitwise_the_same_paged_or_contiguous_alone_or_batched(page_size):
    # batch invariance on the dot products: the same blocks and passes whatever the layout or the batch
    batch = requests([2100, 300, 77], torch.bfloat16, seed=12, d=128)  # Hq 8 / Hkv 2: four rows per KV head
    out = paged(batch, page_size)
    for b, (q, k, v) in enumerate(batch):
        alone = causal_attention(q[None], k[None], v[None])[0, :, 0]
        assert torch.equal(out[b], alone), b


@pytest.mark.skipif(native_amx(), reason="int8 takes the AMX tiles here (tests/test_decode_amx.py)")
@pytest.mark.parametrize("page_size", [16, 5])
def test_an_int8_request_with_a_bf16_q_is_bitwise_the_same_paged_or_contiguous_alone_or_batched(page_size):
    batch = requests([2100, 300, 77], torch.bfloat16, seed=13, d=128)
    out = paged(batch, page_size, quantized=True)
    for b, (q, k, v) in enumerate(batch):
        alone = causal_attention(q[None], quantize(k[None], torch.int8), quantize(v[None], torch.int8))[0, :, 0]
        assert torch.equal(out[b], alone), b


def test_the_library_takes_the_dot_products_only_where_its_rates_say_they_pay():
    LIBRARY.use_bf16_dot(None)
    dot_ns, fma_ns, most = LIBRARY.dot_rates
    assert 0.0 < dot_ns < 100.0 and 0.0 < fma_ns < 100.0 and 1.0 <= most < 2.0  # ns per instruction, timed
    assert LIBRARY.bf16_dot == (dot_ns <= most * fma_ns) == native_bf16_dot()
    words = "pair dot products" if LIBRARY.bf16_dot else "by FMAs"
    k = torch.randn(1, 2, 300, 128).bfloat16()
    note = str(engine.explain(torch.randn(1, 8, 1, 128).bfloat16(), k, k))
    assert words in note and f"{dot_ns / fma_ns:.2f}x" in note


def test_forced_either_way_the_paths_differ_by_rounding_and_both_match_the_oracle():
    # the switch reaches the kernel: the same call summed by vdpbf16ps and by FMAs differs in its last bits
    g = torch.Generator().manual_seed(4)
    q_rows = bf16_numbers(2, 2, 4, 128, generator=g)
    k, v = (torch.randn(2, 2, 700, 128, generator=g).bfloat16() for _ in range(2))
    visible = torch.ones(2, 1, 4, 700, dtype=torch.bool)
    want, want_lse = oracle(q_rows.double(), k.double(), v.double(), visible, 0.1)
    outs = {}
    for mode in (True, False):
        assert LIBRARY.use_bf16_dot(mode) == mode
        outs[mode], lse = call(q_rows, k, v, visible, 0.1)
        torch.testing.assert_close(outs[mode].double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    assert not torch.equal(outs[True], outs[False])
    note = str(engine.explain(torch.randn(1, 8, 1, 128).bfloat16(), k[:1], k[:1]))
    assert "by FMAs" in note and "pair dot products" not in note  # (still forced off)


def test_explain_before_the_library_loads_says_the_rates_decide(monkeypatch):
    monkeypatch.setattr(native_build, "loaded_native", lambda: None)
    assert native_bf16_dot() is None
    assert "where one costs about an FMA's time" in native_build.bf16_dot_scores()


@pytest.mark.parametrize("value, mode", [("0", False), ("1", True), ("auto", None), (" AUTO ", None)])
def test_the_environment_fixes_the_choice_as_the_library_loads(monkeypatch, value, mode):
    # (the same file: dlopen hands back the loaded library, so this sets LIBRARY's mode too; the fixture restores it)
    LIBRARY.use_bf16_dot(None)  # as a library just loaded: the rates decide
    monkeypatch.setenv(native_build.BF16_DOT_ENV, value)
    again = native_build.NativeLibrary(LIBRARY.path, 0.0)
    assert again.dot_mode is mode
    rates = again.dot_rates
    assert again.bf16_dot == (rates[0] <= rates[2] * rates[1] if mode is None else mode)
    monkeypatch.setattr(native_build, "loaded_native", lambda: again)
    note = native_build.bf16_dot_scores()
    assert (PATH in note) == again.bf16_dot and ("forced" in note) == (mode is not None)


def test_the_environment_refuses_other_values(monkeypatch):
    monkeypatch.setenv(native_build.BF16_DOT_ENV, "yes")
    with pytest.raises(RuntimeError, match=r"ATTENTION_ENGINE_BF16_DOT='yes': expected 1 .* 0 .* or auto"):
        native_build.NativeLibrary(LIBRARY.path, 0.0)
    assert "ATTENTION_ENGINE_BF16_DOT='yes'" in native_build.native_unavailable.__wrapped__()
    assert "ATTENTION_ENGINE_BF16_DOT='yes'" in native_build.load_native.__wrapped__()  # (the string, not a raise)


def test_a_refused_value_is_named_by_explain_and_the_call_still_runs():
    # a fresh process: the library's availability is decided once per process
    script = ("import torch, engine; q, k = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 600, 64); "
              "print(engine.explain(q, k, k)); print(engine.causal_attention(q, k, k).isfinite().all().item())")
    env = {**os.environ, native_build.BF16_DOT_ENV: "yes"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr
    assert "not decode_native: ATTENTION_ENGINE_BF16_DOT='yes': expected 1" in done.stdout
    assert done.stdout.strip().endswith("True")


def test_loading_the_file_again_leaves_its_mode_alone_unless_one_is_asked(monkeypatch):
    # forced against what the rates would choose, so that re-applying the rates would show
    monkeypatch.delenv(native_build.BF16_DOT_ENV, raising=False)
    dot_ns, fma_ns, most = LIBRARY.dot_rates
    forced = not dot_ns <= most * fma_ns
    assert LIBRARY.use_bf16_dot(forced) is forced  # (the fixture restores the mode it found)
    again = native_build.NativeLibrary(LIBRARY.path, 0.0)
    assert again.dot_mode is None and again.bf16_dot is forced and LIBRARY.bf16_dot is forced
