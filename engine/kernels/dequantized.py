"""Kernel ``dequantized``: attention over a quantized KV cache (``QuantizedKV`` k, v), the readable way.

The twin of ``decode_native`` for quantized K/V, and the kernel that runs every call the native one does
not fit (more than 16 queries, fp64 q, softcap, no compiler). Keys are taken ``CHUNK`` at a time,
dequantised (``data * scale``, engine.quantized), attended with dense scores under the visibility rule,
and each chunk merged into the running result by log-sum-exp, so memory stays ``O(T * n)`` per head, with
``n`` keys per chunk chosen so the scores of a chunk stay under ``SCORES_PER_CHUNK`` (prefill too)::

    for keys j0 .. j1 (CHUNK at a time):
        k, v = dequantize(chunk)                      [B, Hkv, n, D] -> GQA repeat -> [B, Hq, n, D]
        scores = q k^T * scale, masked                [B, Hq, T, n]
        out_c, lse_c = softmax(scores) v, logsumexp   [B, Hq, T, Dv], [B, Hq, T]
    out, lse = merge(out_c, lse_c over chunks)

NaN/inf (a quantized entry reads back as NaN when its token held one) follow the reference: a visible bad
key makes its row NaN with lse -inf, a visible bad value its channel; masked ones never leak.
"""

from __future__ import annotations

import torch

from engine.inputs import AttentionInputs
from engine.kernels.common import NEG_INF, DoesNotFit, compute_dtype, needs_grad
from engine.kernels.merge import merge_attention_states
from engine.kernels.visibility import visibility_mask
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
    batch, q_heads, t, _ = q.shape
    s, group = inputs.k.shape[2], q_heads // inputs.k.shape[1]
    compute = compute_dtype(q.dtype)
    mask = visibility_mask(inputs)
    chunk = max(64, min(CHUNK, SCORES_PER_CHUNK // max(1, batch * q_heads * t)))
    out = lse = None
    row_bad = torch.zeros(batch, q_heads, t, dtype=torch.bool, device=q.device)  # [B, Hq, T]
    for j0 in range(0, s, chunk):
        j1 = min(s, j0 + chunk)
        k = inputs.k.keys(j0, j1).dequantize(compute).repeat_interleave(group, dim=1)  # [B, Hq, n, D]
        v = inputs.v.keys(j0, j1).dequantize(compute).repeat_interleave(group, dim=1)  # [B, Hq, n, Dv]
        visible = _visible(mask, batch, t, j0, j1, q.device)  # [B|1, Hq|1, T, n]
        part, part_lse, bad = _attend(q.to(compute), k, v, visible, inputs)
        out, lse = (part, part_lse) if out is None else merge_attention_states([out, part], [lse, part_lse])
        row_bad |= bad
    out = out.masked_fill(row_bad[..., None], float("nan"))  # a visible non-finite key: row NaN, lse -inf
    lse = lse.masked_fill(row_bad, NEG_INF)
    return out.to(q.dtype), (lse if return_lse else None)


def _visible(mask, batch: int, t: int, j0: int, j1: int, device) -> torch.Tensor:
    """Bool ``[B|1, Hq|1, T, n]``: which of keys j0 .. j1-1 each query sees."""
    if mask is None:
        return torch.ones(1, 1, t, j1 - j0, dtype=torch.bool, device=device)
    blocks = []
    for b in range(batch if mask.batched() else 1):
        block = mask.block(b, 0, t, j0, j1)  # [T, n] or [Hq|1, T|1, n|1]
        block = block.reshape((1,) * (3 - block.dim()) + tuple(block.shape))  # [Hq|1, T|1, n|1]
        blocks.append(block.expand(block.shape[0], t, j1 - j0))
    return torch.stack(blocks)  # [B|1, Hq|1, T, n]


def _attend(q, k, v, visible, inputs: AttentionInputs):
    """One chunk: ``(out [B, Hq, T, Dv], lse [B, Hq, T], rows that see a non-finite key [B, Hq, T])``."""
    key_bad = ~torch.isfinite(k).all(dim=-1)  # [B, Hq, n]
    value_bad = ~torch.isfinite(v)  # [B, Hq, n, Dv]
    k = torch.where(key_bad[..., None], 0.0, k)
    v = torch.where(value_bad, 0.0, v)
    scores = (q @ k.transpose(-2, -1)) * inputs.scale  # [B, Hq, T, n]
    if inputs.softcap is not None:
        scores = inputs.softcap * torch.tanh(scores / inputs.softcap)
    scores = scores.masked_fill(~visible, NEG_INF)
    bad = (key_bad[:, :, None, :] & visible).any(dim=-1)  # [B, Hq, T]
    scores = scores.masked_fill(key_bad[:, :, None, :], NEG_INF)
    row_max = scores.amax(dim=-1, keepdim=True)  # [B, Hq, T, 1]
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    weights = torch.exp(scores - row_max)  # [B, Hq, T, n]; masked entries are exactly 0
    denom = weights.sum(dim=-1, keepdim=True)  # [B, Hq, T, 1]
    out = (weights @ v) / torch.where(denom > 0, denom, 1.0)  # [B, Hq, T, Dv]
    reached = (visible.to(q.dtype) @ value_bad.to(q.dtype)) > 0  # [B, Hq, T, Dv]: a visible bad value
    out = out.masked_fill(reached, float("nan"))
    lse = torch.where(denom[..., 0] > 0, row_max[..., 0] + torch.log(denom[..., 0]), NEG_INF)  # [B, Hq, T]
    return out, lse, bad
