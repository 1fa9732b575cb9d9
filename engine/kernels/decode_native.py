"""Kernel ``decode_native``: the decode kernel in C++, at the memory-bandwidth limit of the CPU.

Decode reads the whole KV cache for a few queries, so its time is the cache's bytes over the memory
bandwidth. This kernel (``decode_native.cpp``, built by ``native_build``) reads each K/V row once for
all ``R = G * T`` query rows of its KV head, converts it to fp32 in registers (bf16, fp16, int8, fp8),
computes the R scores, updates an online softmax and adds the R weighted rows, in blocks of 64 keys;
``B * Hkv * S`` keys are cut into one equal run per thread and the runs merged by log-sum-exp::

    q [B, Hq, T, D] -> fp32 rows [B, Hkv, G*T, D] * scale      (tiny; rows g*T + i: query i of head h*G + g)
    k, v [B, Hkv, S, D] as they are (any strides, last axis contiguous; KVCache.view() slices: no copy)
    out fp32 [B, Hkv, G*T, Dv], lse [B, Hkv, G*T]  ->  [B, Hq, T, Dv] in q's dtype, [B, Hq, T]

Visibility (positions, windows, padding, documents) is cut to the span of keys some row sees; inside it a
bool ``[B|1, Hkv|1, G*T, n]`` tells the kernel which rows see which key (no mask when every key is
visible, as in one-token decode). K/V may be ``QuantizedKV`` (int8 / fp8 with per-token scales,
``engine.quantized``): the option ``"quantized_kv"``. Fits: T <= 16 on the CPU, no gradients, fp32 /
bf16 / fp16 q, no softcap; NaN/inf in q goes to the next kernel. Readable twins: ``decode`` and
``tiled`` (and ``dequantized`` for quantized K/V), checked against a float64 oracle in the tests.
"""

from __future__ import annotations

import ctypes

import torch

from engine.inputs import AttentionInputs
from engine.kernels.common import DoesNotFit, needs_grad
from engine.kernels.native_build import load_native
from engine.kernels.nonfinite import all_finite
from engine.kernels.visibility import causal_pattern, row_visibility, visibility_mask, visible_span
from engine.quantized import QuantizedKV

MAX_QUERIES = 16  # T <= 16 new tokens per row
MIN_KEYS = 512  # auto takes it from this many keys (below, the torch kernels' fixed costs are as small)

# The element kinds of decode_native.cpp.
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}
if hasattr(torch, "float8_e4m3fn"):
    KINDS[torch.float8_e4m3fn] = 4


def native_decode_fits(inputs: AttentionInputs) -> str | None:
    """Why the native decode kernel cannot compute these inputs exactly (None: it can)."""
    library = load_native()
    if isinstance(library, str):
        return library
    q, k = inputs.q, inputs.k
    if q.shape[2] > MAX_QUERIES:
        return f"T = {q.shape[2]} queries: decode serves T <= {MAX_QUERIES}"
    if q.device.type != "cpu":
        return f"the native kernel runs on the CPU, got device {q.device}"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"{q.dtype}: the native kernel computes in fp32 (fp64 runs the torch kernels)"
    if needs_grad(q, inputs.k, inputs.v):
        return "gradients are needed: training runs the tiled kernels"
    if isinstance(k, QuantizedKV) != isinstance(inputs.v, QuantizedKV):
        return "k and v must both be QuantizedKV or both tensors"
    return None


def native_decode_pays_off(inputs: AttentionInputs) -> str | None:
    """Why ``auto`` would not pick it for inputs it fits (None: it pays off). Quantized K/V always do."""
    s = inputs.k.shape[2]
    if isinstance(inputs.k, QuantizedKV) or s >= MIN_KEYS:
        return None
    return f"S = {s} keys: the native decode kernel pays off from S >= {MIN_KEYS}"


def native_decode_attention(inputs: AttentionInputs, return_lse: bool = False):
    """Kernel ``"decode_native"``: ``(out [B, Hq, T, Dv] in q's dtype, lse [B, Hq, T] fp32 or None)``."""
    why_not = native_decode_fits(inputs)
    if why_not is not None:
        raise DoesNotFit(why_not)
    if not all_finite(inputs.q):  # a few hundred bytes; K/V are never scanned (the kernel handles NaN/inf)
        resume = "dequantized" if isinstance(inputs.k, QuantizedKV) else "tiled"  # the kernel that handles it
        raise DoesNotFit("NaN/inf in q: the torch kernels keep it to the rows it belongs to", resume=resume)
    q = inputs.q
    batch, q_heads, t, d = q.shape
    kv_heads, s = inputs.k.shape[1], inputs.k.shape[2]
    dv = inputs.v.shape[3]
    group, rows = q_heads // kv_heads, (q_heads // kv_heads) * t
    out = torch.zeros(batch, kv_heads, rows, dv)  # [B, Hkv, G*T, Dv] fp32
    lse = torch.full((batch, kv_heads, rows), float("-inf"))  # [B, Hkv, G*T]
    mask = visibility_mask(inputs)
    j0, j1 = visible_span(mask, batch, t, s)
    if j1 > j0:
        visible = None
        if mask is not None and (inputs.allowed is not None or causal_pattern(inputs) != "none"):
            visible = row_visibility(mask, batch, kv_heads, group, t, j0, j1)  # [B|1, Hkv|1, G*T, n]
        q_rows = (q.detach().to(torch.float32) * inputs.scale).reshape(batch, kv_heads, rows, d).contiguous()
        _call(load_native(), q_rows, _keys(inputs.k, j0, j1), _keys(inputs.v, j0, j1), visible, out, lse)
    out = out.reshape(batch, q_heads, t, dv).to(q.dtype)  # rows g*T + i of KV head h -> query head h*G + g
    return out, (lse.reshape(batch, q_heads, t) if return_lse else None)


def _keys(x: torch.Tensor | QuantizedKV, j0: int, j1: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(entries [B, Hkv, n, E] with a contiguous last axis, scales [B, Hkv, n] or None)`` of keys j0 .. j1-1."""
    if isinstance(x, QuantizedKV):
        data, scale = x.data[:, :, j0:j1], x.scale[:, :, j0:j1]
    else:
        data, scale = x.detach()[:, :, j0:j1], None
    if data.stride(-1) != 1 and data.shape[-1] > 1:
        data = data.contiguous()  # a strided last axis (x[..., ::2]): the one layout that is copied
    return data, scale


_STRIDES = {3: ctypes.c_int64 * 3, 4: ctypes.c_int64 * 4}  # made once: a new ctypes type per call is slow


def _strides(x: torch.Tensor | None, n: int):
    if x is None:
        return None
    return _STRIDES[n](*x.stride()[:n])


def _call(library, q_rows, k, v, visible, out, lse) -> None:
    (k_data, k_scale), (v_data, v_scale) = k, v
    batch, kv_heads, rows, d = q_rows.shape
    s, dv = k_data.shape[2], v_data.shape[3]
    if k_data.dtype not in KINDS or v_data.dtype != k_data.dtype:
        raise DoesNotFit(f"K/V dtypes {k_data.dtype}, {v_data.dtype}: not read by the native kernel")
    vis = None
    if visible is not None:  # [B|1, Hkv|1, R, n] -> broadcast with zero strides, read as bytes
        vis = visible.expand(batch, kv_heads, rows, s).view(torch.uint8)
    ptr = (lambda x: None if x is None else x.data_ptr())
    status = library.decode(KINDS[k_data.dtype], ptr(k_data), _strides(k_data, 3), ptr(k_scale), _strides(k_scale, 3),
                            ptr(v_data), _strides(v_data, 3), ptr(v_scale), _strides(v_scale, 3),
                            ptr(q_rows), ptr(vis), _strides(vis, 4), batch, kv_heads, rows, s, d, dv,
                            torch.get_num_threads(), ptr(out), ptr(lse))
    if status != 0:
        raise DoesNotFit(f"the native kernel refused the call (status {status})")
