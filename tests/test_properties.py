"""Property-based tests: causal_attention against the float64 per-query loop over random everything."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.attention import causal_attention
from engine.reference.loops import per_query_attention
from tests.precision import assert_within_precision, plain_attention

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def attention_case(draw):
    """Random shapes (odd lengths, T != S both ways, T = 1), heads (MHA/GQA/MQA), positions and masks."""
    b = draw(st.integers(1, 3))
    hkv = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 4]))
    t = draw(st.integers(1, 13))
    s = draw(st.integers(1, 17))
    d = draw(st.sampled_from([1, 3, 8, 16]))
    dv = draw(st.sampled_from([d, 5]))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * group, t, d, generator=gen)
    k = torch.randn(b, hkv, s, d, generator=gen)
    v = torch.randn(b, hkv, s, dv, generator=gen)
    kind = draw(st.sampled_from(["default", "shared", "per_row"]))
    qpos = kpos = None
    if kind == "shared":
        kpos = torch.randint(0, 20, (s,), generator=gen)
        qpos = torch.randint(-2, 22, (t,), generator=gen)
    elif kind == "per_row":
        kpos = torch.randint(0, 20, (b, s), generator=gen)
        qpos = torch.randint(-2, 22, (b, t), generator=gen)
    allowed = None
    mask_kind = draw(st.sampled_from(["none", "dense", "keys", "heads"]))
    if mask_kind == "dense":
        allowed = torch.rand(t, s, generator=gen) < 0.7  # [T, S]
    elif mask_kind == "keys":
        allowed = torch.rand(b, 1, 1, s, generator=gen) < 0.7  # [B, 1, 1, S]
    elif mask_kind == "heads":
        allowed = torch.rand(b, hkv * group, t, s, generator=gen) < 0.7  # [B, Hq, T, S]
    causal = draw(st.booleans()) if kind != "default" else True
    return q, k, v, qpos, kpos, allowed, causal


def full_mask(q, k, qpos, kpos, allowed, causal):
    b, hq, t, _ = q.shape
    s = k.shape[2]
    qp = (torch.arange(s - t, s) if qpos is None else qpos).expand(b, t)
    kp = (torch.arange(s) if kpos is None else kpos).expand(b, s)
    mask = kp[:, None, None, :] <= qp[:, None, :, None] if causal else torch.ones(b, 1, t, s, dtype=torch.bool)
    return (mask & allowed if allowed is not None else mask).expand(b, hq, t, s)


@given(case=attention_case(), dtype=st.sampled_from(DTYPES))
def test_causal_attention_matches_the_float64_loop_within_precision(case, dtype):
    q, k, v, qpos, kpos, allowed, causal = case
    oracle = per_query_attention(q.to(dtype), k.to(dtype), v.to(dtype), qpos, kpos, allowed, causal=causal)
    out = causal_attention(q.to(dtype), k.to(dtype), v.to(dtype), qpos, kpos, allowed, causal=causal)
    assert out.dtype == dtype
    mask = full_mask(q, k, qpos, kpos, allowed, causal)
    plain = plain_attention(q, k, v, mask, 1 / math.sqrt(q.shape[-1]), dtype)
    assert_within_precision(out, oracle, plain, dtype)
    empty = ~mask.any(-1)  # [B, Hq, T] rows that see nothing
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))


@given(case=attention_case())
def test_lse_is_the_log_of_the_softmax_denominator(case):
    q, k, v, qpos, kpos, allowed, causal = case
    out, lse = causal_attention(q, k, v, qpos, kpos, allowed, causal=causal, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    mask = full_mask(q, k, qpos, kpos, allowed, causal)
    group = q.shape[1] // k.shape[1]
    scores = q.double() @ k.double().repeat_interleave(group, 1).transpose(-2, -1) / math.sqrt(q.shape[-1])
    expected = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)  # -inf for empty rows
    torch.testing.assert_close(lse.double(), expected, rtol=1e-5, atol=1e-5)


@given(case=attention_case(), cap=st.floats(0.5, 30.0))
def test_softcap_matches_the_loop(case, cap):
    q, k, v, qpos, kpos, allowed, causal = case
    q = q * 4
    out = causal_attention(q, k, v, qpos, kpos, allowed, causal=causal, softcap=cap)
    oracle = per_query_attention(q, k, v, qpos, kpos, allowed, causal=causal, softcap=cap)
    torch.testing.assert_close(out.double(), oracle, rtol=1e-4, atol=1e-5)


@given(case=attention_case())
def test_gradients_match_float64(case):
    q, k, v, qpos, kpos, allowed, causal = case
    inputs32 = [x.clone().requires_grad_(True) for x in (q, k, v)]
    inputs64 = [x.double().requires_grad_(True) for x in (q, k, v)]
    grad_out = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    causal_attention(*inputs32, qpos, kpos, allowed, causal=causal).backward(grad_out)
    causal_attention(*inputs64, qpos, kpos, allowed, causal=causal).backward(grad_out.double())
    for a, b in zip(inputs32, inputs64):
        assert bool(torch.isfinite(a.grad).all())
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-5)


@given(t=st.integers(2, 12), cut=st.integers(1, 11), seed=st.integers(0, 1000))
def test_future_tokens_do_not_change_past_outputs(t, cut, seed):
    cut = min(cut, t - 1)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, t, 4, generator=gen) for _ in range(3))
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[:, :, cut:] = torch.randn(1, 2, t - cut, 4, generator=gen)
    assert torch.equal(causal_attention(q, k, v)[:, :, :cut], causal_attention(q2, k2, v2)[:, :, :cut])


@given(hkv=st.sampled_from([1, 2, 4]), t=st.integers(1, 9), seed=st.integers(0, 1000))
def test_gqa_equals_mha_with_repeated_heads(hkv, t, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 8, t, 4, generator=gen)
    k, v = torch.randn(2, hkv, t, 4, generator=gen), torch.randn(2, hkv, t, 4, generator=gen)
    g = 8 // hkv
    torch.testing.assert_close(causal_attention(q, k, v),
                               causal_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)))
