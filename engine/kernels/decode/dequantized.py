"""Kernel ``dequantized``: attention over a quantized KV cache (``QuantizedKV`` k, v), the readable way.

The twin of ``decode_native`` for quantized K/V, and the kernel that runs every call the native one does
not fit (more than 16 queries, fp64 q, softcap, no compiler). Keys are taken ``CHUNK`` at a time,
dequantised (``data * scale``, engine.quantized), attended with dense scores under the visibility rule,
and each chunk merged into the running result by log-sum-exp, so memory stays ``O(T * n)`` per head, with
``n`` keys per chunk chosen so the scores of a chunk stay under ``SCORES_PER_CHUNK`` (prefill too)::

    q [B, Hq, T, D] -> rows [B, Hkv, G*T, D]       (a KV head's group as rows: K/V read once, no GQA copy)
    for keys j0 .. j1 (CHUNK at a time):
        k, v = dequantize(chunk)                      [B, Hkv, n, D], [B, Hkv, n, Dv]
        scores = q_rows k^T * scale, masked           [B, Hkv, G*T, n]
        out_c, lse_c = softmax(scores) v, logsumexp   [B, Hkv, G*T, Dv], [B, Hkv, G*T]
    out, lse = merge(out_c, lse_c over chunks)        -> [B, Hq, T, Dv], [B, Hq, T]

NaN/inf (a quantized entry reads back as NaN when its token held one) follow the reference: a visible bad
key makes its row NaN with lse -inf, a visible bad value its channel; masked ones never leak.
"""

from __future__ import annotations

import torch

from engine.inputs import AttentionInputs
from engine.kernels.common import NEG_INF, DoesNotFit, compute_dtype, fold_groups, needs_grad, unfold_groups
from engine.kernels.merge import merge_attention_states
from engine.kernels.visibility import row_visibility, visibility_mask
from engine.quantized import QuantizedKV

CHUNK = 4096  # keys dequantised at a time (at most)
SCORES_PER_CHUNK = 1 << 22  # ... and at most this many scores [B, Hq, T, n] at a time (16 MiB in fp32)


def dequantized_fits(inputs: AttentionInputs) -> str | None:
    if not isinstance(inputs.k, QuantizedKV):
        return "k, v are tensors: this kernel reads QuantizedKV"
    if needs_grad(inputs.q):
        return "q needs gradients: this kernel has no backward (the reference differentiates through the cache)"
    return None


def dequantized_attention(inputs: AttentionInputs, return_lse: bool = False):
    """Kernel ``"dequantized"``: ``(out [B, Hq, T, Dv] in q's dtype, lse [B, Hq, T] or None)``."""
    why_not = dequantized_fits(inputs)
    if why_not is not None:
        raise DoesNotFit(why_not)
    q = inputs.q.detach()
    batch, q_heads, t, d = q.shape
    kv_heads, s = inputs.k.shape[1], inputs.k.shape[2]
    group, rows = q_heads // kv_heads, (q_heads // kv_heads) * t
    compute = compute_dtype(q.dtype)
    q_rows = fold_groups(q.to(compute), kv_heads)  # [B, Hkv, G*T, D]: each KV head's group as rows
    mask = visibility_mask(inputs)
    chunk = max(64, min(CHUNK, SCORES_PER_CHUNK // max(1, batch * q_heads * t)))
    out = lse = None
    row_bad = torch.zeros(batch, kv_heads, rows, dtype=torch.bool, device=q.device)  # [B, Hkv, G*T]
    for j0 in range(0, s, chunk):
        j1 = min(s, j0 + chunk)
        k = inputs.k.keys(j0, j1).dequantize(compute)  # [B, Hkv, n, D]: read once for the whole group
        v = inputs.v.keys(j0, j1).dequantize(compute)  # [B, Hkv, n, Dv]
        visible = (torch.ones(1, 1, rows, j1 - j0, dtype=torch.bool, device=q.device) if mask is None
                   else row_visibility(mask, batch, kv_heads, group, t, j0, j1))  # [B|1, Hkv|1, G*T, n]
        part, part_lse, bad = _attend(q_rows, k, v, visible, inputs)
        out, lse = (part, part_lse) if out is None else merge_attention_states([out, part], [lse, part_lse])
        row_bad |= bad
    out = out.masked_fill(row_bad[..., None], float("nan"))  # a visible non-finite key: row NaN, lse -inf
    lse = lse.masked_fill(row_bad, NEG_INF)
    out = unfold_groups(out, q_heads).to(q.dtype)  # [B, Hq, T, Dv]
    return out, (unfold_groups(lse, q_heads) if return_lse else None)


def _attend(q, k, v, visible, inputs: AttentionInputs):
    """One chunk, q ``[B, Hkv, R, D]`` against k/v ``[B, Hkv, n, *]``: ``(out [B, Hkv, R, Dv], lse [B, Hkv, R],
    rows that see a non-finite key [B, Hkv, R])``."""
    key_bad = ~torch.isfinite(k).all(dim=-1)  # [B, Hkv, n]
    value_bad = ~torch.isfinite(v)  # [B, Hkv, n, Dv]
    k = torch.where(key_bad[..., None], 0.0, k)
    v = torch.where(value_bad, 0.0, v)
    scores = (q @ k.transpose(-2, -1)) * inputs.scale  # [B, Hkv, R, n]
    if inputs.softcap is not None:
        scores = inputs.softcap * torch.tanh(scores / inputs.softcap)
    scores = scores.masked_fill(~visible, NEG_INF)
    bad = (key_bad[:, :, None, :] & visible).any(dim=-1)  # [B, Hkv, R]
    scores = scores.masked_fill(key_bad[:, :, None, :], NEG_INF)
    row_max = scores.amax(dim=-1, keepdim=True)  # [B, Hkv, R, 1]
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    weights = torch.exp(scores - row_max)  # [B, Hkv, R, n]; masked entries are exactly 0
    denom = weights.sum(dim=-1, keepdim=True)  # [B, Hkv, R, 1]
    out = (weights / torch.where(denom > 0, denom, 1.0)) @ v  # [B, Hkv, R, Dv]: normalised first, so the sum
    # stays within V's range (no overflow for values near the float max)
    reached = (visible.to(q.dtype) @ value_bad.to(q.dtype)) > 0  # [B, Hkv, R, Dv]: a visible bad value
    out = out.masked_fill(reached, float("nan"))
    lse = torch.where(denom[..., 0] > 0, row_max[..., 0] + torch.log(denom[..., 0]), NEG_INF)  # [B, Hkv, R]
    return out, lse, bad
