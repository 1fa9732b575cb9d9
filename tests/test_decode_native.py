"""The native decode kernel (C++) and the quantized KV cache, against a float64 oracle written here.

Each case runs the kernel forced (``kernel="decode_native"``) and checks that it really ran (explain), so a
silent fallback to the torch kernels cannot pass for it; ``no_native`` (conftest) runs the same calls with
the native kernel reported unavailable, as on a machine without a compiler.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine import KVCache, causal_attention, window_mask
from engine.kernels.decode.native_build import cpu_key, load_native
from engine.kernels.dispatch import KERNELS
from engine.masks import key_padding_mask
from engine.quantized import QUANTIZED_DTYPES, QuantizedKV, quantize
from tests.precision import assert_within_precision, plain_attention

NATIVE = not isinstance(load_native(), str)
needs_native = pytest.mark.skipif(not NATIVE, reason=f"native kernel unavailable: {load_native()}")
FP8 = getattr(torch, "float8_e4m3fn", None)
QUANTIZED = [torch.int8] + ([FP8] if FP8 in QUANTIZED_DTYPES else [])


def oracle(q, k, v, visible, scale):
    """float64 attention: q ``[B, Hq, T, D]``, k/v ``[B, Hkv, S, *]``, visible bool ``[B|1, Hq|1, T, S]``.
    Returns ``(out [B, Hq, T, Dv], lse [B, Hq, T])``; rows that see nothing give 0 and lse -inf."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)  # [B, Hq, S, D]: query head h reads KV head h // G
    v = v.double().repeat_interleave(group, dim=1)  # [B, Hq, S, Dv]
    scores = (q.double() @ k.transpose(-2, -1)) * scale  # [B, Hq, T, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, T]
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # empty rows: 0
    return weights @ v, lse


def visibility(qpos, kpos, allowed=None):
    """The rule, written out: key j visible to query i iff kpos[j] <= qpos[i] (and allowed): [B, 1|Hq, T, S]."""
    visible = (kpos[:, None, None, :] <= qpos[:, None, :, None])  # [B, 1, T, S]
    return visible if allowed is None else visible & allowed


def run_native(q, k, v, qpos=None, kpos=None, allowed=None, **kwargs):
    assert engine.explain(q, k, v, qpos, kpos, allowed, kernel="decode_native", **kwargs).kernel == "decode_native"
    return causal_attention(q, k, v, qpos, kpos, allowed, kernel="decode_native", return_lse=True, **kwargs)


@needs_native
def test_explain_knows_without_building_whether_the_library_uses_amx_tiles_or_bf16_dot_products():
    from engine.kernels.decode.native_build import native_amx, native_bf16_dot

    assert native_amx() == load_native().amx  # (explain asks native_amx; the library says what it compiled and got)
    assert native_bf16_dot() == load_native().bf16_dot


def test_the_native_kernel_is_built_where_ci_runs():
    # CI has g++: there the native path must really run (not skip), so both paths are tested.
    if os.environ.get("CI") == "true":
        assert NATIVE, load_native()
    assert "flags" in cpu_key() or "Features" in cpu_key() or not os.path.exists("/proc/cpuinfo")


# --- the kernel matrix: dtypes x head layouts x positions and masks ------------------------------------------

SHAPES = [  # B, Hq, Hkv, T, S, D
    (2, 8, 2, 1, 1000, 64),  # GQA, G = 4: one-token decode, S not a multiple of the key block
    (1, 4, 4, 2, 700, 128),  # MHA, two queries per row
    (2, 6, 1, 3, 333, 32),  # MQA, G = 6: 18 rows of one KV head
    (1, 2, 1, 1, 200, 24),  # D = 24: not a multiple of 16 lanes (the scalar loop on AVX-512)
    (1, 3, 3, 16, 130, 7),  # T = 16 (the most decode takes), odd D
]
MASKS = ["none", "row_positions", "window", "key_padding", "per_head"]


def masked_case(shape, mask, dtype, seed=0):
    b, hq, hkv, t, s, d = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*x, generator=g).to(dtype) for x in ((b, hq, t, d), (b, hkv, s, d), (b, hkv, s, d)))
    kpos = torch.arange(s).expand(b, s)
    qpos = torch.arange(s - t, s).expand(b, t)
    allowed = None
    if mask == "row_positions":  # each row decodes at its own position: row 1 sees only its first half
        qpos = torch.stack([torch.arange(s - t, s), torch.arange(s // 2 - t, s // 2)][:b])
    elif mask == "window":
        allowed = window_mask(qpos, kpos, window=max(s // 3, 1))
    elif mask == "key_padding":
        allowed = key_padding_mask(torch.tensor([s, s // 4])[:b], s)
    elif mask == "per_head":
        allowed = torch.rand(b, hq, t, s, generator=g) > 0.3
    return q, k, v, qpos, kpos, allowed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", MASKS)
@needs_native
def test_native_decode_matches_the_float64_oracle(dtype, shape, mask):
    q, k, v, qpos, kpos, allowed = masked_case(shape, mask, dtype)
    out, lse = run_native(q, k, v, qpos, kpos, allowed)
    scale = shape[-1] ** -0.5
    visible = visibility(qpos, kpos, allowed)
    want, want_lse = oracle(q, k, v, visible, scale)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_within_precision(out, want, plain_attention(q, k, v, visible, scale, dtype), dtype)
    seen = visible.expand_as(want_lse[..., None].expand(*want_lse.shape, kpos.shape[1])).any(-1)
    torch.testing.assert_close(lse.double()[seen], want_lse[seen], rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_keys_split_across_threads_merge_exactly(threads):
    # B * Hkv = 1: the one head's keys are cut into one run per thread and merged by lse
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v, qpos, kpos, _ = masked_case((1, 4, 1, 1, 5000, 64), "none", torch.float32)
        out, lse = run_native(q, k, v, qpos, kpos)
    finally:
        torch.set_num_threads(before)
    want, want_lse = oracle(q, k, v, visibility(qpos, kpos), 64 ** -0.5)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


@needs_native
@given(t=st.integers(1, 4), s=st.integers(1, 300), group=st.sampled_from([1, 2, 3]), d=st.sampled_from([8, 16, 20]),
       offset=st.integers(-50, 50), seed=st.integers(0, 10_000))
def test_property_any_positions_and_mask_match_the_oracle(t, s, group, d, offset, seed):
    # per-row positions anywhere (before, inside or past the keys) and a random mask: the oracle's result,
    # rows that see nothing included (0 and lse -inf)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2 * group, t, d, generator=g)
    k, v = torch.randn(2, 2, s, d, generator=g), torch.randn(2, 2, s, d, generator=g)
    kpos = torch.arange(s).expand(2, s)
    qpos = torch.stack([torch.arange(t) + s - t + offset, torch.arange(t) + offset])  # [2, T]
    allowed = torch.rand(2, 1, t, s, generator=g) > 0.2
    out, lse = run_native(q, k, v, qpos, kpos, allowed)
    want, want_lse = oracle(q, k, v, visibility(qpos, kpos, allowed), d ** -0.5)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(lse.isinf(), want_lse.isinf())
    torch.testing.assert_close(lse.double()[~lse.isinf()], want_lse[~want_lse.isinf()], rtol=1e-5, atol=1e-5)


# --- layouts, empty rows, non-finite values ------------------------------------------------------------------


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_strided_kv_cache_view_and_a_transposed_layout_give_the_contiguous_result(dtype):
    cache = KVCache(2, 2, capacity=3000, head_dim=64, dtype=dtype)
    cache.update(torch.randn(2, 2, 2100, 64).to(dtype), torch.randn(2, 2, 2100, 64).to(dtype))
    k, v, kpos, _ = cache.view()  # slices of the 3000-slot buffers
    assert not k.is_contiguous()
    q = torch.randn(2, 8, 1, 64).to(dtype)
    out, lse = run_native(q, k, v, None, kpos)
    want, want_lse = run_native(q, k.contiguous(), v.contiguous(), None, kpos)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    k_t, v_t = k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2)
    out_t, _ = run_native(q, k_t, v_t, None, kpos)  # [B, S, H, D] memory seen as [B, H, S, D]
    assert torch.equal(out_t, want)


@needs_native
@pytest.mark.parametrize("t", [1, 3])
def test_one_plan_runs_q_of_any_layout_in_turn(t):
    # a plan reads a q laid out as its first run's through that run's folded strides (no view per run); a q of the
    # same shape laid out otherwise ([B, T, Hq, D] memory, as a model's projection gives it) is folded anew
    g = torch.Generator().manual_seed(t)
    k, v = torch.randn(2, 2, 300, 64, generator=g), torch.randn(2, 2, 300, 64, generator=g)
    qpos = torch.arange(300 - t, 300).expand(2, t)
    contiguous = [torch.randn(2, 8, t, 64, generator=g) for _ in range(2)]
    projected = [torch.randn(2, t, 8, 64, generator=g).transpose(1, 2) for _ in range(2)]
    for first, then in ((contiguous, projected), (projected, contiguous)):  # (either layout first)
        plan = engine.plan(first[0], k, v, qpos, kernel="decode_native")
        for q in (first[0], then[0], first[1], then[1]):
            want, _ = oracle(q, k, v, visibility(qpos, torch.arange(300).expand(2, 300)), 64 ** -0.5)
            torch.testing.assert_close(plan.run(q, k, v).double(), want, rtol=1e-5, atol=1e-6)


@needs_native
def test_rows_that_see_no_key_give_zero_and_lse_minus_inf():
    q, k, v = torch.randn(2, 4, 2, 32), torch.randn(2, 2, 600, 32), torch.randn(2, 2, 600, 32)
    kpos = torch.arange(600).expand(2, 600) + 100  # keys at 100 .. 699
    qpos = torch.tensor([[50, 650], [99, 100]])  # rows at 50 and 99 see nothing
    out, lse = run_native(q, k, v, qpos, kpos)
    empty = torch.tensor([[True, False], [True, False]])[:, None, :].expand(2, 4, 2)
    assert torch.equal(out[empty], torch.zeros_like(out[empty])) and bool((lse[empty] == float("-inf")).all())
    assert bool(torch.isfinite(lse[~empty]).all())


@needs_native
def test_calls_of_any_size_in_turn_each_match_the_oracle():
    # a call's arrays live in the calling thread's buffers, kept from call to call up to 4 MiB; a larger one (q's
    # rows here: 16 x 8 x 64 rows of 160 floats, 5 MiB) is the call's own: small, large and small again in turn
    for shape in ((1, 4, 1, 2, 70, 32), (16, 32, 8, 16, 40, 160), (2, 4, 2, 3, 50, 64)):
        q, k, v, qpos, kpos, _ = masked_case(shape, "none", torch.float32, seed=shape[0])
        out, lse = run_native(q, k, v, qpos, kpos)
        want, want_lse = oracle(q, k, v, visibility(qpos, kpos), shape[-1] ** -0.5)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("s", [100, 3000], ids=["one work item", "two work items"])
def test_rows_that_see_no_key_give_zero_after_rows_of_nan_in_the_same_call(dtype, s):
    # the kernel finishes a call's rows one after another in buffers of its own: nothing of a NaN row may stay
    # there for the next row, one that sees nothing
    q, k, v = torch.randn(1, 4, 2, 64).to(dtype), torch.randn(1, 2, s, 64).to(dtype), torch.randn(1, 2, s, 64).to(dtype)
    k[0, :, s // 2, 7] = float("nan")  # seen by every query 0
    kpos = torch.arange(s)[None] + 10
    out, lse = run_native(q, k, v, torch.tensor([[s + 9, 5]]), kpos)  # query 1 sees no key
    assert bool(out[0, :, 0].isnan().all()) and bool((lse[0, :, 0] == float("-inf")).all())
    assert torch.equal(out[0, :, 1], torch.zeros_like(out[0, :, 1])) and bool((lse[0, :, 1] == float("-inf")).all())


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_keys_and_values_follow_the_reference(dtype):
    # masked NaN/inf never leak; a visible bad key makes its row NaN (lse -inf), a visible bad value its channel
    s = 1000
    q, k, v = torch.randn(1, 4, 2, 64).to(dtype), torch.randn(1, 2, s, 64).to(dtype), torch.randn(1, 2, s, 64).to(dtype)
    qpos = torch.tensor([[500, 999]])
    k[0, 0, 700, 3] = float("nan")  # seen only by query 1 of KV head 0's query heads (0, 1)
    v[0, 1, 800, 5] = float("inf")  # seen only by query 1 of KV head 1's query heads (2, 3)
    k[0, 1, 20, :] = float("-inf")  # masked by padding for everyone
    allowed = (torch.arange(s) != 20)[None, None, None, :]
    out, lse = run_native(q, k, v, qpos, None, allowed)
    want, want_lse = causal_attention(q, k, v, qpos, None, allowed, kernel="reference", return_lse=True)
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(lse.isinf(), want_lse.isinf())
    assert bool(out[0, :2, 1].isnan().all()) and bool(out[0, 2:, 1, 5].isnan().all())
    assert bool(torch.isfinite(out[0, :, 0]).all()) and int(out[0, 2:, 1].isnan().sum()) == 2
    finite = ~want.isnan()
    torch.testing.assert_close(out[finite].float(), want[finite].float(), rtol=2e-2, atol=2e-2)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_every_row_sees_runs_unmasked_and_one_hidden_key_still_stays_out(dtype):
    # A block of keys every row sees runs as if there were no mask: an all-ones mask changes no bit. A key hidden from
    # one row only (the group's last row, a full block's last key; its K large, so a leak would show) stays out of
    # that row; a key hidden from every row (the last block's last) keeps its NaN / inf out of all.
    s, t = 300, 4  # R = G * T = 8 rows: more than one register pass
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, t, 64, generator=g).to(dtype)
    k, v = (torch.randn(1, 4, s, 64, generator=g).to(dtype) for _ in range(2))
    qpos = torch.full((1, t), s - 1)
    plain, plain_lse = run_native(q, k, v, qpos)
    ones, ones_lse = run_native(q, k, v, qpos, None, torch.ones(1, 1, t, s, dtype=torch.bool))
    assert torch.equal(ones, plain) and torch.equal(ones_lse, plain_lse)
    allowed = torch.ones(1, 1, t, s, dtype=torch.bool)
    allowed[0, 0, t - 1, 127] = False
    k[0, :, 127] = 4.0 * q[0, ::2, t - 1]  # a score far above the rest for the row it is hidden from
    allowed[0, 0, :, 299] = False
    k[0, :, 299], v[0, :, 299] = float("inf"), float("nan")
    out, lse = run_native(q, k, v, qpos, None, allowed)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    visible = visibility(qpos, torch.arange(s).expand(1, s), allowed)
    clean_k, clean_v = k.clone(), v.clone()
    clean_k[0, :, 299], clean_v[0, :, 299] = 0.0, 0.0
    want, want_lse = oracle(q, clean_k, clean_v, visible, 64 ** -0.5)
    assert_within_precision(out, want, plain_attention(q, clean_k, clean_v, visible, 64 ** -0.5, dtype), dtype)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@needs_native
def test_nan_in_q_goes_to_the_torch_kernels_and_stays_in_its_row():
    q, k, v = torch.randn(1, 4, 1, 32), torch.randn(1, 2, 1000, 32), torch.randn(1, 2, 1000, 32)
    q[0, 1, 0, 0] = float("nan")
    out = causal_attention(q, k, v, kernel="decode_native")
    assert bool(out[0, 1].isnan().all()) and bool(torch.isfinite(out[0, [0, 2, 3]]).all())


@needs_native
@pytest.mark.parametrize("variant", ["native", "avx512", "avx2", "plain_cpp"])
def test_the_kernel_reports_a_nan_or_inf_anywhere_in_q_and_writes_nothing_on_each_vector_path(variant,
                                                                                            variant_library):
    # the kernel's own check of q (scale_q_row) in each of its channel orders: bf16 pairs, fp8 words, as it lies
    # (fp32, int8); a bf16 q (its bits read for the dot products) and an fp32 one. NaN or inf at the first, a middle
    # or the last channel of any row returns NON_FINITE_Q with out untouched; the same q made finite returns OK.
    from engine.kernels.decode.decode_native import NON_FINITE_Q, OK, _call

    library = variant_library(variant)
    b, hkv, rows, s, d = 1, 2, 4, 80, 128
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    caches = [((k.bfloat16(), None), (v.bfloat16(), None)), ((k, None), (v, None))]
    for kind in QUANTIZED_DTYPES:
        kq, vq = quantize(k, kind), quantize(v, kind)
        caches.append(((kq.data, kq.scale), (vq.data, vq.scale)))
    for keys, values in caches:
        for q_dtype in (torch.bfloat16, torch.float32):
            clean = torch.randn(b, hkv, rows, d, generator=g).to(q_dtype).float()  # [B, Hkv, R, D]
            out = torch.zeros(b, hkv, rows, d)
            assert _call(library, clean, 0.1, keys, values, None, out, None) == OK
            for bad, (h, r, c) in itertools.product((float("nan"), float("inf"), -float("inf")),
                                                    ((0, 0, 0), (1, 2, 77), (1, 3, d - 1))):
                q_rows = clean.clone()
                q_rows[0, h, r, c] = bad
                out = torch.full((b, hkv, rows, d), 7.0)
                status = _call(library, q_rows, 0.1, keys, values, None, out, None)
                assert status == NON_FINITE_Q, (keys[0].dtype, q_dtype, bad, (h, r, c))
                assert bool((out == 7.0).all())


@needs_native
@pytest.mark.parametrize("variant", ["native", "avx512", "avx2", "plain_cpp"])
def test_a_bf16_q_and_output_are_read_and_rounded_as_torch_converts_them_on_each_vector_path(variant,
                                                                                           variant_library):
    # io_kind bf16: q read in bf16 and the output written in bf16 by the kernel, against the same call in fp32
    # converted by torch. Each row sees one key, so its output is that value row exactly and the rounding shows:
    # ties to even both ways, values that round up to the next binade or to inf, subnormals, signs
    from engine.kernels.decode.decode_native import OK, _call

    library = variant_library(variant)
    b, hkv, rows, s, d = 2, 2, 4, 64, 64
    g = torch.Generator().manual_seed(11)
    q = torch.randn(b, hkv, rows, d, generator=g).bfloat16()  # [B, Hkv, R, D]
    k = torch.randn(b, hkv, s, d, generator=g)
    special = torch.tensor([0x3F808000, 0x3F818000, 0x3F817FFF, 0x3F818001, 0x3FFF8000, 0x7F7FFFFF, 0x7F7F7FFF,
                            0x00008000, 0x00018000, 0x80018000, 0xBF808000, 0x7F7F8000, 0xFF7FFFFF, 0, 0x80000000,
                            0x3F7FFFFF], dtype=torch.int64).to(torch.int32).view(torch.float32)
    v = torch.randn(b, hkv, s, d, generator=g)
    v[..., :16] = special  # every key's first 16 channels: the special values
    visible = torch.zeros(b, 1, rows, s, dtype=torch.bool)
    for r in range(rows):
        visible[:, :, r, 5 + 9 * r] = True  # row r sees key 5 + 9 r alone
    want, want_lse = torch.zeros(b, hkv, rows, d), torch.zeros(b, hkv, rows)
    assert _call(library, q.float(), 0.125, (k, None), (v, None), visible, want, want_lse) == OK
    got, got_lse = torch.zeros(b, hkv, rows, d, dtype=torch.bfloat16), torch.zeros(b, hkv, rows)
    assert _call(library, q, 0.125, (k, None), (v, None), visible, got, got_lse) == OK
    assert torch.equal(got.view(torch.int16), want.bfloat16().view(torch.int16))
    assert torch.equal(got_lse, want_lse)
    assert torch.equal(want[:, :, :, :16], special.expand(b, hkv, rows, 16))  # (each row its one key's values)


@needs_native
def test_auto_takes_the_native_kernel_for_decode_and_the_torch_kernels_otherwise():
    q, k = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 4096, 64)
    assert engine.explain(q, k, k).kernel == "decode_native"
    assert engine.explain(torch.randn(1, 8, 32, 64), k, k).kernel != "decode_native"  # T = 32 > 16
    assert engine.explain(q, k[:, :, :100], k[:, :, :100]).kernel == "decode_native"  # any S: it pays off once planned
    assert engine.explain(q.double(), k.double(), k.double()).kernel == "decode"  # fp64: the torch kernel
    assert engine.explain(q, k, k, softcap=3.0).kernel == "decode_native"  # a softcap: capped in C++
    assert engine.explain(q, k, k, alibi_slopes=torch.rand(8)).kernel == "decode_native"  # ALiBi: added in C++
    assert engine.explain(q, k, k, bias=torch.zeros(1, 8, 1, 4096)).kernel == "decode_native"  # a bias: added in C++
    choice = engine.explain(q, k, k, score_mod=lambda s, b, h, i, j: s, kernel="decode_native")
    assert choice.passed_over["decode_native"] == "score_mod: not computed by this kernel"


def test_without_the_native_kernel_the_same_calls_run_the_torch_kernels(no_native):
    q, k, v, qpos, kpos, allowed = masked_case((2, 8, 2, 1, 1000, 64), "window", torch.bfloat16)
    choice = engine.explain(q, k, v, qpos, kpos, allowed)
    assert choice.kernel == "decode" and choice.passed_over["decode_native"] == "native code is turned off (test)"
    out = causal_attention(q, k, v, qpos, kpos, allowed, kernel="decode_native")  # forced: the next kernel runs
    visible = visibility(qpos, kpos, allowed)
    want, _ = oracle(q, k, v, visible, 64 ** -0.5)
    assert_within_precision(out, want, plain_attention(q, k, v, visible, 64 ** -0.5, torch.bfloat16), torch.bfloat16)


# --- the quantized cache ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", QUANTIZED, ids=str)
def test_quantize_keeps_each_entry_within_half_a_step(dtype):
    x = torch.randn(2, 3, 50, 64) * torch.rand(2, 3, 50, 1) * 10
    stored = quantize(x, dtype)
    assert stored.data.dtype == dtype and stored.scale.shape == (2, 3, 50)
    err = (stored.dequantize() - x).abs()
    if dtype == torch.int8:  # round to the nearest multiple of the scale
        assert bool((err <= stored.scale[..., None] / 2 * (1 + 1e-6)).all())
    else:  # e4m3: the bound engine.quantized states, max(|x| / 16, 2^-10 * scale)
        bound = torch.maximum(x.abs() / 16, stored.scale[..., None] * 2.0 ** -10)
        assert bool((err <= bound * (1 + 1e-6)).all())
    assert torch.equal(quantize(torch.zeros(1, 1, 2, 4), dtype).dequantize(), torch.zeros(1, 1, 2, 4))


@pytest.mark.skipif(FP8 not in QUANTIZED, reason="this torch has no float8_e4m3fn")
def test_fp8_entries_far_below_their_rows_maximum_meet_the_stated_bound_not_a_relative_one():
    # e4m3's subnormals: entries under 2^-6 of the row's scale lose relative precision, down to 0 (the docstring's
    # example: 1e-6 beside 1.0); 1/16 of an entry's own size holds only above that
    x = torch.tensor([1.0, 1e-6, 3e-5, 1e-5, 2e-3, 0.3]).reshape(1, 1, 1, 6)
    stored = quantize(x, FP8)
    back, scale = stored.dequantize().flatten(), float(stored.scale.flatten()[0])
    err = (back - x.flatten()).abs()
    assert float(back[1]) == 0.0 and float(err[3]) > 1e-5 / 16  # relative bounds fail down there ...
    assert bool((err <= torch.maximum(x.flatten().abs() / 16, torch.tensor(scale * 2.0 ** -10)) * (1 + 1e-6)).all())
    normal = x.flatten().abs() >= scale * 2.0 ** -6  # ... and hold for normals
    assert bool((err[normal] <= x.flatten()[normal].abs() / 16 * (1 + 1e-6)).all())


def test_quantized_inputs_are_validated_with_clear_messages():
    q, k = torch.randn(1, 4, 1, 16), quantize(torch.randn(1, 2, 10, 16))
    with pytest.raises(ValueError, match="both be QuantizedKV or both tensors"):
        causal_attention(q, k, torch.randn(1, 2, 10, 16))
    with pytest.raises(ValueError, match="head dim mismatch"):
        causal_attention(torch.randn(1, 4, 1, 8), k, k)
    with pytest.raises(ValueError, match="QuantizedKV scale must be float32"):
        QuantizedKV(k.data, k.scale.double())
    with pytest.raises(ValueError, match="QuantizedKV data must be a tensor of dtype"):
        QuantizedKV(k.data.float(), k.scale)


@pytest.mark.parametrize("dtype", QUANTIZED, ids=str)
@pytest.mark.parametrize("native", [True, False], ids=["native", "dequantized"])
def test_a_quantized_cache_decodes_as_attention_over_its_dequantised_values(dtype, native, request):
    if native and not NATIVE:
        pytest.skip(f"native kernel unavailable: {load_native()}")
    if not native:
        request.getfixturevalue("no_native")
    cache = KVCache(2, 2, capacity=1500, head_dim=64, dtype=dtype)
    k_new, v_new = torch.randn(2, 2, 1200, 64), torch.randn(2, 2, 1200, 64)
    k, v, kpos, valid = cache.update(k_new, v_new)
    assert isinstance(k, QuantizedKV) and k.data.dtype == dtype and k.shape == (2, 2, 1200, 64)
    q = torch.randn(2, 8, 2, 64)
    qpos = torch.tensor([[1198, 1199], [600, 601]])
    allowed = key_padding_mask(torch.tensor([1200, 1000]), 1200)
    choice = engine.explain(q, k, v, qpos, kpos, allowed)
    assert choice.kernel == ("decode_native" if native else "dequantized")
    out, lse = causal_attention(q, k, v, qpos, kpos, allowed, return_lse=True)
    k64 = k.data.double() * k.scale.double()[..., None]  # the oracle dequantises on its own
    v64 = v.data.double() * v.scale.double()[..., None]
    want, want_lse = oracle(q, k64, v64, visibility(qpos, kpos, allowed), 64 ** -0.5)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    full, _ = oracle(q, k_new, v_new, visibility(qpos, kpos, allowed), 64 ** -0.5)  # the unquantized cache
    assert (out.double() - full).abs().max() < (0.02 if dtype == torch.int8 else 0.1)


@pytest.mark.parametrize("dtype", QUANTIZED, ids=str)
def test_every_kernel_forced_on_a_quantized_cache_gives_the_same_result(dtype):
    k, v = quantize(torch.randn(1, 2, 700, 32), dtype), quantize(torch.randn(1, 2, 700, 32), dtype)
    q = torch.randn(1, 4, 20, 32)  # T = 20: beyond decode; prefill over a quantized cache
    want = causal_attention(q, k, v, kernel="reference")
    for name in KERNELS:  # each runs it or hands it to the next kernel that reads a quantized cache
        out = causal_attention(q, k, v, kernel=name)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_gradients_through_q_over_a_quantized_cache_equal_the_float64_oracle():
    """No kernel that reads a quantized cache without a backward runs a call that needs q's gradient: auto falls
    through to the reference (the only kernel left), whose gradient is plain autograd over the dequantised cache."""
    k, v = quantize(torch.randn(1, 2, 600, 32), torch.int8), quantize(torch.randn(1, 2, 600, 32), torch.int8)
    q = torch.randn(1, 4, 3, 32, requires_grad=True)
    choice = engine.explain(q, k, v)
    assert choice.kernel == "reference" and "q needs gradients" in choice.passed_over["dequantized"], choice
    out = causal_attention(q, k, v)
    grad_out = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, q, grad_out)
    q64 = q.detach().double().requires_grad_()
    k64 = k.data.double() * k.scale.double()[..., None]
    v64 = v.data.double() * v.scale.double()[..., None]
    want, _ = oracle(q64, k64, v64, visibility(torch.arange(597, 600)[None], torch.arange(600)[None]), 32 ** -0.5)
    (want_dq,) = torch.autograd.grad(want, q64, grad_out.double())
    torch.testing.assert_close(out.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dq.double(), want_dq, rtol=1e-5, atol=1e-5)


def test_a_quantized_cache_takes_a_quarter_of_fp32_plus_its_scales():
    fp32 = KVCache(2, 8, capacity=1024, head_dim=128)
    int8 = KVCache(2, 8, capacity=1024, head_dim=128, dtype=torch.int8)
    assert int8.nbytes == fp32.nbytes // 4 + 2 * 2 * 8 * 1024 * 4
    with pytest.raises(ValueError, match="must be a float tensor"):
        int8.update(torch.ones(2, 8, 1, 128, dtype=torch.int8), torch.ones(2, 8, 1, 128, dtype=torch.int8))
    int8.update(torch.randn(2, 8, 3, 128, dtype=torch.bfloat16), torch.randn(2, 8, 3, 128, dtype=torch.bfloat16))
    assert int8.length == 3 and bool((int8.key_scales[:, :, :3] > 0).all())


def test_the_memory_formula_counts_a_quantized_cache_with_its_scales():
    from engine.kv_cache import kv_cache_bytes

    assert kv_cache_bytes(32, 1, 8, 131072, 128, 1, 4) == 8_858_370_048  # Llama-3-8B at 128k in int8
    scales = kv_cache_bytes(32, 1, 8, 131072, 128, 1, 4) - kv_cache_bytes(32, 1, 8, 131072, 128, 1)
    assert scales == 2 * 32 * 8 * 131072 * 4  # a fp32 scale per token, head, K and V
    cache = KVCache(1, 8, capacity=1000, head_dim=128, dtype=torch.int8)
    assert cache.nbytes == kv_cache_bytes(1, 1, 8, 1000, 128, 1, 4)


def test_generate_with_an_int8_cache_prints_its_memory_and_error(capsys):
    import argparse

    from engine import generate

    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    args = parser.parse_args(["--kv-dtype", "int8", "--new-tokens", "6", "--prompt-len", "24", "--no-progress"])
    assert generate.main(args) == 0  # greedy tokens agree with the full uncached forward
    out = capsys.readouterr().out
    assert "int8 = " in out and "+ scales" in out
    errors = [float(x) for x in out.split("per layer (max abs / max abs of the reference): ")[1].split(",")]
    assert len(errors) == 2 and all(0 < e < 0.05 for e in errors)  # int8 rounding: small, and not zero


# --- the other vector paths (conftest.py's variant_library): this CPU's build takes the widest ------------------


@needs_native
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["avx512", "avx2", "plain_cpp"])
def test_each_vector_path_matches_the_oracle(variant, variant_library):
    from engine.kernels.decode.decode_native import KINDS, _call

    library = variant_library(variant)
    b, hkv, rows, s, d = 2, 2, 6, 300, 32
    g = torch.Generator().manual_seed(5)
    q_rows = torch.randn(b, hkv, rows, d, generator=g)  # [B, Hkv, R, D], already scaled
    visible = torch.rand(b, 1, rows, s, generator=g) > 0.3  # [B, 1, R, S]
    for kind in KINDS:
        k, v = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
        if kind in QUANTIZED_DTYPES:
            kq, vq = quantize(k, kind), quantize(v, kind)
            operands = (kq.data, kq.scale), (vq.data, vq.scale)
            k64, v64 = kq.dequantize(torch.float64), vq.dequantize(torch.float64)
        else:
            operands = (k.to(kind), None), (v.to(kind), None)
            k64, v64 = k.to(kind).double(), v.to(kind).double()
        out, lse = torch.zeros(b, hkv, rows, d), torch.zeros(b, hkv, rows)
        _call(library, q_rows, 1.0, *operands, visible, out, lse)
        want, want_lse = oracle(q_rows, k64, v64, visible, 1.0)  # R rows of one KV head as T queries
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5, msg=str(kind))
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5, msg=str(kind))


@needs_native
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["avx512", "avx2", "plain_cpp"])
@pytest.mark.parametrize("kind", [torch.float32, torch.bfloat16], ids=str)
def test_a_nan_or_inf_key_inside_an_unmasked_full_block_poisons_its_rows_on_each_vector_path(kind, variant,
                                                                                          variant_library):
    # no mask and D = 64: full 64-key blocks take the vector finite_max; a NaN key (KV head 0) and an inf key
    # (KV head 1) there must make their heads' rows NaN with lse -inf, the reference's semantics
    from engine.kernels.decode.decode_native import _call

    library = variant_library(variant)
    b, hkv, rows, s, d = 2, 2, 4, 256, 64
    g = torch.Generator().manual_seed(6)
    q_rows = torch.randn(b, hkv, rows, d, generator=g) / 8  # [B, Hkv, R, D], already scaled
    k, v = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    want, want_lse = oracle(q_rows, k.to(kind).double(), v.to(kind).double(), torch.ones(1, 1, rows, s,
                                                                                          dtype=torch.bool), 1.0)
    k[0, 0, 70, 5] = float("nan")  # block 1 of batch row 0, KV head 0
    k[0, 1, 130, :] = float("inf")  # block 2 of batch row 0, KV head 1
    out, lse = torch.zeros(b, hkv, rows, d), torch.zeros(b, hkv, rows)
    _call(library, q_rows, 1.0, (k.to(kind), None), (v.to(kind), None), None, out, lse)
    assert bool(out[0].isnan().all()) and bool((lse[0] == float("-inf")).all())  # both heads of row 0 poisoned
    torch.testing.assert_close(out[1].double(), want[1], rtol=1e-5, atol=1e-5)  # batch row 1 is clean
    torch.testing.assert_close(lse[1].double(), want_lse[1], rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.skipif(FP8 not in QUANTIZED, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("variant", ["avx512", "avx2", "plain_cpp"])
def test_e4m3_nan_codes_read_as_nan_on_each_vector_path(variant, variant_library):
    # e4m3fn has no inf, and its codes 0x7F / 0xFF are NaN (torch reads them so). The vector paths widen the codes
    # without that case and read a block holding one apart: a NaN key code poisons its rows, a NaN value code its
    # channel, a hidden one nothing; every other block is the oracle's.
    from engine.kernels.decode.decode_native import _call

    library = variant_library(variant)
    b, hkv, rows, s, d = 2, 2, 4, 256, 64
    g = torch.Generator().manual_seed(8)
    q_rows = torch.randn(b, hkv, rows, d, generator=g) / 8  # [B, Hkv, R, D], already scaled
    kq, vq = (quantize(torch.randn(b, hkv, s, d, generator=g), FP8) for _ in range(2))
    k_codes, v_codes = kq.data.view(torch.uint8), vq.data.view(torch.uint8)  # (views: written through)
    k_codes[0, 0, 70, 5] = 0x7F  # batch row 0, KV head 0: every row sees it
    v_codes[1, 1, 130, 7] = 0xFF  # batch row 1, KV head 1: channel 7
    k_codes[1, 0, 200, 0] = v_codes[1, 0, 200, 1] = 0x7F  # hidden from every row
    visible = torch.ones(1, 1, rows, s, dtype=torch.bool)
    visible[..., 200] = False
    out, lse = torch.zeros(b, hkv, rows, d), torch.zeros(b, hkv, rows)
    _call(library, q_rows, 1.0, (kq.data, kq.scale), (vq.data, vq.scale), visible, out, lse)
    k64, v64 = kq.dequantize(torch.float64), vq.dequantize(torch.float64)
    assert bool(k64[0, 0, 70, 5].isnan()) and bool(v64[1, 1, 130, 7].isnan())  # what torch reads
    assert bool(out[0, 0].isnan().all()) and bool((lse[0, 0] == float("-inf")).all())
    assert bool(out[1, 1, :, 7].isnan().all()) and int(out[1, 1].isnan().sum()) == rows
    poisoned = torch.zeros(b, hkv, rows, d, dtype=torch.bool)
    poisoned[0, 0], poisoned[1, 1, :, 7] = True, True
    assert torch.equal(out.isnan(), poisoned)
    k64, v64 = k64.nan_to_num(0.0), v64.nan_to_num(0.0)  # the rest against the oracle
    want, want_lse = oracle(q_rows, k64, v64, visible, 1.0)
    torch.testing.assert_close(out[~poisoned].double(), want[~poisoned], rtol=1e-5, atol=1e-5)
    seen = lse != float("-inf")
    assert int(seen.sum()) == b * hkv * rows - rows
    torch.testing.assert_close(lse[seen].double(), want_lse[seen], rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.skipif(FP8 not in QUANTIZED, reason="this torch has no float8_e4m3fn")
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 8), s=st.integers(1, 200), d=st.sampled_from([32, 64, 128, 192]),
       dv=st.sampled_from([64, 128, 80]), bf16_q=st.booleans(), masked=st.booleans(), seed=st.integers(0, 2**16))
def test_property_an_fp8_cache_matches_the_oracle_over_head_dims_and_rows(rows, s, d, dv, bf16_q, masked, seed):
    # The native build reads e4m3 64 codes at a time where D and Dv are multiples of 64 (on a CPU with AVX512-VBMI),
    # else as before; 1-8 rows a KV head (the four-row passes and the 1-3 row rest), S past a block or not, a bf16 q
    # (the vdpbf16ps scores where the CPU has them) or an fp32 one, against the float64 oracle on the dequantized cache
    from engine.kernels.decode.decode_native import _call

    g = torch.Generator().manual_seed(seed)
    q_rows = torch.randn(2, 2, rows, d, generator=g)
    if bf16_q:
        q_rows = q_rows.bfloat16().float()
    kq, vq = quantize(torch.randn(2, 2, s, d, generator=g), FP8), quantize(torch.randn(2, 2, s, dv, generator=g), FP8)
    visible = torch.rand(2, 1, rows, s, generator=g) > 0.3 if masked else torch.ones(2, 1, rows, s, dtype=torch.bool)
    out, lse = torch.zeros(2, 2, rows, dv), torch.zeros(2, 2, rows)
    assert _call(load_native(), q_rows, d**-0.5, (kq.data, kq.scale), (vq.data, vq.scale), visible, out, lse) == 0
    want, want_lse = oracle(q_rows, kq.dequantize(torch.float64), vq.dequantize(torch.float64), visible, d**-0.5)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.skipif(FP8 not in QUANTIZED, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("variant", ["native", "avx512", "avx2", "plain_cpp"])
@pytest.mark.parametrize("bf16_q", [True, False], ids=["bf16-q", "fp32-q"])
def test_every_e4m3_code_reads_as_torch_reads_it_on_each_vector_path(variant, bf16_q, variant_library):
    # All 256 codes, as keys and as values, each read alone so the result is the code's value itself (powers of two
    # for every scale: no rounding anywhere): a row that sees one key has lse = its score and out = its value row.
    # The native build on a CPU with AVX512-VBMI reads the codes by table lookups, in a lane order of its own (q and
    # the output permuted to match); a bf16 q takes the vdpbf16ps scores where the CPU has them. (A NaN key code
    # poisons the whole row: test_e4m3_nan_codes_read_as_nan_on_each_vector_path.)
    from engine.kernels.decode.decode_native import _call

    library = variant_library(variant)
    b, hkv, rows, s, d = 16, 4, 4, 4, 128
    codes = torch.arange(256, dtype=torch.uint8).view(4, 64)  # key j holds codes 64 j .. 64 j + 63
    data = torch.zeros(b, hkv, s, d, dtype=torch.uint8)
    data[..., :64] = codes  # (channels 64 .. 127: code 0)
    table = QuantizedKV(data.view(FP8), torch.full((b, hkv, s), 0.5))
    finite = QuantizedKV(data.masked_fill((data & 0x7F) == 0x7F, 0).view(FP8), table.scale)  # NaN codes to 0
    zeros = QuantizedKV(torch.zeros_like(data).view(FP8), torch.full((b, hkv, s), 2.0))
    visible = torch.eye(rows, s, dtype=torch.bool).expand(1, 1, rows, s)  # row r sees key r alone
    values = table.dequantize(torch.float64)  # what torch reads: codes 0x7F / 0xFF NaN
    assert int(values.isnan().sum()) == 2 * b * hkv
    # keys: every row of pair (b, h) is one-hot on channel i = the pair's index, so row r scores code 64 r + i; a
    # non-bf16 number where K is 0 (channel 100) keeps the bf16-q path off when asked
    q_rows = torch.zeros(b, hkv, rows, d)
    pair = torch.arange(b * hkv).view(b, hkv)
    q_rows.view(b * hkv, rows, d)[torch.arange(b * hkv), :, pair.flatten()] = 1.0
    if not bf16_q:
        q_rows[..., 100] = 0.1
    out, lse = torch.zeros(b, hkv, rows, d), torch.zeros(b, hkv, rows)
    assert _call(library, q_rows, 0.25, (finite.data, finite.scale), (zeros.data, zeros.scale), visible, out, lse) == 0
    keys = finite.dequantize(torch.float64)[..., :64]
    want_lse = keys.gather(3, pair[:, :, None, None].expand(b, hkv, s, 1))[..., 0] * 0.25  # [B, Hkv, S]: row r, key r
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=0)
    assert want_lse.unique().numel() == 253  # 256 codes: two NaN ones (read as 0 here), and -0 equals 0
    assert bool((out == 0).all())
    # values: K all 0 (every score 0), row r's output is value row r exactly, NaN channels where its code is NaN
    out, lse = torch.zeros(b, hkv, rows, d), torch.zeros(b, hkv, rows)
    assert _call(library, q_rows, 0.25, (zeros.data, zeros.scale), (table.data, table.scale), visible, out, lse) == 0
    torch.testing.assert_close(out.double(), values, rtol=0, atol=0, equal_nan=True)
    assert bool((lse == 0).all())


@needs_native
@pytest.mark.parametrize("variant", ["native", "avx512", "avx2", "plain_cpp"])
@pytest.mark.parametrize("d", [128, 72], ids=["d128", "d72"])
def test_every_fp16_code_reads_as_torch_reads_it_on_each_vector_path(variant, d, variant_library):
    # All 65,536 fp16 codes (subnormals, infs and NaNs included) as values, each row seeing one key alone, so its
    # output is that key's value row itself (an inf as NaN); keys 0 (every score 0). The plain path converts the
    # codes by masks (no branch) and, on Arm, by the CPU's own conversion; D 72 takes it on every build (no vector
    # width divides 72).
    from engine.kernels.decode.decode_native import _call

    library = variant_library(variant)
    b, hkv, rows = 16, 4, 8
    codes = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)  # every bit pattern once
    s = -(-codes.numel() // (b * hkv * rows * d)) * rows  # keys per (batch row, head), rows of them per call
    values = torch.zeros(b * hkv * s * d, dtype=torch.int16)
    values[: codes.numel()] = codes
    values = values.view(torch.float16).view(b, hkv, s, d)
    keys = torch.zeros(b, hkv, s, d, dtype=torch.float16)
    for start in range(0, s, rows):  # row r sees key start + r alone
        visible = torch.zeros(1, 1, rows, s, dtype=torch.bool)
        visible[0, 0, torch.arange(rows), start + torch.arange(rows)] = True
        out, lse = torch.zeros(b, hkv, rows, d), torch.zeros(b, hkv, rows)
        assert _call(library, torch.zeros(b, hkv, rows, d), 1.0, (keys, None), (values, None), visible, out, lse) == 0
        want = values[:, :, start:start + rows].float()  # torch's reading of each code
        want[want.isinf()] = float("nan")  # (a visible non-finite value makes its channel NaN: the kernel's contract)
        torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
        assert bool((lse == 0).all())
    assert int(values.isnan().sum()) == 2046 and int(values.isinf().sum()) == 2  # (all of them were read)


@needs_native
@pytest.mark.parametrize("variant", ["avx512", "avx2", "plain_cpp"])
def test_bf16_head_dims_read_two_vectors_or_one_at_a_time_match_the_oracle_on_each_vector_path(variant,
                                                                                            variant_library):
    # A vector path reads bf16 2 * W values at a time where D and Dv are both multiples of 2 * W (AVX2: 16, AVX-512:
    # 32; q kept in that read's lane order, the output put back in order), else W at a time: each mix, with a hidden
    # NaN value and a hidden key in an otherwise full block, against the oracle channel by channel
    from engine.kernels.decode.decode_native import _call

    library = variant_library(variant)
    b, hkv, rows, s = 2, 2, 4, 200
    g = torch.Generator().manual_seed(9)
    # pairs on both paths: (32, 32), (128, 64), (64, 96); on AVX2 alone: (48, 16), (32, 48), (96, 16); else neither
    for d, dv in [(32, 32), (32, 24), (24, 32), (48, 16), (16, 8), (128, 64), (64, 96), (32, 48), (96, 16)]:
        q_rows = torch.randn(b, hkv, rows, d, generator=g) / 4  # [B, Hkv, R, D], already scaled
        k = torch.randn(b, hkv, s, d, generator=g).bfloat16()
        v = torch.randn(b, hkv, s, dv, generator=g).bfloat16()
        v[1, 0, 100] = float("nan")
        visible = torch.ones(1, 1, rows, s, dtype=torch.bool)
        visible[..., 100] = False
        out, lse = torch.zeros(b, hkv, rows, dv), torch.zeros(b, hkv, rows)
        _call(library, q_rows, 1.0, (k, None), (v, None), visible, out, lse)
        want, want_lse = oracle(q_rows, k.double(), v.double().nan_to_num(0.0), visible, 1.0)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5, msg=f"D {d}, Dv {dv}")
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5, msg=f"D {d}, Dv {dv}")


@needs_native
@pytest.mark.parametrize("d, dv", [(32, 48), (0, 16), (16, 8)], ids=["dv_wider", "d_zero", "dv_narrower"])
def test_value_width_other_than_the_key_width_and_d_zero(d, dv):
    # Dv != D (the torch decode kernel's fused op cannot take it; this one can) and D = 0 (scores all 0)
    q, k, v = torch.randn(2, 4, 2, d), torch.randn(2, 2, 600, d), torch.randn(2, 2, 600, dv)
    out, lse = run_native(q, k, v, scale=1.0)
    want, want_lse = oracle(q, k, v, visibility(torch.arange(598, 600).expand(2, 2), torch.arange(600).expand(2, 600)),
                            1.0)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", QUANTIZED, ids=str)
def test_the_dequantized_twin_merges_many_small_chunks_exactly(dtype, monkeypatch):
    # prefill over a quantized cache: the key chunk shrinks with T so the scores stay small; 64-key chunks here
    from engine.kernels.decode import dequantized

    monkeypatch.setattr(dequantized, "SCORES_PER_CHUNK", 1)
    k, v = quantize(torch.randn(2, 2, 300, 16), dtype), quantize(torch.randn(2, 2, 300, 16), dtype)
    q = torch.randn(2, 4, 40, 16)
    qpos = torch.arange(260, 300).expand(2, 40)
    allowed = window_mask(qpos, torch.arange(300).expand(2, 300), window=50)
    out, lse = causal_attention(q, k, v, qpos, None, allowed, kernel="dequantized", return_lse=True)
    want, want_lse = oracle(q, k.dequantize(torch.float64), v.dequantize(torch.float64),
                            visibility(qpos, torch.arange(300).expand(2, 300), allowed), 16 ** -0.5)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["avx512", "avx2", "plain_cpp"])
def test_a_rows_result_is_bitwise_the_same_with_masked_keys_after_its_last_on_each_vector_path(variant,
                                                                                           variant_library):
    # batch invariance: a row's keys end a block alone (1-3 keys past a multiple of 4: the 2- and 1-key passes), but
    # sit before masked padding in a batch (the 4-key pass); each key's score must be summed in one order
    from engine.kernels.decode.decode_native import _call

    library = variant_library(variant)
    g = torch.Generator().manual_seed(9)
    for rows in (4, 3, 8):  # the row groups of 4 and the 3-row remainder
        for n in (17, 18, 19, 66, 131):
            q_rows = torch.randn(1, 2, rows, 32, generator=g)
            k, v = torch.randn(1, 2, n + 3, 32, generator=g), torch.randn(1, 2, n + 3, 32, generator=g)
            alone = torch.zeros(1, 2, rows, 32), torch.zeros(1, 2, rows)
            _call(library, q_rows, 1.0, (k[:, :, :n], None), (v[:, :, :n], None), None, *alone)
            visible = (torch.arange(n + 3) < n).expand(1, 1, rows, n + 3).contiguous()  # [1, 1, R, S]
            padded = torch.zeros(1, 2, rows, 32), torch.zeros(1, 2, rows)
            _call(library, q_rows, 1.0, (k, None), (v, None), visible, *padded)
            assert torch.equal(alone[0], padded[0]) and torch.equal(alone[1], padded[1]), (rows, n)
