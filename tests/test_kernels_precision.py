"""Low-precision inputs: each kernel's error against float64 is at most 2x a plain same-precision run's.

The plain run (tests/precision.py) does scores, softmax and the weighted sum all in the input dtype; the
kernels accumulate in fp32, so they must do at least about as well.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention import causal_attention
from engine.inputs import prepare_inputs
from engine.kernels.visibility import dense_visibility
from engine.masks import document_mask, window_mask
from engine.quantized import quantize
from tests.kernel_matrix import FAST
from tests.precision import assert_within_precision, plain_attention

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _case(name):
    pos = torch.arange(260)
    if name == "prefill_gqa":  # T = S = 113, Hq = 4, Hkv = 2
        return (1, 4, 2, 113, 113, 32), {}
    if name == "chunked_prefill":  # 40 queries after 163 cached keys
        return (1, 4, 1, 40, 203, 32), {}
    if name == "window":  # window of 64 over 260 tokens
        return (1, 2, 1, 260, 260, 32), {"allowed": window_mask(pos, pos, 64)}
    if name == "documents":  # documents of 100, 60 and 100 tokens
        return (1, 2, 2, 260, 260, 32), {"allowed": document_mask(pos // 100 + (pos >= 160).long())}
    if name == "decode":  # one query against 1,037 keys, GQA 4:1
        return (2, 8, 2, 1, 1037, 64), {}
    raise KeyError(name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["prefill_gqa", "chunked_prefill", "window", "documents", "decode"])
@pytest.mark.parametrize("kernel", FAST)
def test_low_precision_error_is_at_most_twice_a_plain_run(kernel, case, dtype):
    (b, hq, hkv, t, s, d), kwargs = _case(case)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(b, hq, t, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, s, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, s, d, generator=g).to(dtype)
    oracle = causal_attention(q.double(), k.double(), v.double(), kernel="reference", **kwargs)  # fp64
    inputs = prepare_inputs(q, k, v, None, None, kwargs.get("allowed"), None)
    mask = dense_visibility(inputs)
    if not isinstance(mask, torch.Tensor):
        mask = mask.to_dense()
    plain = plain_attention(q, k, v, mask, inputs.scale, dtype)
    out = causal_attention(q, k, v, kernel=kernel, **kwargs)
    assert out.dtype == dtype
    assert_within_precision(out, oracle, plain, dtype)


# --- values near the float max: the representable answer, never NaN ---------------------------------------------

def _huge_values(name, dtype):
    """q = k = 0 (equal weights, so the output is each visible key's mean value) and V near the float max:
    a kernel that sums p * v before dividing overflows (inf, NaN where +inf meets -inf)."""
    t, s = (1, 600) if name in ("decode", "decode_window") else (300, 300)
    q, k = torch.zeros(1, 4, t, 64, dtype=dtype), torch.zeros(1, 2, s, 64, dtype=dtype)
    v = torch.full((1, 2, s, 64), 1e38).to(dtype)  # [B, Hkv, S, Dv]
    v[..., 1::2] *= -1  # channels of either sign
    v[:, :, : s // 2, 2], v[:, :, s // 2:, 2] = 3e38, -3e38  # a channel whose mean is 0: +inf + -inf = NaN
    v[:, 1, :, 3] = 1.0  # an ordinary channel beside them keeps its precision
    pos = torch.arange(s)
    allowed = window_mask(pos[s - t:], pos, 450) if name == "decode_window" else None
    return q, k, v, allowed


@pytest.mark.parametrize("kernel", ["auto", *FAST, "reference", "flex"])
@pytest.mark.parametrize("name", ["decode", "decode_window", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_values_near_the_float_max_give_the_representable_output_not_nan_or_inf(dtype, name, kernel):
    q, k, v, allowed = _huge_values(name, dtype)
    out, lse = causal_attention(q, k, v, allowed=allowed, kernel=kernel, return_lse=True)
    visible = dense_visibility(prepare_inputs(q, k, v, None, None, allowed, None))  # [B, 1|Hq, T, S]
    weights = visible.double() / visible.double().sum(-1, keepdim=True)  # equal weights over the visible keys
    want = weights @ v.double().repeat_interleave(2, dim=1)  # [B, Hq, T, Dv]
    assert bool(torch.isfinite(out).all()), f"{int((~torch.isfinite(out)).sum())} non-finite outputs"
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # of the values' size, 3e38
    torch.testing.assert_close(out.double(), want, rtol=tolerance, atol=tolerance * 3e38)
    torch.testing.assert_close(out[:, 2:, :, 3].double(), want[:, 2:, :, 3], rtol=tolerance, atol=tolerance)
    lse_tolerance = 1e-6 if dtype == torch.float32 else 1e-3  # the fused op's bf16 lse: ~5e-5 off
    torch.testing.assert_close(lse.double(), torch.log(visible.double().sum(-1)).expand_as(lse), rtol=lse_tolerance,
                               atol=lse_tolerance)


@pytest.mark.parametrize("kernel", ["auto", "decode_native", "dequantized", "reference"])
def test_a_quantized_cache_of_values_near_the_float_max_gives_the_representable_output(kernel):
    q, k, v, _ = _huge_values("decode", torch.float32)
    stored = quantize(v, torch.int8)  # per-token scales near 1e38 / 127
    out = causal_attention(q, quantize(k, torch.int8), stored, kernel=kernel)
    want = stored.dequantize(torch.float64).mean(dim=2, keepdim=True).repeat_interleave(2, dim=1)  # [B, Hq, 1, Dv]
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5 * 3e38)
