"""What the native decode kernel adds to the scores: a softcap (``softcap * tanh(score / softcap)``, Gemma 2's), ALiBi
(``- slope * |key_pos - query_pos|``, BLOOM's and MPT's) and a bias (a dense tensor, T5's relative bias). Every kind
of K/V, masks, contiguous and paged, each vector path, against the float64 oracle; non-finite keys as the torch
kernels treat them; where the kernel declines (ALiBi or a bias with key_indices, positions past 2^24) and a library
that would ignore the fields."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine import causal_attention, paged_attention, window_mask
from engine.kernels.decode.native_build import native_unavailable
from engine.kernels.decode.native_scores import ScoreOps
from engine.quantized import quantize
from tests.modifier_oracle import oracle
from tests.paged_cases import oracle as paged_oracle

needs_native = pytest.mark.skipif(native_unavailable() is not None, reason="no native decode kernel here")

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def case(b, hq, hkv, t, s, d, dtype, seed, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, t, d, generator=g) * spread).to(dtype)  # [B, Hq, T, D]: scores of a few caps
    k = (torch.randn(b, hkv, s, d, generator=g) * spread).to(dtype)  # [B, Hkv, S, D]
    v = torch.randn(b, hkv, s, d, generator=g).to(dtype)  # [B, Hkv, S, D]
    return q, k, v


def assert_matches(out, lse, want, want_lse, dtype) -> None:
    """out within the dtype's tolerance of the oracle's; the rows that see nothing (lse -inf) the same; lse close."""
    torch.testing.assert_close(out.double(), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    seen = ~torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(lse), ~seen)
    torch.testing.assert_close(lse.double()[seen], want_lse[seen], rtol=1e-5, atol=1e-5)


@needs_native
@settings(deadline=None, max_examples=30)
@given(st.integers(1, 3), st.sampled_from([(2, 1), (8, 2), (6, 3)]), st.integers(1, 16), st.integers(1, 600),
       st.sampled_from([32, 64, 36]), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       st.sampled_from([0.5, 5.0, 50.0]), st.sampled_from(["none", "window", "rows"]), st.integers(0, 10**6))
def test_property_a_capped_decode_matches_the_oracle(b, heads, t, s, d, dtype, cap, mask, seed):
    hq, hkv = heads
    q, k, v = case(b, hq, hkv, t, s, d, dtype, seed)
    qpos = kpos = allowed = None
    if mask == "window":
        qpos, kpos = torch.arange(s - t, s), torch.arange(s)
        allowed = window_mask(qpos, kpos, max(1, s // 3))
    elif mask == "rows":  # each row its own length: row b's last b * 7 keys past its queries
        kpos = torch.arange(s).expand(b, s).clone()
        qpos = torch.stack([torch.arange(s - t, s) - 7 * i for i in range(b)])
    plan = engine.plan(q, k, v, qpos, kpos, allowed, softcap=cap)
    assert plan.kernel == "decode_native", plan
    out, lse = plan.run(q, k, v, return_lse=True)
    want, want_lse = oracle(q, k, v, qpos, kpos, allowed, softcap=cap)
    assert_matches(out, lse, want, want_lse, dtype)


@needs_native
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_capped_decode_over_a_quantized_cache_matches_the_oracle_of_its_values(kind):
    if kind == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    q, k, v = case(2, 8, 2, 3, 700, 64, torch.float32, 1)
    dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    kq, vq = quantize(k, dtype), quantize(v, dtype)
    plan = engine.plan(q, kq, vq, softcap=5.0)
    assert plan.kernel == "decode_native", plan
    out, lse = plan.run(q, kq, vq, return_lse=True)
    want, want_lse = oracle(q, kq.dequantize(), vq.dequantize(), softcap=5.0)  # the cache's own values, capped
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_visible_non_finite_key_makes_its_rows_nan_under_a_cap_too(dtype):
    # the rule of every kernel (docs/CONVENTIONS.md, non-finite values), a softcap or not: not capped to +-cap
    q, k, v = case(1, 6, 3, 1, 300, 64, dtype, 2)
    k[0, 0, 100, 0] = float("inf")  # KV head 0
    k[0, 1, 40, 5] = float("nan")  # KV head 1; head 2 clean
    k[0, 2, 200, :] = float("nan")
    allowed = torch.ones(1, 1, 1, 300, dtype=torch.bool)
    allowed[..., 200] = False  # (hidden: never read into a result)
    out, lse = causal_attention(q, k, v, allowed=allowed, softcap=4.0, return_lse=True)
    want, want_lse = causal_attention(q, k, v, allowed=allowed, softcap=4.0, return_lse=True, kernel="tiled")
    assert engine.explain(q, k, v, allowed=allowed, softcap=4.0).kernel == "decode_native"
    assert torch.isnan(out[0, :4]).all() and torch.isfinite(out[0, 4:]).all()
    assert torch.isneginf(lse[0, :4]).all() and torch.isneginf(want_lse[0, :4]).all()
    torch.testing.assert_close(out, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype], equal_nan=True)
    torch.testing.assert_close(lse[0, 4:], want_lse[0, 4:], rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_paged_capped_step_reads_in_place_and_matches_the_oracle(dtype):
    g = torch.Generator().manual_seed(3)
    page, hkv, d = 16, 2, 64
    lens = torch.tensor([37, 100, 5])
    table = torch.randperm(21, generator=g).reshape(3, 7)  # [B, max_pages]: pages anywhere in the pool
    k_pool = (torch.randn(21, page, hkv, d, generator=g) * 3).to(dtype)
    v_pool = torch.randn(21, page, hkv, d, generator=g).to(dtype)
    q = (torch.randn(3, 8, d, generator=g) * 3).to(dtype)
    indptr = torch.arange(4)
    text = engine.explain_paged(q, k_pool, v_pool, table, lens, indptr, softcap=5.0)
    assert "decode_native reads K/V in place" in text, text
    out = paged_attention(q, k_pool, v_pool, table, lens, indptr, softcap=5.0)
    want = paged_oracle(q, k_pool, v_pool, table, lens, indptr, softcap=5.0)[0]
    torch.testing.assert_close(out.double(), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("variant", ["native", "avx512", "avx2", "plain_cpp"])
def test_each_vector_path_caps_the_scores(variant, variant_library):
    from engine.kernels.decode.decode_native import OK, _call

    library = variant_library(variant)
    q, k, v = case(2, 8, 2, 1, 333, 64, torch.float32, 4)
    k[1, 0, 7, 0] = float("inf")  # batch row 1, KV head 0: its 4 rows NaN, lse -inf
    q_rows = q.reshape(2, 2, 4, 64)  # [B, Hkv, G*T, D]
    out, lse = torch.empty(2, 2, 4, 64), torch.empty(2, 2, 4)
    scores = ScoreOps(engine.plan(q, k, v, softcap=3.0).inputs, 0, 1, 0, 333)
    assert _call(library, q_rows, 0.125, (k, None), (v, None), None, out, lse, scores=scores) == OK
    want, want_lse = oracle(q, k, v, scale=0.125, softcap=3.0)
    assert torch.isnan(out[1, 0]).all() and torch.isneginf(lse[1, 0]).all()
    out[1, 0], lse[1, 0] = 0.0, 0.0
    want[1, :4], want_lse[1, :4] = 0.0, 0.0
    torch.testing.assert_close(out.reshape(2, 8, 1, 64).double(), want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.reshape(2, 8, 1).double(), want_lse, rtol=1e-5, atol=1e-5)


@needs_native
def test_a_library_that_would_ignore_the_cap_is_not_given_it(monkeypatch):
    from engine.kernels.decode import decode_native
    from engine.kernels.decode.native_build import load_native

    library = load_native()
    q, k, v = case(1, 4, 2, 1, 64, 32, torch.float32, 5)
    slopes, bias = torch.rand(4), torch.randn(1, 4, 1, 64)
    for name, field, options in (("softcap", "softcap", {"softcap": 2.0}),
                                 ("ALiBi", "alibi", {"alibi_slopes": slopes}), ("bias", "bias", {"bias": bias})):
        monkeypatch.setattr(library, field, False)  # as a build from a source before the field
        plan = engine.plan(q, k, v, **options)
        assert plan.kernel == "decode_native"  # (chosen before the library is asked)
        with pytest.raises(decode_native.DoesNotFit, match=f"without the {name}"):
            decode_native.native_decode_runner(plan.inputs)
        want = oracle(q, k, v, softcap=options.get("softcap"), alibi=options.get("alibi_slopes"),
                      bias=options.get("bias"))[0]
        torch.testing.assert_close(plan.run(q, k, v).double(), want, rtol=2e-5, atol=2e-5)
        monkeypatch.undo()


@needs_native
@pytest.mark.parametrize("t", [1, 5, 40])
def test_a_capped_call_with_key_indices_reads_its_lists_in_place_and_matches_the_torch_kernel(t):
    q, k, v = case(2, 8, 2, t, 300, 64, torch.float32, 6)
    g = torch.Generator().manual_seed(7)
    listed = torch.randint(-1, 300, (2, 2, t, 24), generator=g)  # [B, Hkv, T, K]: each query's keys (-1: none)
    plan = engine.plan(q, k, v, torch.arange(300 - t, 300), None, key_indices=listed, softcap=3.0)
    assert plan.kernel == "decode_native" and "key_indices: read in place" in str(plan), plan
    out, lse = plan.run(q, k, v, return_lse=True)
    want, want_lse = causal_attention(q, k, v, torch.arange(300 - t, 300), None, key_indices=listed, softcap=3.0,
                                      return_lse=True, kernel="tiled")
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@needs_native
@settings(deadline=None, max_examples=40)
@given(st.integers(1, 3), st.sampled_from([(1, 1), (4, 4), (8, 2), (6, 3)]), st.integers(1, 16),
       st.integers(1, 600), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       st.sampled_from(["none", "window", "rows"]), st.booleans(), st.booleans(), st.booleans(), st.integers(0, 10**6))
def test_property_alibi_on_the_native_kernel_matches_the_oracle(b, heads, t, s, dtype, mask, per_row_slopes,
                                                                causal, capped, seed):
    hq, hkv = heads
    q, k, v = case(b, hq, hkv, t, s, 32, dtype, seed, spread=1.0)
    g = torch.Generator().manual_seed(seed)
    slopes = torch.rand(b, hq, generator=g) if per_row_slopes else torch.rand(hq, generator=g)
    qpos = kpos = allowed = None
    if mask == "window":
        qpos, kpos = torch.arange(s - t, s), torch.arange(s)
        allowed = window_mask(qpos, kpos, max(1, s // 3))
    elif mask == "rows":  # each sequence its own positions: keys b + 1 apart from 5 b, queries about the last one
        kpos = torch.stack([torch.arange(s) * (i + 1) + 5 * i for i in range(b)])
        qpos = kpos[:, -1:] + torch.arange(t) - t // 2
    options = {"alibi_slopes": slopes, "softcap": 5.0 if capped else None, "causal": causal}
    plan = engine.plan(q, k, v, qpos, kpos, allowed, **options)
    assert plan.kernel == "decode_native", plan
    out, lse = plan.run(q, k, v, return_lse=True)
    want, want_lse = oracle(q, k, v, qpos, kpos, allowed, causal=causal, softcap=options["softcap"], alibi=slopes)
    assert_matches(out, lse, want, want_lse, dtype)


@needs_native
def test_alibi_slopes_are_read_at_each_run_of_a_plan():
    q, k, v = case(1, 4, 4, 1, 200, 32, torch.float32, 9, spread=1.0)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    plan = engine.plan(q, k, v, alibi_slopes=slopes)
    torch.testing.assert_close(plan.run(q, k, v).double(), oracle(q, k, v, alibi=slopes)[0], rtol=2e-5, atol=2e-5)
    slopes.mul_(4)  # (an optimizer's step: the plan reads the tensor, not a copy made when planning)
    torch.testing.assert_close(plan.run(q, k, v).double(), oracle(q, k, v, alibi=slopes)[0], rtol=2e-5, atol=2e-5)


@needs_native
def test_where_the_native_kernel_does_not_add_alibi_it_says_why_and_the_result_holds():
    q, k, v = case(1, 4, 2, 1, 300, 32, torch.float32, 11, spread=1.0)
    slopes = torch.rand(4)
    listed = torch.randint(0, 300, (1, 2, 1, 16))
    choice = engine.explain(q, k, v, alibi_slopes=slopes, key_indices=listed)
    assert "ALiBi with key_indices" in choice.passed_over["decode_native"], choice
    far = torch.arange(300) + (1 << 24)  # positions past 2^24: not exact in fp32
    choice = engine.explain(q, k, v, far[-1:], far, alibi_slopes=slopes)
    assert "exact below 2^24" in choice.passed_over["decode_native"], choice
    out = causal_attention(q, k, v, far[-1:], far, alibi_slopes=slopes)
    torch.testing.assert_close(out.double(), oracle(q, k, v, far[-1:], far, alibi=slopes)[0], rtol=2e-5, atol=2e-5)
    listed_paged = torch.randint(0, 300, (1, 2, 16))  # [Nq, Hkv, K]
    pool, table = k[0].transpose(0, 1).reshape(300, 1, 2, 32), torch.arange(300)[None]  # pages of one key
    text = engine.explain_paged(q[0, :, 0][None], pool, pool, table, torch.tensor([300]), torch.tensor([0, 1]),
                                alibi_slopes=slopes, key_indices=listed_paged)
    assert "ALiBi with key_indices" in text, text


@needs_native
@pytest.mark.parametrize("t", [1, 3])
def test_a_paged_step_with_alibi_reads_in_place_and_matches_the_oracle(t):
    g = torch.Generator().manual_seed(13)
    page, hkv, d, lens = 16, 2, 64, torch.tensor([37, 100, 5])
    table = torch.randperm(21, generator=g).reshape(3, 7)  # [B, max_pages]
    k_pool, v_pool = torch.randn(21, page, hkv, d, generator=g), torch.randn(21, page, hkv, d, generator=g)
    q = torch.randn(3 * t, 8, d, generator=g)
    indptr, slopes = torch.arange(4) * t, torch.rand(8, generator=g)
    text = engine.explain_paged(q, k_pool, v_pool, table, lens, indptr, alibi_slopes=slopes, softcap=6.0)
    assert "decode_native reads K/V in place" in text, text
    out = paged_attention(q, k_pool, v_pool, table, lens, indptr, alibi_slopes=slopes, softcap=6.0)
    want = paged_oracle(q, k_pool, v_pool, table, lens, indptr, alibi=slopes, softcap=6.0)[0]
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("variant", ["native", "avx512", "avx2", "plain_cpp"])
def test_each_vector_path_adds_alibi_and_a_bias(variant, variant_library):
    from engine.kernels.decode.decode_native import OK, _call

    library = variant_library(variant)
    q, k, v = case(2, 8, 2, 3, 333, 64, torch.float32, 12, spread=1.0)  # T 3: rows of three queries a head
    kpos = torch.stack([torch.arange(333) * 2, torch.arange(333)])  # [B, S]: each sequence its own
    qpos = kpos[:, -3:] + 1
    slopes = torch.rand(2, 8, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(1, 8, 3, 333, generator=torch.Generator().manual_seed(2))  # and a bias per head and query
    plan = engine.plan(q, k, v, qpos, kpos, torch.ones(1, 1, 3, 333, dtype=torch.bool), causal=False,
                       alibi_slopes=slopes, bias=bias)
    scores = ScoreOps(plan.inputs, 0, 3, 0, 333)
    q_rows = q.reshape(2, 2, 12, 64)  # [B, Hkv, G*T, D]
    out, lse = torch.empty(2, 2, 12, 64), torch.empty(2, 2, 12)
    assert _call(library, q_rows, 0.125, (k, None), (v, None), None, out, lse, scores=scores) == OK
    want, want_lse = oracle(q, k, v, qpos, kpos, scale=0.125, causal=False, alibi=slopes, bias=bias)
    torch.testing.assert_close(out.reshape(2, 8, 3, 64).double(), want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.reshape(2, 8, 3).double(), want_lse, rtol=1e-5, atol=1e-5)


@needs_native
def test_the_kernel_refuses_alibi_without_its_positions_rather_than_read_nothing():
    from engine.kernels.decode.decode_native import DoesNotFit, _call
    from engine.kernels.decode.native_build import load_native

    q, k, v = case(1, 4, 2, 1, 64, 32, torch.float32, 14, spread=1.0)
    scores = ScoreOps(engine.plan(q, k, v, alibi_slopes=torch.rand(4)).inputs, 0, 1, 0, 64)
    scores.key_pos = (torch.zeros(0), 0)  # (a null address: as a call filled wrongly would pass)
    out, lse = torch.empty(1, 2, 2, 32), torch.empty(1, 2, 2)
    with pytest.raises(DoesNotFit, match="refused the call"):
        _call(load_native(), q.reshape(1, 2, 2, 32), 0.1, (k, None), (v, None), None, out, lse, scores=scores)


@needs_native
@settings(deadline=None, max_examples=40)
@given(st.integers(1, 3), st.sampled_from([(4, 4), (8, 2), (6, 3)]), st.integers(1, 16), st.integers(1, 500),
       st.sampled_from([torch.float32, torch.bfloat16]), st.tuples(*[st.booleans()] * 4), st.booleans(),
       st.booleans(), st.sampled_from(["none", "window"]), st.integers(0, 10**6))
def test_property_a_bias_on_the_native_kernel_matches_the_oracle(b, heads, t, s, dtype, full, alibi, capped, mask,
                                                                 seed):
    hq, hkv = heads
    q, k, v = case(b, hq, hkv, t, s, 32, dtype, seed, spread=1.0)
    g = torch.Generator().manual_seed(seed)
    shape = tuple(n if whole else 1 for n, whole in zip((b, hq, t, s), full))  # [B|1, Hq|1, T|1, S|1]
    bias = torch.randn(*shape, generator=g).to(torch.float64 if seed % 3 == 0 else torch.float32)  # (any float)
    slopes = torch.rand(hq, generator=g) if alibi else None
    qpos = kpos = allowed = None
    if mask == "window":
        qpos, kpos = torch.arange(s - t, s), torch.arange(s)
        allowed = window_mask(qpos, kpos, max(1, s // 3))
    options = {"bias": bias, "alibi_slopes": slopes, "softcap": 4.0 if capped else None}
    plan = engine.plan(q, k, v, qpos, kpos, allowed, **options)
    assert plan.kernel == "decode_native", plan
    out, lse = plan.run(q, k, v, return_lse=True)
    want, want_lse = oracle(q, k, v, qpos, kpos, allowed, softcap=options["softcap"], alibi=slopes, bias=bias)
    assert_matches(out, lse, want, want_lse, dtype)


@needs_native
def test_t5s_relative_bias_on_the_native_kernel_is_its_block_of_the_calls_positions_read_at_each_run():
    from engine.relative_bias import RelativePositionBias

    q, k, v = case(2, 8, 2, 3, 300, 32, torch.float32, 15, spread=1.0)
    table = torch.randn(8, 32, generator=torch.Generator().manual_seed(2))
    bias = RelativePositionBias(table, bidirectional=False, max_distance=128)
    plan = engine.plan(q, k, v, bias=bias)
    assert plan.kernel == "decode_native", plan
    pos = torch.arange(300)
    for _ in range(2):  # the table changed in place between runs (an optimizer's step): read at each run
        dense = bias.block(pos[-3:][None], pos[None])  # [1, Hq, T, S]
        torch.testing.assert_close(plan.run(q, k, v).double(), oracle(q, k, v, bias=dense)[0], rtol=2e-5, atol=2e-5)
        table.mul_(-2)


@needs_native
def test_a_bias_with_key_indices_is_left_to_the_sparse_kernel():
    q, k, v = case(1, 4, 2, 1, 300, 32, torch.float32, 17, spread=1.0)
    choice = engine.explain(q, k, v, bias=torch.randn(1, 4, 1, 300), key_indices=torch.randint(0, 300, (1, 2, 1, 8)))
    assert "a bias with key_indices" in choice.passed_over["decode_native"], choice


@needs_native
@pytest.mark.parametrize("modifier", ["softcap", "alibi", "bias"])
def test_in_batch_invariant_mode_a_modified_prefill_runs_natively_chunk_by_chunk(modifier):
    # T 40: chunks of 16, 16, 8 queries, each with its own queries' positions (ALiBi) and rows (a bias)
    q, k, v = case(2, 4, 2, 40, 90, 32, torch.float32, 8)
    options = {"softcap": {"softcap": 6.0}, "alibi": {"alibi_slopes": torch.tensor([0.5, 0.3, 0.2, 0.1])},
               "bias": {"bias": torch.randn(1, 4, 40, 90, generator=torch.Generator().manual_seed(3))}}[modifier]
    previous = engine.set_batch_invariant(True)
    try:
        plan = engine.plan(q, k, v, **options)
        out, lse = plan.run(q, k, v, return_lse=True)
        alone = engine.plan(q[:1], k[:1], v[:1], **options).run(q[:1], k[:1], v[:1])
    finally:
        engine.set_batch_invariant(previous)
    assert plan.kernel == "decode_native", plan
    want, want_lse = oracle(q, k, v, softcap=options.get("softcap"), alibi=options.get("alibi_slopes"),
                            bias=options.get("bias"))
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    assert torch.equal(alone, out[:1])  # a row alone or batched: bitwise the same
