"""Kernel ``decode``: a few queries against a long KV cache, reading each K/V byte once.

Decode is a matrix-vector product against the whole cache, so its cost is the bytes of K and V. Two
layout choices keep those bytes read once:

1. The G query heads of a KV head are stacked as G * T query *rows* of that one head (GQA without
   copies), so the fused kernel reads each KV head once for its whole group, not G times::

       q [B, Hq, T, D] -> view [B, Hkv, G*T, D]      rows g*T + i = query i of head kv_head*G + g

2. Split-KV: when B * Hkv is too small to keep every core busy, the keys are cut into ``n`` equal
   chunks that become the "heads" of one call, with batch and KV heads as its batch (a free view of the
   cache, no copy, also of a strided ``KVCache.view()`` slice), and the ``n`` partial results are merged
   by log-sum-exp::

       k [B, Hkv, S, D] -> view [B*Hkv, n, S/n, D];   q rows repeated per chunk;   merge over n

Masks (positions, windows, padding) enter as an additive mask over the rows, and so do ALiBi and biases
(their values where visible); key chunks that no row sees are cut off. Inputs the fused op cannot take
exactly (softcap, score_mod, Dv != D), gradients and more than ``MAX_QUERIES`` queries do not fit: dispatch
runs the next kernel (the ``tiled`` kernel takes few queries as one query tile against long key tiles, which
shares K/V across the group too). Readable twin: ``tiled``.
"""

from __future__ import annotations

import torch

from engine.inputs import AttentionInputs
from engine.kernels.common import (
    MAX_DECODE_QUERIES,
    NEG_INF,
    DoesNotFit,
    compute_dtype,
    fold_groups,
    needs_grad,
    unfold_groups,
)
from engine.kernels.merge import merge_attention_states
from engine.kernels.nonfinite import run_guarded
from engine.kernels.scores import additive_block
from engine.kernels.sdpa.fused_op import flash_call, flash_fits, flash_operands
from engine.kernels.visibility import decode_rows

MAX_QUERIES = MAX_DECODE_QUERIES  # (engine.kernels.common: one limit for every decode path)
MIN_KEYS = 512  # ... against at least this many cached keys
BUSY_ITEMS = 16  # split keys until B * Hkv * n reaches this many independent work items
MIN_SPLIT_KEYS = 2048  # never split the keys into chunks shorter than this


def decode_fits(inputs: AttentionInputs) -> str | None:
    """Why the decode kernel cannot compute these inputs exactly (None: it can)."""
    t = inputs.q.shape[2]
    if t > MAX_QUERIES:
        return f"T = {t} queries: decode serves T <= {MAX_QUERIES}"
    if needs_grad(inputs.q, inputs.k, inputs.v):
        return "gradients are needed: training runs the tiled kernels"
    return flash_fits(inputs)


def decode_pays_off(inputs: AttentionInputs) -> str | None:
    """Why ``auto`` would not pick decode for inputs it fits (None: it pays off)."""
    s = inputs.k.shape[2]
    return None if s >= MIN_KEYS else f"S = {s} keys: decode pays off from S >= {MIN_KEYS}"


def decode_attention(inputs: AttentionInputs, return_lse: bool = False):
    """Kernel ``"decode"``: ``(out [B, Hq, T, Dv] in q's dtype, lse [B, Hq, T] in the compute dtype or None)``."""
    why_not = decode_fits(inputs)
    if why_not is not None:
        raise DoesNotFit(why_not)
    return run_guarded(inputs, return_lse, _grouped_flash)


def _grouped_flash(inputs: AttentionInputs, return_lse: bool = True):
    q, k, v = flash_operands(inputs.q, inputs.k, inputs.v)  # views unless a last axis is strided
    batch, q_heads, t, d = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    compute = compute_dtype(q.dtype)
    j0, j1, visible = decode_rows(inputs)
    out = torch.zeros(batch, kv_heads, group * t, d, dtype=q.dtype)  # [B, Hkv, G*T, Dv]
    lse = torch.full((batch, kv_heads, group * t), NEG_INF, dtype=compute)  # [B, Hkv, G*T]
    if j1 > j0:
        # bf16/fp16 stay as they are: the fused kernel accumulates scores and sums in fp32 (converting the
        # cache to fp32 first would triple the bytes moved)
        q_rows = fold_groups(q, kv_heads)  # [B, Hkv, G*T, D]; a view when contiguous
        kc, vc = k[:, :, j0:j1], v[:, :, j0:j1]  # views
        additive = None
        if inputs.modifiers.additive():  # ALiBi / bias of the span, -inf where hidden, in the rows layout
            bias = additive_block(inputs, slice(0, batch), 0, t, j0, j1, compute)  # [B|1, Hq|1, T|1, n|1]
            bias = bias.expand(bias.shape[0], q_heads, t, j1 - j0).reshape(-1, kv_heads, group * t, j1 - j0)
            additive = bias if visible is None else torch.where(visible, bias, NEG_INF)  # [B|1, Hkv, G*T, n]
        out, lse = _split_kv(q_rows, kc, vc, visible, inputs.scale, additive)
    out = unfold_groups(out, q_heads).to(q.dtype)  # [B, Hq, T, Dv]
    return out, unfold_groups(lse, q_heads)


def _split_kv(q_rows, k, v, visible, scale, additive=None):
    """One fused call over ``n`` key chunks seen as heads, merged by lse: ``[B, Hkv, R, Dv]``, ``[B, Hkv, R]``.
    ``additive``: the additive mask of ALiBi / a bias ``[B|1, Hkv, R, S]`` (-inf where hidden), split alike."""
    batch, kv_heads, rows, d = q_rows.shape
    s = k.shape[2]
    n = 1
    while batch * kv_heads * n < BUSY_ITEMS and s % (2 * n) == 0 and s // (2 * n) >= MIN_SPLIT_KEYS:
        n *= 2
    compute = compute_dtype(q_rows.dtype)
    if n == 1 or not (_heads_fold(k) and _heads_fold(v)):
        o, lse = flash_call(q_rows, k, v, scale, visible=visible, bias=additive)
        return o, lse.to(compute)
    chunk = s // n
    k_split = k.flatten(0, 1).unflatten(1, (n, chunk))  # [B*Hkv, n, S/n, D]: a view, chunk c of (b, h) is head c
    v_split = v.flatten(0, 1).unflatten(1, (n, chunk))  # [B*Hkv, n, S/n, Dv]
    q_split = q_rows.reshape(batch * kv_heads, 1, rows, d).expand(-1, n, rows, d)  # [B*Hkv, n, R, D]
    visible_split = None
    if visible is not None:  # [B|1, Hkv|1, R, S] -> [B*Hkv|1, n, R, S/n]
        if visible.shape[0] > 1 or visible.shape[1] > 1:
            visible = visible.expand(batch, kv_heads, rows, s)
        visible_split = visible.flatten(0, 1).unflatten(2, (n, chunk)).transpose(1, 2)
    additive_split = None
    if additive is not None:  # [B|1, Hkv, R, S] -> [B*Hkv|Hkv, n, R, S/n]
        additive = additive.expand(batch, kv_heads, rows, s)
        additive_split = additive.flatten(0, 1).unflatten(2, (n, chunk)).transpose(1, 2)
    o, part_lse = flash_call(q_split, k_split, v_split, scale, visible=visible_split,
                             bias=additive_split)  # [B*Hkv, n, R, *]
    part_lse = part_lse.to(compute)
    o = o.view(batch, kv_heads, n, rows, -1)  # [B, Hkv, n, R, Dv]
    part_lse = part_lse.expand(batch * kv_heads, n, rows).reshape(batch, kv_heads, n, rows)  # [B, Hkv, n, R]
    return merge_attention_states(list(o.unbind(2)), list(part_lse.unbind(2)))


def _heads_fold(x: torch.Tensor) -> bool:
    """True when ``x [B, Hkv, S, E]`` folds to ``[B*Hkv, S, E]`` as a view (no copy of the cache): a contiguous
    tensor, or a slice ``[:, :, :L]`` of a longer KV-cache buffer."""
    return x.shape[0] == 1 or x.shape[1] == 1 or x.stride(0) == x.shape[1] * x.stride(1)
