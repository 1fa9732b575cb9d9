"""Run a plan of fused calls (engine.kernels.sdpa.calls): forward, merge, and backward by spans.

Each query tile's calls are merged exactly by ``merge_attention_states``; runs of translated copies of one
masked call go to the op as one batched call (the query tiles and their overlapping key spans as strided
views ``[n, Hq, tq, D]`` / ``[n, Hkv, tk, D]`` with one shared mask).

ALiBi and biases ride in each call's additive mask (no batched calls then: a bias differs per tile).

Gradients: the fused op's backward applied per span, fed the *merged* output and lse, gives each span's
exact share of dq, dk, dv (the flash backward only needs the softmax weights ``exp(s - lse)`` and
``delta = rowsum(dout * out)``, both global). A gradient that reaches the lse itself (the op's backward has
no lse input) is computed by tiles (engine.kernels.tiled.backward).

Used by the kernels ``sdpa`` (a plan of one call) and ``sdpa_tiles``.
"""

from __future__ import annotations

import torch

from engine.inputs import AttentionInputs
from engine.kernels.common import NEG_INF, additive_mask, compute_dtype, differentiable
from engine.kernels.merge import merge_attention_states
from engine.kernels.scores import additive_block
from engine.kernels.sdpa.calls import Call, batches, single_call, span_visible
from engine.kernels.sdpa.fused_op import FLASH, FLASH_BACKWARD, flash_call, flash_operands
from engine.kernels.tiled.backward import tiled_backward
from engine.kernels.tiles import CAUSAL, PARTIAL
from engine.kernels.visibility import visibility_mask


def run_calls(inputs: AttentionInputs, groups: list[list[Call]], return_lse: bool):
    """Run planned calls, with autograd when q, k or v need gradients."""

    def backward(x, out_compute, lse, grad_out, grad_lse):
        if grad_lse is not None and bool((grad_lse != 0).any()):  # the fused backward has no lse input
            return tiled_backward(x, out_compute, lse, grad_out, grad_lse)
        return flash_backward(x, groups, out_compute, lse, grad_out)

    out, lse = differentiable(inputs, lambda x: flash_forward(x, groups), backward)
    return out, (lse if return_lse else None)


def flash_forward(inputs: AttentionInputs, groups: list[list[Call]]):
    """``(out in q's dtype, lse in the compute dtype, out as saved for the backward)``.

    bf16/fp16 q, K, V go to the fused op as they are (no up-cast copy); partial outputs, their merge
    and the lse run in fp32. Rows no call covers stay 0 / -inf.
    """
    q, v = inputs.q, inputs.v
    batch, q_heads, t, _ = q.shape
    compute = compute_dtype(q.dtype)
    qc, kc, vc = flash_operands(q, inputs.k, v)
    biased = inputs.modifiers.additive()  # ALiBi / bias: every call carries its span's bias in its additive mask
    only = None if biased else single_call(groups, batch, t, inputs.k.shape[2])
    if only is not None:  # one call: no merging
        o, part_lse = FLASH(qc, kc, vc, 0.0, only.kind == CAUSAL, scale=inputs.scale)
        return o.to(q.dtype), part_lse.to(compute), o
    mask = visibility_mask(inputs)
    covered = sum((g[0].rows.stop - g[0].rows.start) * (g[0].i1 - g[0].i0) for g in groups) == batch * t  # disjoint
    alloc = torch.empty if covered else torch.zeros  # rows no call covers stay 0
    out = alloc(batch, q_heads, t, v.shape[3], dtype=compute, device=q.device)  # [B, Hq, T, Dv]
    lse = torch.full((batch, q_heads, t), NEG_INF, dtype=compute, device=q.device)  # [B, Hq, T]
    for batched, group in batches(mask, groups, join=not biased):
        if batched:  # query tiles sharing one masked call shape and mask
            _run_batch(qc, kc, vc, mask, group, inputs.scale, out, lse)
            continue
        parts_out, parts_lse = [], []
        for call in group:
            rows, i0, i1, j0, j1, kind = call
            visible = span_visible(mask, call) if kind == PARTIAL else None  # [1, Hq|1, tq, tk]
            o, part_lse = flash_call(qc[rows, :, i0:i1], kc[rows, :, j0:j1], vc[rows, :, j0:j1], inputs.scale,
                                     causal=kind == CAUSAL, visible=visible,
                                     bias=_call_bias(inputs, call, compute, visible) if biased else None
                                     )  # [b, Hq, tq, Dv], [b, Hq, tq]
            parts_out.append(o.to(compute))  # merged in fp32: only each part's output is rounded
            parts_lse.append(part_lse.to(compute))
        o, part_lse = (parts_out[0], parts_lse[0]) if len(group) == 1 else merge_attention_states(parts_out, parts_lse)
        first = group[0]
        out[first.rows, :, first.i0:first.i1] = o
        lse[first.rows, :, first.i0:first.i1] = part_lse
    return out.to(q.dtype), lse, out


def _run_batch(qc, kc, vc, mask, calls: list[Call], scale, out: torch.Tensor, lse: torch.Tensor) -> None:
    """One fused call for n translated copies of a masked call; writes their rows of out and lse."""
    rows, i0, i1, j0, j1, _ = calls[0]
    n, tq, tk, end = len(calls), i1 - i0, j1 - j0, calls[-1].i1
    batch = qc[rows].shape[0]
    q_tiles = qc[rows, :, i0:end].unflatten(2, (n, tq)).permute(2, 0, 1, 3, 4)  # [n, b, Hq, tq, D]
    k_spans = kc[rows, :, j0:j0 + (n - 1) * tq + tk].unfold(2, tk, tq).permute(2, 0, 1, 4, 3)  # [n, b, Hkv, tk, D]
    v_spans = vc[rows, :, j0:j0 + (n - 1) * tq + tk].unfold(2, tk, tq).permute(2, 0, 1, 4, 3)  # [n, b, Hkv, tk, Dv]
    o, part_lse = flash_call(q_tiles.flatten(0, 1), k_spans.flatten(0, 1), v_spans.flatten(0, 1), scale,
                             visible=span_visible(mask, calls[0]))  # [n*b, Hq, tq, Dv], [n*b, Hq, tq]
    out[rows, :, i0:end] = o.unflatten(0, (n, batch)).permute(1, 2, 0, 3, 4).flatten(2, 3)  # [b, Hq, n*tq, Dv]
    lse[rows, :, i0:end] = part_lse.unflatten(0, (n, batch)).permute(1, 2, 0, 3).flatten(2, 3)  # [b, Hq, n*tq]


def flash_backward(inputs: AttentionInputs, groups: list[list[Call]], out_ct: torch.Tensor, lse: torch.Tensor,
                   grad_out: torch.Tensor | None):
    """Each call's share of ``(dq, dk, dv)`` from the fused backward, fed the merged out and lse."""
    q, k, v = inputs.q, inputs.k, inputs.v
    compute = compute_dtype(q.dtype)
    qc, kc, vc = flash_operands(q, k, v)
    kt = qc.dtype  # the dtype the fused op runs in; its out and grad inputs must match it
    grad = torch.zeros_like(out_ct, dtype=kt) if grad_out is None else grad_out.to(kt)  # [B, Hq, T, Dv]
    out_k = out_ct.to(kt)  # [B, Hq, T, Dv]
    biased = inputs.modifiers.additive()
    only = None if biased else single_call(groups, q.shape[0], q.shape[2], k.shape[2])
    if only is not None:
        g_q, g_k, g_v = FLASH_BACKWARD(grad.contiguous(), qc, kc, vc, out_k, lse.to(compute), 0.0, only.kind == CAUSAL,
                                        scale=inputs.scale)
        return g_q.to(q.dtype), g_k.to(k.dtype), g_v.to(v.dtype)
    lse_use = lse.to(compute).masked_fill(lse == NEG_INF, float("inf"))  # empty rows: weights exp(s - inf) = 0
    mask = visibility_mask(inputs)
    dq, dk, dv = (torch.zeros_like(x, dtype=compute) for x in (qc, kc, vc))  # spans' shares summed in fp32
    for group in groups:
        for call in group:
            rows, i0, i1, j0, j1, kind = call
            visible = span_visible(mask, call) if kind == PARTIAL else None  # [1, Hq|1, tq, tk]
            additive = (_call_bias(inputs, call, compute, visible) if biased
                        else None if visible is None else additive_mask(visible, kt))
            g_q, g_k, g_v = FLASH_BACKWARD(
                grad[rows, :, i0:i1].contiguous(), qc[rows, :, i0:i1], kc[rows, :, j0:j1], vc[rows, :, j0:j1],
                out_k[rows, :, i0:i1], lse_use[rows, :, i0:i1].contiguous(), 0.0, kind == CAUSAL,
                attn_mask=additive, scale=inputs.scale)
            dq[rows, :, i0:i1] += g_q
            dk[rows, :, j0:j1] += g_k
            dv[rows, :, j0:j1] += g_v
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _call_bias(inputs: AttentionInputs, call: Call, dtype: torch.dtype, visible: torch.Tensor | None) -> torch.Tensor:
    """A biased call's additive mask ``[b|1, Hq|1, tq, tk]``: ALiBi plus bias of its span where visible, -inf
    where not (engine.kernels.scores), made dense for the op."""
    bias = additive_block(inputs, call.rows, call.i0, call.i1, call.j0, call.j1, dtype, visible)
    return bias.expand(*bias.shape[:2], call.i1 - call.i0, call.j1 - call.j0)  # [b|1, Hq|1, tq, tk]
