"""The tiled online-softmax kernel: query tiles x key tiles, never the ``[T, S]`` score matrix.

For one query tile (``block_q`` queries of every head) the kernel walks the key tiles its plan keeps and
updates, per query row (the loop of FlashAttention)::

    s     = q_tile @ k_tile^T * scale             scores of this tile      [Hkv, G*tq, tk]
    m_new = max(m_i, rowmax(s))                    running max
    p     = exp(s - m_new)                         this tile's weights, not yet normalised
    alpha = exp(m_i - m_new)                       rescales what was summed under the old max
    l_i   = l_i * alpha + rowsum(p)                running sum of weights
    acc   = acc * alpha + p @ v_tile               running weighted sum of values
    ...
    out = acc / l_i,   lse = m_i + log(l_i)        (rows that saw nothing: out 0, lse -inf)

Everything above runs in fp32 (fp64 for fp64 inputs); memory is ``O(tile)`` beyond q, k, v and out.
Empty tiles (from positions, windows, documents, padding) are skipped without reading their K/V;
full tiles need no mask; partial tiles are masked exactly. Score modifiers (ALiBi, bias, score_mod,
dropout: engine.modifiers) are computed per tile from positions by engine.kernels.scores: this is their
readable general path. Gradients come from ``tiled_backward``, which recomputes each tile's weights from
the saved log-sum-exp (and the dropout pattern from its seed).
"""

from __future__ import annotations

import torch

from engine.inputs import AttentionInputs
from engine.kernels.common import NEG_INF, compute_dtype, differentiable, fold_groups, head_mask
from engine.kernels.nonfinite import all_finite, guard_non_finite
from engine.kernels.overflow import with_headroom
from engine.kernels.scores import dropout_tile, modified_tile
from engine.kernels.tiled.backward import BLOCK_K, BLOCK_Q, tiled_backward
from engine.kernels.tiles import batch_query_tiles
from engine.kernels.visibility import visibility_mask
from engine.shared_rows import shares_rows

FEW_QUERIES = 16  # T <= this (decode shapes): one query tile against long key tiles
FEW_QUERIES_BLOCK_K = 2048


def tiled_attention(inputs: AttentionInputs, return_lse: bool = False, block_q: int | None = None,
                    block_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kernel ``"tiled"``: ``(out [B, Hq, T, Dv] in q's dtype, lse [B, Hq, T] in the compute dtype or None)``.

    Tiles default to ``BLOCK_Q x BLOCK_K``; a decode shape (T <= FEW_QUERIES) runs as one query tile against
    ``FEW_QUERIES_BLOCK_K``-key tiles, so each K/V tile is read once for every query of its KV head.
    """
    t = inputs.q.shape[2]
    block_q = block_q or (max(t, 1) if t <= FEW_QUERIES else BLOCK_Q)
    block_k = block_k or (FEW_QUERIES_BLOCK_K if t <= FEW_QUERIES else BLOCK_K)

    def forward(x):
        out, lse = tiled_forward(x, block_q, block_k)
        return out, lse, out

    def backward(x, out, lse, grad_out, grad_lse):  # by tiles again, weights recomputed from the saved lse
        return tiled_backward(x, out, lse, grad_out, grad_lse, block_q, block_k)

    out, lse = differentiable(inputs, forward, backward)
    return out, (lse if return_lse else None)


def tiled_forward(inputs: AttentionInputs, block_q: int = BLOCK_Q, block_k: int = BLOCK_K):
    """``(out [B, Hq, T, Dv] in q's dtype, lse [B, Hq, T] in the compute dtype)`` by tiles."""
    q, k, v = inputs.q, inputs.k, inputs.v
    batch, q_heads, t, _ = q.shape
    kv_heads, s, dv = k.shape[1], k.shape[2], v.shape[3]
    compute = compute_dtype(q.dtype)
    kc = k.to(compute)  # [B, Hkv, S, D]; no copy when already compute
    vc = kc[..., :dv] if shares_rows(k, v) else v.to(compute)  # [B, Hkv, S, Dv]: V's rows are K's (converted once)
    guard = guard_non_finite(kc, vc)
    if guard is not None:
        kc, vc = guard.k, guard.v
    mask = visibility_mask(inputs)

    def by_tiles(x: AttentionInputs, with_lse: bool):  # x.v: vc, or vc with room for its sums (overflow)
        out = torch.zeros(batch, q_heads, t, dv, dtype=q.dtype, device=q.device)  # rows left alone stay 0
        lse = torch.full((batch, q_heads, t), NEG_INF, dtype=compute, device=q.device)
        for b, i0, i1, tiles in batch_query_tiles(mask, batch, t, s, block_q, block_k):
            if not tiles:
                continue  # no visible key: out 0, lse -inf
            q_rows = fold_groups(q[b, :, i0:i1].to(compute) * inputs.scale, kv_heads)  # [Hkv, G*tq, D]
            o, part_lse = _query_tile(inputs, q_rows, kc[b], x.v[b], tiles, mask, b, i0, i1, guard)
            out[b, :, i0:i1] = o.view(q_heads, i1 - i0, dv).to(q.dtype)
            lse[b, :, i0:i1] = part_lse.view(q_heads, i1 - i0)
        return out, lse

    values = inputs.with_tensors(v=vc)
    out, lse = by_tiles(values, True)
    if not all_finite(out):  # NaN from q or a visible bad entry, or sums that overflowed: only the last reruns
        out, lse = with_headroom(values, True, by_tiles)
    return out, lse


def tile_scores(q_rows: torch.Tensor, k_tile: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Scaled (and soft-capped) scores ``[Hkv, G*tq, tk]`` of one tile; q_rows is already scaled."""
    scores = torch.bmm(q_rows, k_tile.transpose(1, 2))  # [Hkv, G*tq, tk]
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)  # softcap * tanh(s / softcap)
    return scores


def _query_tile(inputs, q_rows, k_b, v_b, tiles, mask, b, i0, i1, guard):
    """Online softmax over the key tiles of one query tile: ``(out [Hkv, G*tq, Dv], lse [Hkv, G*tq, 1])``."""
    kv_heads, rows, _ = q_rows.shape
    q_heads, tq = rows // (i1 - i0) * kv_heads, i1 - i0
    mods = inputs.modifiers
    changes_scores = mods.additive() or mods.score_mod is not None
    m_i = q_rows.new_full((kv_heads, rows, 1), NEG_INF)  # running max
    l_i = q_rows.new_zeros((kv_heads, rows, 1))  # running sum of exp(s - m_i)
    acc = q_rows.new_zeros((kv_heads, rows, v_b.shape[-1]))  # running sum of exp(s - m_i) * v
    reached = None  # visible non-finite values per (row, channel), only when V has some
    for j0, j1, full in tiles:
        s = tile_scores(q_rows, k_b[:, j0:j1], inputs.softcap)  # [Hkv, G*tq, tk]
        if changes_scores:
            s = modified_tile(inputs, s, b, i0, i1, j0, j1)  # [Hkv, G*tq, tk]
        if guard is not None and guard.key_bad is not None:
            s.masked_fill_(guard.key_bad[b][:, None, j0:j1], float("nan"))  # visible bad keys poison the row
        visible = None
        if not full:
            visible = head_mask(mask.block(b, i0, i1, j0, j1), kv_heads, q_heads)  # [.., tq, tk]
            s.view(kv_heads, q_heads // kv_heads, tq, j1 - j0).masked_fill_(~visible, NEG_INF)
        m_new = torch.maximum(m_i, s.amax(dim=-1, keepdim=True))  # [Hkv, G*tq, 1]
        m_use = m_new.masked_fill(m_new == NEG_INF, 0.0)  # rows that saw nothing yet: exp(-inf - 0) = 0
        p = s.sub_(m_use).exp_()  # [Hkv, G*tq, tk], masked entries exactly 0
        alpha = torch.exp(m_i - m_use)  # [Hkv, G*tq, 1]
        l_i.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))  # the lse is of the weights before dropout
        if mods.dropout_p > 0:
            p = p * dropout_tile(inputs, kv_heads, rows, b, i0, i1, j0, j1, p.dtype, p.device)
        acc.mul_(alpha).baddbmm_(p, v_b[:, j0:j1])  # [Hkv, G*tq, Dv]
        m_i = m_new
        if guard is not None and guard.value_bad is not None:
            hit = _bad_values_reached(guard.value_bad[b, :, j0:j1], visible, kv_heads, rows, tq, p.dtype)
            reached = hit if reached is None else reached + hit
    seen = l_i > 0
    out = acc / torch.where(seen, l_i, 1.0)  # [Hkv, G*tq, Dv]
    lse = torch.where(seen, m_i + torch.log(l_i), NEG_INF)  # [Hkv, G*tq, 1]
    if reached is not None:
        out = out.masked_fill(reached > 0, float("nan"))
    return out, lse


def _bad_values_reached(value_bad, visible, kv_heads, rows, tq, dtype):
    """How many visible non-finite values reach each (row, channel): ``[Hkv, G*tq|1, Dv]``."""
    bad = value_bad.to(dtype)  # [Hkv, tk, Dv]
    if visible is None:
        return bad.sum(dim=1, keepdim=True)  # [Hkv, 1, Dv]: every row sees every key of a full tile
    vis = visible.expand(kv_heads, rows // tq, tq, bad.shape[1]).reshape(kv_heads, rows, -1).to(dtype)
    return torch.bmm(vis, bad)  # [Hkv, G*tq, Dv]
