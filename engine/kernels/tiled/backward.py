"""Attention backward by tiles: recompute each tile's weights from the saved log-sum-exp.

The ``tiled`` kernel's backward, and ``sdpa_tiles``' when a gradient reaches the lse (the fused op's own
backward has no lse input); it needs only the inputs, the output and the lse, not the kernel that made them.

With ``p = exp(s - lse)`` (exact softmax weights, no second normalisation pass) and
``delta_i = sum_c dout_ic * out_ic - dlse_i`` per query row, one tile contributes::

    dv_tile += p^T @ dout                    [Hkv, tk, Dv]   (sums the G query heads of a KV head)
    dp       = dout @ v_tile^T               [Hkv, G*tq, tk]
    ds       = p * (dp - delta)              gradient of the modified scores
    ds       = ds * d score_mod               by autograd on the tile, only with score_mod
    dbias   += ds                            only for a bias that requires grad (a relative bias's
                                             table: scattered into each pair's bucket)
    ds      *= 1 - tanh(raw / cap)^2         only with softcap

With dropout, ``out = (p * keep / (1 - p_drop)) @ v``: the pattern is regenerated from its seed, ``dv`` uses the
dropped weights and ``dp`` is multiplied by the same ``keep / (1 - p_drop)`` (delta = rowsum(dout * out) as is).
    dq_tile += ds @ k_tile * scale
    dk_tile += ds^T @ (q * scale)

Memory stays linear in T: only one tile of scores lives at a time. Rows that saw nothing have lse
``-inf``; using ``+inf`` there makes every p exactly 0, so their gradients are 0, never NaN. NaN/inf
in K or V: masked entries change no gradient; a loss that depends on a NaN output gets NaN gradients.
"""

from __future__ import annotations

import torch

from engine.inputs import AttentionInputs
from engine.kernels.common import NEG_INF, compute_dtype, fold_groups, head_mask
from engine.kernels.nonfinite import guard_non_finite
from engine.kernels.scores import (
    add_bias_grad,
    additive_block,
    apply_score_mod,
    dropout_tile,
    score_mod_backward,
    tile_view,
)
from engine.kernels.tiles import batch_query_tiles
from engine.kernels.visibility import visibility_mask

BLOCK_Q = 128  # queries per tile (times every head of the KV group): the tiled kernel's forward and backward
BLOCK_K = 256  # keys per tile


def tiled_backward(inputs: AttentionInputs, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor | None,
                   grad_lse: torch.Tensor | None, block_q: int = BLOCK_Q, block_k: int = BLOCK_K):
    """Gradients ``(dq, dk, dv)`` in the dtypes of q, k, v from ``out [B, Hq, T, Dv]`` and ``lse [B, Hq, T]``."""
    q, k, v = inputs.q, inputs.k, inputs.v
    batch, q_heads, t, d = q.shape
    kv_heads, s = k.shape[1], k.shape[2]
    compute = compute_dtype(q.dtype)
    kc, vc = k.to(compute), v.to(compute)
    guard = guard_non_finite(kc, vc)
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    if guard is not None:  # differentiate the problem with bad K/V entries zeroed (masked ones change nothing)
        kc, vc = guard.k, guard.v
        poisoned = torch.isnan(out)  # outputs that saw a bad key or value
        if bool((grad_out[poisoned] != 0).any()):  # the loss depends on a NaN output: its gradient is NaN
            return tuple(torch.full_like(x, float("nan")) for x in (q, k, v))
        out = out.masked_fill(poisoned, 0.0)  # their upstream gradient is 0: they contribute nothing
    delta = (grad_out.to(compute) * out.to(compute)).sum(dim=-1)  # [B, Hq, T]
    if grad_lse is not None:
        delta = delta - grad_lse.to(compute)  # d lse / d s = p folds into the same formula
    lse_use = lse.to(compute).masked_fill(lse == NEG_INF, float("inf"))  # empty rows: p = exp(s - inf) = 0
    dq = torch.zeros(q.shape, dtype=compute, device=q.device)  # [B, Hq, T, D]
    dk = torch.zeros(kc.shape, dtype=compute, device=q.device)  # [B, Hkv, S, D]
    dv = torch.zeros(vc.shape, dtype=compute, device=q.device)  # [B, Hkv, S, Dv]
    mask = visibility_mask(inputs)
    mods = inputs.modifiers
    learned = mods.bias_tensor()  # a dense bias or a relative bias's table: its gradient, if it requires grad
    grad_bias = None  # [B|1, Hq|1, T|1, S|1] or [Hq, num_buckets]
    if learned is not None and learned.requires_grad:
        grad_bias = torch.zeros(learned.shape, dtype=compute, device=q.device)
    for b, i0, i1, tiles in batch_query_tiles(mask, batch, t, s, block_q, block_k):
        if not tiles:
            continue
        rows = (q_heads // kv_heads) * (i1 - i0)
        q_rows = fold_groups(q[b, :, i0:i1].to(compute) * inputs.scale, kv_heads)  # [Hkv, G*tq, D]
        do_rows = fold_groups(grad_out[b, :, i0:i1].to(compute).contiguous(), kv_heads)  # [Hkv, G*tq, Dv]
        lse_rows = lse_use[b, :, i0:i1].reshape(kv_heads, rows, 1)  # [Hkv, G*tq, 1]
        delta_rows = delta[b, :, i0:i1].reshape(kv_heads, rows, 1)  # [Hkv, G*tq, 1]
        dq_rows = torch.zeros_like(q_rows)  # [Hkv, G*tq, D]
        for j0, j1, full in tiles:
            k_tile, v_tile = kc[b, :, j0:j1], vc[b, :, j0:j1]  # [Hkv, tk, D], [Hkv, tk, Dv]
            scores, capped, before_mod = _tile_scores(inputs, q_rows, k_tile, b, i0, i1, j0, j1)
            visible = None
            if not full:
                visible = head_mask(mask.block(b, i0, i1, j0, j1), kv_heads, q_heads)
                scores.view(kv_heads, q_heads // kv_heads, i1 - i0, j1 - j0).masked_fill_(~visible, NEG_INF)
            p = (scores - lse_rows).exp_()  # [Hkv, G*tq, tk], the softmax weights (before dropout)
            dp = torch.bmm(do_rows, v_tile.transpose(1, 2))  # [Hkv, G*tq, tk], d loss / d (dropped weights)
            if mods.dropout_p > 0:  # the pattern again, from its seed: out = (p * keep) @ v
                keep = dropout_tile(inputs, kv_heads, rows, b, i0, i1, j0, j1, compute, q.device)
                dv[b, :, j0:j1] += torch.bmm((p * keep).transpose(1, 2), do_rows)  # [Hkv, tk, Dv]
                dp.mul_(keep)
            else:
                dv[b, :, j0:j1] += torch.bmm(p.transpose(1, 2), do_rows)  # [Hkv, tk, Dv]
            ds = dp.sub_(delta_rows).mul_(p)  # [Hkv, G*tq, tk], gradient of the modified scores
            if before_mod is not None:
                ds = score_mod_backward(inputs, tile_view(before_mod, i1 - i0), tile_view(ds, i1 - i0),
                                        slice(b, b + 1), i0, i1, j0, j1).reshape(kv_heads, rows, j1 - j0)
                if visible is not None:  # hidden keys have p = 0: no gradient, whatever score_mod's slope there
                    ds.view(kv_heads, q_heads // kv_heads, i1 - i0, j1 - j0).masked_fill_(~visible, 0.0)
            if grad_bias is not None:
                add_bias_grad(inputs, grad_bias, tile_view(ds, i1 - i0), b, i0, i1, j0, j1)
            if capped is not None:
                ds.mul_(1.0 - capped * capped)
            dq_rows.baddbmm_(ds, k_tile)  # [Hkv, G*tq, D]
            dk[b, :, j0:j1] += torch.bmm(ds.transpose(1, 2), q_rows)  # [Hkv, tk, D]
        dq[b, :, i0:i1] = (dq_rows * inputs.scale).view(q_heads, i1 - i0, d)
    if grad_bias is not None:
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), grad_bias.to(learned.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _tile_scores(inputs: AttentionInputs, q_rows: torch.Tensor, k_tile: torch.Tensor, b: int, i0: int, i1: int,
                 j0: int, j1: int):
    """A tile's scores as the forward made them, ``[Hkv, G*tq, tk]`` (a tensor of its own), with what their
    derivatives need: ``tanh(raw / cap)`` (softcap, else None) and the scores before score_mod (else None)."""
    scores = torch.bmm(q_rows, k_tile.transpose(1, 2))  # [Hkv, G*tq, tk]
    capped = before_mod = None
    if inputs.softcap is not None:
        capped = torch.tanh(scores / inputs.softcap)  # [Hkv, G*tq, tk]
        scores = capped * inputs.softcap
    if inputs.modifiers.additive():
        bias = additive_block(inputs, slice(b, b + 1), i0, i1, j0, j1, scores.dtype)  # [1, Hq|1, tq|1, tk|1]
        scores = (tile_view(scores, i1 - i0) + bias).reshape(scores.shape)  # [Hkv, G*tq, tk]
    if inputs.modifiers.score_mod is not None:
        before_mod = scores
        modded = apply_score_mod(inputs, tile_view(scores, i1 - i0), slice(b, b + 1), i0, i1, j0, j1)
        scores = modded.reshape(scores.shape)  # [Hkv, G*tq, tk], a new tensor
    return scores, capped, before_mod
