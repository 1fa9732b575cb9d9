"""Helpers the kernels share: compute dtype and the GQA row layout.

GQA layout, stated once: query head ``h = kv_head * G + g`` reads KV head ``kv_head``, so the queries
of one KV head's group are stacked as rows of one matrix and share a single read of that head's K/V::

    q[b]  [Hq, tq, D]  ->  view [Hkv, G, tq, D]  ->  [Hkv, G * tq, D]     (rows g * tq + i; fold_groups)
    Hq = 4, Hkv = 2:  rows of KV head 0 = q heads 0, 1;  rows of KV head 1 = q heads 2, 3
"""

from __future__ import annotations

from collections.abc import Callable

import torch

NEG_INF = float("-inf")
MAX_DECODE_QUERIES = 16  # new queries per row that the decode kernels serve (one token, or a few: speculation)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores, softmax and accumulators run in fp32, or fp64 when the inputs are fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fold_groups(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[..., Hq, T, E] -> [..., Hkv, G * T, E]``: each KV head's query heads stacked as its rows (row g*T + i:
    query i of head h*G + g); a view unless x's heads and rows are strided. The one place this fold is written."""
    *lead, hq, t, e = x.shape
    return x.reshape(*lead, kv_heads, (hq // kv_heads) * t, e)


def unfold_groups(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    """The inverse of ``fold_groups`` on a result: out ``[B, Hkv, G*T, Dv] -> [B, Hq, T, Dv]``, lse ``[B, Hkv, G*T]
    -> [B, Hq, T]`` (a view of a contiguous result)."""
    batch, kv_heads, rows = x.shape[:3]
    return x.reshape(batch, q_heads, rows * kv_heads // q_heads, *x.shape[3:])


def head_mask(mask: torch.Tensor, kv_heads: int, q_heads: int) -> torch.Tensor:
    """A tile mask ``[tq, tk]`` / ``[1|Hq, tq|1, tk|1]`` made broadcastable to ``[Hkv, G, tq, tk]``."""
    if mask.dim() == 3 and mask.shape[0] == q_heads and q_heads > 1:
        return mask.reshape(kv_heads, q_heads // kv_heads, *mask.shape[1:])  # [Hkv, G, tq, tk]
    return mask  # [tq, tk] or [1, tq, tk]: broadcasts over heads


class DoesNotFit(Exception):
    """Raised by a kernel that cannot compute these inputs exactly (found while running: NaN/inf in q, ...):
    dispatch catches it and runs the next kernel of its fallback order that fits, from ``resume`` when given
    (the first kernel that can, when the kernels in between would only find the same)."""

    def __init__(self, why: str, resume: str | None = None) -> None:
        super().__init__(why)
        self.resume = resume


def needs_grad(*tensors: torch.Tensor) -> bool:
    """True when autograd will want gradients of any of these tensors."""
    if not torch.is_grad_enabled():
        return False
    for x in tensors:
        if x.requires_grad:
            return True
    return False


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the fused kernel's additive mask: 0 where visible, -inf elsewhere (same shape)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, NEG_INF)


def clear_unseen(out: torch.Tensor, lse: torch.Tensor, seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that see no key: output 0 and lse -inf (a fused masked call gives them lse 0).

    ``out [..., R, Dv]``, ``lse [..., R]``, ``seen`` bool broadcastable to ``lse``.
    """
    if bool(seen.all()):
        return out, lse
    return out.masked_fill(~seen[..., None], 0.0), lse.masked_fill(~seen, NEG_INF)


def differentiable(inputs, forward: Callable, backward: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``forward(inputs) -> (out, lse, saved_out)``, with autograd through ``backward(inputs,
    saved_out, lse, grad_out, grad_lse) -> (dq, dk, dv[, dbias])`` when q, k, v (or a dense bias) need gradients
    (either grad may be None). ``saved_out`` is the output as the backward wants it (e.g. before the cast to q's
    dtype); the backward returns ``dbias`` only for a learned bias (``Modifiers.learned_bias()``: a dense bias,
    or a RelativePositionBias's table, that requires grad), in that tensor's shape."""
    bias = inputs.modifiers.learned_bias()
    if needs_grad(inputs.q, inputs.k, inputs.v) or bias is not None:
        return _Differentiable.apply(inputs.q, inputs.k, inputs.v, bias, inputs, forward, backward)
    out, lse, _ = forward(inputs)
    return out, lse


class _Differentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, inputs, forward, backward):
        inputs = inputs.with_tensors(q, k, v)
        out, lse, saved_out = forward(inputs)
        ctx.save_for_backward(q, k, v, saved_out, lse)
        ctx.inputs, ctx.backward = inputs, backward
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, saved_out, lse = ctx.saved_tensors
        if grad_out is None and grad_lse is None:
            return None, None, None, None, None, None, None
        inputs = ctx.inputs.with_tensors(q, k, v)
        grads = ctx.backward(inputs, saved_out, lse, grad_out, grad_lse)
        dbias = grads[3] if len(grads) > 3 else None
        return grads[0], grads[1], grads[2], dbias, None, None, None


def nothing_seen(rows: tuple[int, ...], dv: int, dtype: torch.dtype, device: torch.device,
                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The result of rows that see no key, stated once: out 0 ``[*rows, Dv]`` (in ``out_dtype``, default the compute
    dtype) and lse -inf ``[*rows]`` in the compute dtype of ``dtype`` (fp32; fp64 for fp64)."""
    compute = compute_dtype(dtype)
    return (torch.zeros(*rows, dv, dtype=out_dtype or compute, device=device),
            torch.full(rows, NEG_INF, dtype=compute, device=device))


def empty_result(inputs, return_lse: bool):
    """B, Hq or T of 0 gives an empty output; S = 0 gives rows that see nothing: zeros and lse -inf. In training
    the result is still part of the graph (zero gradients), so a loss over it can call backward."""

    def forward(x):
        out, lse = nothing_seen(x.q.shape[:3], x.v.shape[3], x.q.dtype, x.q.device, x.q.dtype)  # [B, Hq, T, Dv]
        return out, lse, out

    def backward(x, out, lse, grad_out, grad_lse):
        return torch.zeros_like(x.q), torch.zeros_like(x.k), torch.zeros_like(x.v)

    out, lse = differentiable(inputs, forward, backward)
    return out, (lse if return_lse else None)
