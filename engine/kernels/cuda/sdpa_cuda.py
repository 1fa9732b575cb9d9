"""Kernel ``sdpa_cuda``: PyTorch's fused CUDA attention (``F.scaled_dot_product_attention``: flash, cuDNN or
memory-efficient backend, PyTorch's choice) where the engine's rule equals one of its two patterns exactly.

The same test as the CPU ``sdpa`` kernel (``causal_pattern``, engine.kernels.visibility): every key visible
(decode with default positions, ``causal=False``) or top-left ``is_causal`` (plain prefill, T == S, equal
increasing positions). Anything else (a mask, chunked prefill, per-row positions, softcap) is the ``flex``
kernel's on CUDA.

GQA: all-visible calls fold the G query heads of a KV head into query rows, so one KV head is read once for
its whole group (decode: ``q [B, Hq, T, D] -> [B, Hkv, G*T, D]``, a view for contiguous q); causal calls use
the backends' own ``enable_gqa``. K/V go in as they are: a KV-cache slice ``[:, :, :L]`` of a longer buffer,
or a ``[B, S, H, D]`` layout transposed, is a strided view the backends read without a copy (the last axis
must be contiguous; PyTorch copies it otherwise).

The lse, when asked for, comes from the backend op that returns it (``_scaled_dot_product_flash_attention``
for fp16/bf16, ``_scaled_dot_product_efficient_attention`` for fp32; natural log, fp32), with K/V heads
repeated for GQA; an lse with gradients goes to ``flex`` (the ops' lse is not differentiable).
NaN/inf in K/V: engine.kernels.nonfinite. Readable twin: the ``reference`` kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.inputs import AttentionInputs
from engine.kernels.common import DoesNotFit, fold_groups, needs_grad, unfold_groups
from engine.kernels.nonfinite import run_guarded
from engine.kernels.sdpa.fused_op import causal_call_fits
from engine.kernels.visibility import causal_pattern

DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the fused CUDA backends take
MAX_HEAD_DIM = 256  # the flash backend's limit (the others are slower beyond it)
FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
EFFICIENT_LSE = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)


def sdpa_cuda_fits(inputs: AttentionInputs) -> str | None:
    """Why one fused CUDA SDPA call cannot compute these inputs exactly (None: it can, given finite values)."""
    return _pattern(inputs)[1]


def _pattern(inputs: AttentionInputs) -> tuple[str | None, str | None]:
    """``(pattern, None)`` when one fused call fits, else ``(None, why not)``."""
    q, v = inputs.q, inputs.v
    if q.device.type != "cuda":
        return None, f"inputs are on {q.device}: this is the CUDA kernel (PyTorch's fused CUDA backends)"
    if q.dtype not in DTYPES:
        return None, f"dtype {q.dtype}: the fused CUDA backends take fp16, bf16 and fp32"
    d, dv = q.shape[3], v.shape[3]
    if d != dv or not 0 < d <= MAX_HEAD_DIM:
        return None, f"D = {d}, Dv = {dv}: the fused CUDA backends need D == Dv in 1..{MAX_HEAD_DIM}"
    if inputs.allowed is not None:
        return None, "a mask is given (allowed): flex takes masks on CUDA"
    pattern = causal_pattern(inputs)
    if pattern is None:
        return None, ("the positions are not plain prefill (T == S, equal increasing positions) nor all-visible: "
                      "the rule needs a mask (flex)")
    if pattern == "causal" and not causal_call_fits(inputs.scale):
        return None, f"scale = {inputs.scale} <= 0: is_causal needs a positive scale (flex masks instead)"
    return pattern, None


def sdpa_cuda_attention(inputs: AttentionInputs, return_lse: bool = False):
    """Kernel ``"sdpa_cuda"``: ``(out [B, Hq, T, Dv], lse [B, Hq, T] fp32 or None)``."""
    pattern, why_not = _pattern(inputs)
    if why_not is not None:
        raise DoesNotFit(why_not)
    if return_lse and needs_grad(inputs.q, inputs.k, inputs.v):
        raise DoesNotFit("an lse with gradients: the fused CUDA ops return no differentiable lse", resume="flex")
    return run_guarded(inputs, return_lse, lambda x, lse: _fused(x, pattern, lse))


def _fused(inputs: AttentionInputs, pattern: str, return_lse: bool):
    q, k, v = inputs.q, inputs.k, inputs.v
    batch, q_heads, t, d = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    if pattern == "none" and group > 1:  # every key visible: the group's heads are rows of one KV head
        q = fold_groups(q, kv_heads)  # [B, Hkv, G*T, D]; rows g*T + i = head h*G + g, query i
    causal = pattern == "causal"
    if return_lse:
        out, lse = _with_lse(q, k, v, causal, inputs.scale)  # [B, H, R, D], [B, H, R]
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=inputs.scale,
                                             enable_gqa=q.shape[1] != kv_heads)  # [B, H, R, D]
        lse = None
    out = unfold_groups(out, q_heads)  # [B, Hq, T, D]
    return out, (None if lse is None else unfold_groups(lse, q_heads))


def _with_lse(q, k, v, causal: bool, scale: float):
    """Output and natural-log lse ``[B, H, R]`` (fp32) from the backend op that returns one."""
    if q.shape[1] != k.shape[1]:  # the ops take no GQA: repeat each KV head for its group
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, Hq, S, D]
    rows = q.shape[2]
    if q.dtype in (torch.float16, torch.bfloat16) and FLASH_LSE is not None and q.shape[3] % 8 == 0:
        out, lse = FLASH_LSE(q, k, v, 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = EFFICIENT_LSE(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    return out, lse[..., :rows].float()  # the efficient op pads its lse to a multiple of 32 rows
