"""NaN/inf in K or V: masked ones never leak, visible ones poison exactly what the reference poisons.

Semantics (the reference kernel's, stated once):
    a *visible* non-finite key makes its query row NaN (and that row's lse -inf, as the reference's);
    a *visible* non-finite value makes the output NaN in that value's channels;
    masked ones change nothing: ``p = 0`` must never meet ``v = NaN`` (``0 * NaN = NaN``).

The fused kernels get K/V with the bad entries zeroed (so every masked product is ``0 * 0``, and rows
that see no bad entry come out bit-for-bit as with clean inputs), then ``poison`` marks the rows and
channels that do see one, tile by tile from the same visibility mask.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from engine.inputs import AttentionInputs
from engine.kernels.common import NEG_INF, DoesNotFit, compute_dtype, head_mask, needs_grad
from engine.kernels.overflow import with_headroom
from engine.kernels.tiles import plan_tiles
from engine.kernels.visibility import visibility_mask

POISON_BLOCK_Q, POISON_BLOCK_K = 256, 256


@dataclass
class NonFinite:
    """Where K and V hold NaN/inf, and K/V with those entries zeroed."""

    key_bad: torch.Tensor | None  # [B, Hkv, S] keys whose vector holds NaN/inf
    value_bad: torch.Tensor | None  # [B, Hkv, S, Dv] non-finite value entries
    k: torch.Tensor  # [B, Hkv, S, D] with bad keys zeroed
    v: torch.Tensor  # [B, Hkv, S, Dv] with bad entries zeroed


def all_finite(*tensors: torch.Tensor) -> bool:
    """True when no tensor holds NaN/inf: one read-only pass each (min and max are finite exactly when every
    entry is: NaN propagates, inf is the max or min), no temporary the size of the tensor."""
    for x in tensors:
        for block in contiguous_blocks(x.detach()):
            low, high = torch.aminmax(block)
            if not bool(torch.isfinite(high - low)):  # NaN/inf in either; an overflow only costs the slow path
                if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
                    return False
    return True


MAX_BLOCKS = 4096


def contiguous_blocks(x: torch.Tensor) -> list[torch.Tensor]:
    """``x`` as contiguous views, so reductions over it take their fast path (a strided reduction is ~10x
    slower). Transposed layouts (transformers' ``[B, T, H, D]`` seen as ``[B, H, T, D]``) are one block, permuted
    back; a KV-cache slice ``[B, Hkv, L, D]`` of a ``capacity``-long buffer is ``B * Hkv`` blocks of
    ``[L, D]``; a tensor that splits into no contiguous blocks (or too many) is one block as it is."""
    if x.numel() == 0:
        return []
    if x.is_contiguous():
        return [x]
    by_stride = x.permute(sorted(range(x.dim()), key=lambda axis: -x.stride(axis)))  # e.g. [B, T, H, D] transposed
    if by_stride.is_contiguous():  # a permutation of contiguous memory: one block (a reduction ignores the order)
        return [by_stride]
    for lead in range(1, x.dim()):
        count = math.prod(x.shape[:lead])
        if count > MAX_BLOCKS:
            break
        if x[(0,) * lead].is_contiguous():
            return [x[index] for index in itertools.product(*(range(n) for n in x.shape[:lead]))]
    return [x]


def guard_non_finite(k: torch.Tensor, v: torch.Tensor) -> NonFinite | None:
    """None when K and V are all finite (the fast path); otherwise zeroed copies and where they were bad."""
    if all_finite(k, v):
        return None
    k_ok, v_ok = bool(torch.isfinite(k).all()), bool(torch.isfinite(v).all())
    if k_ok and v_ok:
        return None
    key_bad = None if k_ok else ~torch.isfinite(k).all(dim=-1)  # [B, Hkv, S]
    value_bad = None if v_ok else ~torch.isfinite(v)  # [B, Hkv, S, Dv]
    k = k if key_bad is None else torch.where(key_bad[..., None], 0.0, k)
    v = v if value_bad is None else torch.where(value_bad, 0.0, v)
    return NonFinite(key_bad, value_bad, k, v)


def sanitized(inputs: AttentionInputs) -> tuple[AttentionInputs, NonFinite | None]:
    """Inputs with bad K/V entries zeroed, and the guard to ``poison`` the outputs afterwards."""
    guard = guard_non_finite(inputs.k, inputs.v)
    if guard is None:
        return inputs, None
    return inputs.with_tensors(k=guard.k, v=guard.v), guard


def poison(inputs: AttentionInputs, guard: NonFinite, out: torch.Tensor, lse: torch.Tensor | None):
    """Mark the outputs that see a bad key (row NaN, lse -inf) or a bad value (channel NaN)."""
    batch, q_heads, t, _ = inputs.q.shape
    kv_heads, s = inputs.k.shape[1], inputs.k.shape[2]
    compute = compute_dtype(out.dtype)
    bad_columns = torch.zeros(batch, s, dtype=torch.bool, device=out.device)  # [B, S] keys holding a bad entry
    if guard.key_bad is not None:
        bad_columns |= guard.key_bad.any(dim=1)
    if guard.value_bad is not None:
        bad_columns |= guard.value_bad.any(dim=-1).any(dim=1)
    mask = visibility_mask(inputs)
    out, lse = out.clone(), None if lse is None else lse.clone()
    for b in range(batch):
        if not bool(bad_columns[b].any()):
            continue
        plan = plan_tiles(mask, b, t, s, POISON_BLOCK_Q, POISON_BLOCK_K)
        for i0, i1, tiles in plan.query_tiles():
            rows = (q_heads // kv_heads) * (i1 - i0)
            hit_key = torch.zeros(kv_heads, rows, 1, dtype=compute, device=out.device)  # [Hkv, G*tq, 1]
            hit_value = torch.zeros(kv_heads, rows, out.shape[-1], dtype=compute, device=out.device)  # [Hkv, G*tq, Dv]
            for j0, j1, full in tiles:
                if not bool(bad_columns[b, j0:j1].any()):
                    continue
                visible = torch.ones(i1 - i0, j1 - j0, dtype=torch.bool, device=out.device)
                if not full:
                    visible = head_mask(mask.block(b, i0, i1, j0, j1), kv_heads, q_heads)
                visible = visible.expand(kv_heads, q_heads // kv_heads, i1 - i0, j1 - j0)
                visible = visible.reshape(kv_heads, rows, j1 - j0).to(compute)  # [Hkv, G*tq, tk]
                if guard.key_bad is not None:
                    hit_key += torch.bmm(visible, guard.key_bad[b, :, j0:j1, None].to(compute))
                if guard.value_bad is not None:
                    hit_value += torch.bmm(visible, guard.value_bad[b, :, j0:j1].to(compute))
            row_hit = (hit_key > 0).reshape(q_heads, i1 - i0)  # [Hq, tq]
            channel_hit = (hit_value > 0).reshape(q_heads, i1 - i0, -1) | row_hit[..., None]  # [Hq, tq, Dv]
            out[b, :, i0:i1] = out[b, :, i0:i1].masked_fill(channel_hit, float("nan"))
            if lse is not None:
                lse[b, :, i0:i1] = lse[b, :, i0:i1].masked_fill(row_hit, NEG_INF)
    return out, lse


def run_guarded(inputs: AttentionInputs, return_lse: bool, fast):
    """Run ``fast(inputs, return_lse) -> (out, lse)`` with the NaN/inf semantics above.

    Finite K goes straight through, and a finite output proves q and V were finite wherever the kernel
    looked (a NaN/inf value meets ``p = 0`` or ``p > 0``: both give NaN/inf), so only K, whose bad entries
    could hide behind a ``-inf`` score, is checked up front. Otherwise the exact path: NaN/inf in K or V
    are zeroed, the kernel runs, the outputs are poisoned. A non-finite output from finite inputs is an
    overflow of the kernel's sums (V near the float max): it runs again with room (engine.kernels.overflow).
    NaN/inf in q, or in K/V when gradients are needed, do not fit a fused kernel: ``DoesNotFit`` sends
    dispatch straight to the ``tiled`` kernel, which handles both inline.
    """
    q, k, v = inputs.q, inputs.k, inputs.v
    if all_finite(k):  # NaN/inf in q or V always shows in the output (0 * NaN is NaN): check it there
        out, lse = fast(inputs, return_lse)
        if all_finite(out):
            return out, lse
    clean, guard = sanitized(inputs)
    if not all_finite(q):
        raise DoesNotFit("NaN/inf in q: only the tiled kernel keeps it to the rows it belongs to", resume="tiled")
    if guard is not None and needs_grad(q, k, v):
        raise DoesNotFit("NaN/inf in K/V with gradients: only the tiled kernel differentiates around them",
                         resume="tiled")
    if guard is None:  # finite q, K and V, yet a non-finite output: the sums overflowed (V near the float max)
        return with_headroom(inputs, return_lse, fast)
    out, lse = fast(clean, True)
    if not all_finite(out):
        out, lse = with_headroom(clean, True, fast)
    out, lse = poison(inputs, guard, out, lse)
    return out, (lse if return_lse else None)
