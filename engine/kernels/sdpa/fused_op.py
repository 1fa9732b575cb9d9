"""PyTorch's fused CPU flash-attention op, wrapped once: when it fits, what it is given, and one call of it.

The op computes ``softmax(q @ k^T * scale + mask) @ v`` and its log-sum-exp without materialising the
scores. What the engine relies on, and works around:

- it knows two patterns on its own: no mask, and ``is_causal`` (top-left: query i sees keys j <= i);
  any other visibility enters as an additive mask (0 where visible, -inf elsewhere), and so do ALiBi and
  biases (the bias where visible, -inf elsewhere);
- ``is_causal`` scales its own -inf, so it gives NaN for ``scale <= 0``: such squares use an additive mask;
- a row whose keys are all masked comes back with lse 0 (not -inf): ``flash_call`` makes it the engine's
  output 0 and lse -inf;
- it reads each head-dim vector as contiguous memory (it ignores ``stride(-1)``): ``flash_operands``
  copies a tensor whose last axis is strided, and nothing else;
- bf16/fp16 inputs are accumulated in fp32 and the lse comes back in fp32.

Used by the kernels ``sdpa``, ``sdpa_tiles`` and ``decode``.
"""

from __future__ import annotations

import torch

from engine.inputs import AttentionInputs
from engine.kernels.common import additive_mask, clear_unseen

FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def flash_fits(inputs: AttentionInputs) -> str | None:
    """Why the fused CPU op cannot compute these inputs exactly (None: it can, given finite values)."""
    if FLASH is None or FLASH_BACKWARD is None:
        return "this torch build has no fused CPU flash kernel"
    if inputs.q.device.type != "cpu":
        return f"the fused flash kernel used here is the CPU one; inputs are on {inputs.q.device}"
    if inputs.v.shape[3] != inputs.q.shape[3]:
        return f"Dv = {inputs.v.shape[3]} != D = {inputs.q.shape[3]}: the fused kernel needs equal head dims"
    if inputs.q.shape[3] == 0:
        return "D = 0: the fused kernel needs a non-empty head dim"
    return None


def causal_call_fits(scale: float) -> bool:
    """The op's ``is_causal`` gives NaN for ``scale <= 0`` (it scales its own -inf), so with such a scale a
    causal square is a masked call instead (an additive mask is added after scaling: exact)."""
    return scale > 0


def flash_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k, v as the fused op takes them, detached, copied only where it needs a copy.

    dtype: fp32/fp64/bf16/fp16 as they are (no up-cast copy of K/V). Layout: a tensor whose last axis is
    strided (``x[..., ::2]``, an ``expand`` along D, a permuted layout) is copied; any strides on the other
    axes are fine (contiguous, ``[B, S, H, D]`` transposed, KV-cache slices, expanded batch or heads), so
    those layouts are passed as they are.
    """
    return tuple(_unit_last_stride(x.detach()) for x in (q, k, v))


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def flash_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False,
               visible: torch.Tensor | None = None, bias: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused call: ``(out [b, H, R, Dv] in q's dtype, lse [b, H, R] fp32/fp64)``.

    q ``[b, H, R, D]``, k/v ``[b, H|Hkv, n, D]`` (GQA heads broadcast by the op), ``visible`` an optional bool
    mask broadcastable to ``[b, H, R, n]``; rows it hides entirely get output 0 and lse -inf. ``bias``: the
    additive mask of a call with ALiBi or a bias, ``[b|1, H|1, R, n]`` in the compute dtype (the bias where
    visible, -inf where not: engine.kernels.scores.additive_block; the op adds an fp32 mask to bf16/fp16
    inputs' fp32 scores as it is); it replaces the mask made from ``visible``.
    """
    additive = bias if bias is not None else None if visible is None else additive_mask(visible, q.dtype)
    out, lse = FLASH(q, k, v, 0.0, causal, attn_mask=additive, scale=scale)
    if visible is not None:
        out, lse = clear_unseen(out, lse, visible.any(dim=-1))
    return out, lse

