"""The score modifiers of one block of scores, computed from positions (engine.modifiers states their order).

A block is batch rows ``rows`` x queries ``i0:i1`` x keys ``j0:j1``; every function here takes the same five
numbers, so the dense reference (one block: everything), the tiled kernel (one tile) and the fused calls of
``sdpa_tiles`` (one span) compute identical values. Positions, not indices, drive ALiBi and the relative
bias, so chunked prefill, decode and ragged rows need no offset arithmetic::

    chunked prefill, queries at 40..47 against keys 0..47: ALiBi of query 41, key 39 = -slope * 2, in any
    tile, whatever the chunk.

Layouts: blocks are ``[b, Hq, tq, tk]``; the tiled kernels hold a tile as ``[Hkv, G*tq, tk]`` rows
(engine.kernels.common) and view it as ``[1, Hq, tq, tk]`` (query head h = kv_head * G + g) to use these.
"""

from __future__ import annotations

import torch

from engine.inputs import AttentionInputs
from engine.kernels.common import NEG_INF
from engine.kernels.dropout import keep_scale
from engine.relative_bias import RelativePositionBias


def _positions(inputs: AttentionInputs, rows: slice, i0: int, i1: int, j0: int, j1: int):
    return inputs.query_positions[rows, i0:i1], inputs.key_positions[rows, j0:j1]  # [b, tq], [b, tk]


def additive_block(inputs: AttentionInputs, rows: slice, i0: int, i1: int, j0: int, j1: int, dtype: torch.dtype,
                   visible: torch.Tensor | None = None) -> torch.Tensor | None:
    """ALiBi plus bias of the block, ``[b|1, Hq|1, tq|1, tk|1]`` in ``dtype``; None when the call has neither.

    With ``visible`` (bool, broadcastable to ``[b|1, Hq|1, tq, tk]``) the hidden entries are -inf: the fused op's
    additive mask. The -inf goes in before a part grows to ``Hq`` heads where it can (ALiBi with positive slopes:
    ``slope * -inf``; the relative bias: a bucket that reads -inf), so the block is written once, not three times.
    """
    mods = inputs.modifiers
    query_pos, key_pos = _positions(inputs, rows, i0, i1, j0, j1)  # [b, tq], [b, tk]
    parts, masked = [], visible is None
    if mods.alibi_slopes is not None:
        slopes = mods.alibi_slopes if mods.alibi_slopes.shape[0] == 1 else mods.alibi_slopes[rows]  # [b|1, Hq]
        slopes = slopes.to(dtype)[:, :, None, None]  # [b|1, Hq, 1, 1]
        minus_distance = -(key_pos[:, None, None, :] - query_pos[:, None, :, None]).abs().to(dtype)  # [b, 1, tq, tk]
        if not masked and bool((slopes > 0).all()):
            minus_distance = minus_distance.masked_fill(~visible, NEG_INF)  # [b, 1|Hq, tq, tk]
            masked = True
        parts.append(slopes * minus_distance)  # [b, Hq, tq, tk]
    bias = mods.bias
    if isinstance(bias, RelativePositionBias):
        shared = not masked and visible.shape[1] == 1  # one mask for every head: hidden keys read a -inf bucket
        parts.append(bias.block(query_pos, key_pos, visible[:, 0] if shared else None).to(dtype))  # [b, Hq, tq, tk]
        masked = masked or shared
    elif bias is not None:  # [B|1, Hq|1, T|1, S|1]
        parts.append(bias[_block_index(bias.shape, rows, i0, i1, j0, j1)].to(dtype))  # [b|1, Hq|1, tq|1, tk|1]
    if not parts:
        return None
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total if masked else torch.where(visible, total, NEG_INF)


def _block_index(shape: torch.Size, rows: slice, i0: int, i1: int, j0: int, j1: int) -> tuple[slice, ...]:
    """The block of a tensor ``[B|1, Hq|1, T|1, S|1]``: each axis of size 1 broadcasts, so it is taken whole."""
    whole = slice(None)
    return (rows if shape[0] > 1 else whole, whole, slice(i0, i1) if shape[2] > 1 else whole,
            slice(j0, j1) if shape[3] > 1 else whole)


def apply_score_mod(inputs: AttentionInputs, scores: torch.Tensor, rows: slice, i0: int, i1: int, j0: int,
                    j1: int) -> torch.Tensor:
    """``score_mod(scores, batch, head, query_pos, key_pos)`` on a block ``[b, Hq, tq, tk]``, the index tensors
    shaped ``[b,1,1,1]``, ``[1,Hq,1,1]``, ``[b,1,tq,1]``, ``[b,1,1,tk]`` (int64); returns ``[b, Hq, tq, tk]``."""
    query_pos, key_pos = _positions(inputs, rows, i0, i1, j0, j1)
    batch = torch.arange(rows.start, rows.stop, device=scores.device)[:, None, None, None]  # [b, 1, 1, 1]
    heads = torch.arange(scores.shape[1], device=scores.device)[None, :, None, None]  # [1, Hq, 1, 1]
    out = inputs.modifiers.score_mod(scores, batch, heads, query_pos[:, None, :, None], key_pos[:, None, None, :])
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        raise ValueError(f"score_mod must return a float tensor of the scores' shape {list(scores.shape)}, "
                         f"got {type(out).__name__ if not isinstance(out, torch.Tensor) else out.dtype}")
    try:  # a fresh tensor: kernels write into it, and score_mod may return its input or a tensor of its own
        return torch.empty_like(scores).copy_(out.expand(scores.shape))  # [b, Hq, tq, tk]
    except RuntimeError:
        raise ValueError(f"score_mod must return a tensor broadcastable to the scores' shape "
                         f"{list(scores.shape)}, got {list(out.shape)}") from None


def modify_scores(inputs: AttentionInputs, scores: torch.Tensor, rows: slice, i0: int, i1: int, j0: int,
                  j1: int) -> torch.Tensor:
    """The block's scores (after scale and softcap) with ALiBi, bias and score_mod applied: ``[b, Hq, tq, tk]``."""
    additive = additive_block(inputs, rows, i0, i1, j0, j1, scores.dtype)
    if additive is not None:
        scores = scores + additive  # [b, Hq, tq, tk]
    if inputs.modifiers.score_mod is not None:
        scores = apply_score_mod(inputs, scores, rows, i0, i1, j0, j1)
    return scores


def score_mod_backward(inputs: AttentionInputs, before: torch.Tensor, grad_after: torch.Tensor, rows: slice,
                       i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
    """The gradient through score_mod of one block: ``grad_after`` (w.r.t. its output) times its derivative at
    ``before`` (its input), by autograd on the block alone (``[b, Hq, tq, tk]``)."""
    with torch.enable_grad():
        x = before.detach().requires_grad_()
        y = apply_score_mod(inputs, x, rows, i0, i1, j0, j1)
        (grad,) = torch.autograd.grad(y, x, grad_after, allow_unused=True)
    return torch.zeros_like(before) if grad is None else grad


def dropout_block(inputs: AttentionInputs, rows: slice, i0: int, i1: int, j0: int, j1: int, heads: int,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``keep / (1 - p)`` of the block, ``[b, Hq, tq, tk]`` (engine.kernels.dropout)."""
    mods = inputs.modifiers
    batch = torch.arange(rows.start, rows.stop, device=device)[:, None, None, None]  # [b, 1, 1, 1]
    head = torch.arange(heads, device=device)[None, :, None, None]  # [1, Hq, 1, 1]
    query = (torch.arange(i0, i1, device=device) if mods.dropout_query_index is None
             else mods.dropout_query_index[i0:i1].to(device))[None, None, :, None]  # [1, 1, tq, 1]
    key = (torch.arange(j0, j1, device=device) if mods.dropout_key_index is None
           else mods.dropout_key_index[j0:j1].to(device))[None, None, None, :]  # [1, 1, 1, tk]
    return keep_scale(mods.dropout_seed, mods.dropout_p, batch, head, query, key, dtype)


def add_bias_grad(inputs: AttentionInputs, grad_bias: torch.Tensor, grad_scores: torch.Tensor, b: int, i0: int,
                  i1: int, j0: int, j1: int) -> None:
    """Add a tile's score gradient ``[1, Hq, tq, tk]`` (batch row b) to the learned bias's gradient: a dense bias's
    ``[B|1, Hq|1, T|1, S|1]`` (summed over the axes it broadcasts along), or a RelativePositionBias table's
    ``[Hq, num_buckets]`` (scattered into the tile's buckets)."""
    bias = inputs.modifiers.bias
    if isinstance(bias, RelativePositionBias):
        bias.add_block_grad(grad_bias, grad_scores, *_positions(inputs, slice(b, b + 1), i0, i1, j0, j1))
        return
    dims = [axis for axis in (1, 2, 3) if grad_bias.shape[axis] == 1]
    part = grad_scores.sum(dim=dims, keepdim=True) if dims else grad_scores  # [1, Hq|1, tq|1, tk|1]
    grad_bias[_block_index(grad_bias.shape, slice(b, b + 1), i0, i1, j0, j1)] += part


def tile_view(rows_layout: torch.Tensor, tq: int) -> torch.Tensor:
    """``[Hkv, G*tq, tk] -> [1, Hq, tq, tk]`` (query head h = kv_head * G + g holds rows g * tq + i)."""
    kv_heads, rows, tk = rows_layout.shape
    return rows_layout.view(1, kv_heads * rows // tq, tq, tk)


def modified_tile(inputs: AttentionInputs, scores: torch.Tensor, b: int, i0: int, i1: int, j0: int,
                  j1: int) -> torch.Tensor:
    """A tile's scores in the rows layout ``[Hkv, G*tq, tk]`` with ALiBi, bias and score_mod applied."""
    block = modify_scores(inputs, tile_view(scores, i1 - i0), slice(b, b + 1), i0, i1, j0, j1)  # [1, Hq, tq, tk]
    return block.reshape(scores.shape)


def dropout_tile(inputs: AttentionInputs, kv_heads: int, rows: int, b: int, i0: int, i1: int, j0: int, j1: int,
                 dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``keep / (1 - p)`` of a tile in the rows layout ``[Hkv, G*tq, tk]``."""
    q_heads = kv_heads * rows // (i1 - i0)
    keep = dropout_block(inputs, slice(b, b + 1), i0, i1, j0, j1, q_heads, dtype, device)  # [1, Hq, tq, tk]
    return keep.reshape(kv_heads, rows, j1 - j0)
