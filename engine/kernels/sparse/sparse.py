"""Kernel ``"sparse"``: top-k sparse attention that reads only each query's listed keys, O(T·K·D).

A call whose mask holds a ``KeyIndexMask`` (``causal_attention(..., key_indices=...)``) lists K keys per query and
KV head. Every kernel computes it exactly through the mask (its tiles come from the indices); this one never builds
a ``[T, S]`` score or mask: a chunk of queries at a time, it gathers the listed rows of K and V, scores them, applies
the position rule on the gathered key positions (and any other part of the mask on the gathered columns), and takes
the softmax over the K entries::

    idx [B, Hkv, tc, K]  (sorted; -1 and repeats dropped)  ->  K_sel, V_sel [B, Hkv, tc, K, D]  (whole rows)
    scores [B, Hkv, G, tc, K] = q_group . K_sel * scale  (softcap),  -inf where not listed or hidden
    out = softmax(scores) . V_sel,  lse = logsumexp(scores)          (a row that sees nothing: 0, -inf)

Torch ops only, so autograd differentiates it (dK, dV scattered back by the gather's backward). NaN/inf as the
reference: a visible non-finite key makes its row NaN (lse -inf), a visible non-finite value its channel; a key that
is not listed, or hidden, is never read into a result. The readable twin is any kernel on the dense index mask.
"""

from __future__ import annotations

import torch

from engine.inputs import AttentionInputs
from engine.kernels.common import MAX_DECODE_QUERIES, compute_dtype
from engine.masks.key_indices import KeyIndexMask, split_listed
from engine.quantized import QuantizedKV
from engine.shared_rows import shares_rows

__all__ = ["sparse_attention", "sparse_fits", "sparse_pays_off", "listed_keys"]

GATHERED_NUMBERS = 1 << 22  # gathered K/V numbers per chunk of queries (16 MiB of fp32 each)


def listed_keys(inputs: AttentionInputs) -> tuple[KeyIndexMask | None, list]:
    """``(the call's KeyIndexMask or None, the other parts of its allowed mask)``."""
    return split_listed(inputs.allowed)


def sparse_fits(inputs: AttentionInputs) -> str | None:
    """Why the sparse kernel cannot compute these inputs (None: it can)."""
    listed, _ = listed_keys(inputs)
    if listed is None:
        return "no key_indices: a dense call"
    if isinstance(inputs.k, QuantizedKV):
        return "a quantized cache: the dequantized kernel reads it"
    return None


def sparse_pays_off(inputs: AttentionInputs) -> str | None:
    """Auto takes it where gathering the listed keys costs less than the dense kernels on the index mask: each
    query's K rows are gathered once per KV head and shared by its G query heads, against S keys at GEMM speed
    (measured on 2 Zen 4 cores, Hq 8-16, Hkv 1-8, D 64: a prefill's sparse ~ K (0.1 Hkv + 0.04 Hq), dense ~
    0.0036 S Hq, so sparse from S >= K (10 + 27 / G); a decode step's (T <= 16) dense kernel reads all S keys, so
    sparse from S >= 8 K; and S >= 512, ``bench sparse``)."""
    listed, _ = listed_keys(inputs)
    k, s, t = listed.indices.shape[3], inputs.k.shape[2], inputs.q.shape[2]
    group = inputs.q.shape[1] // inputs.k.shape[1]
    least = 8 * k if t <= MAX_DECODE_QUERIES else k * (10 + 27 / group)
    if s < 512 or s < least:
        return (f"K = {k} of S = {s} keys, {group} query heads per KV head, T = {t}: the dense kernels on the index "
                f"mask are faster (sparse from S >= {least:.0f}, S >= 512)")
    return None


def sparse_attention(inputs: AttentionInputs, return_lse: bool = False):
    """Kernel ``"sparse"``: ``(out [B, Hq, T, Dv] in q's dtype, lse [B, Hq, T] in the compute dtype or None)``."""
    q, k, v = inputs.q, inputs.k, inputs.v
    batch, q_heads, t, _ = q.shape
    kv_heads, dv = k.shape[1], v.shape[3]
    listed, others = listed_keys(inputs)
    top = listed.indices.shape[3]
    chunk = max(1, GATHERED_NUMBERS // max(1, batch * kv_heads * top * max(q.shape[3], dv)))
    compute = compute_dtype(q.dtype)
    outs, lses = [], []
    for i0 in range(0, t, chunk):
        out, lse = _chunk(inputs, k, v, listed, others, i0, min(t, i0 + chunk), compute)
        outs.append(out)
        lses.append(lse)
    out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs, 2), torch.cat(lses, 2))
    return out.to(q.dtype), (lse if return_lse else None)


def _chunk(inputs: AttentionInputs, k, v, listed: KeyIndexMask, others: list, i0: int, i1: int, compute):
    q = inputs.q
    batch, q_heads, _, d = q.shape
    kv_heads, s, dv = k.shape[1], k.shape[2], v.shape[3]
    group, tc = q_heads // kv_heads, i1 - i0
    idx = listed.indices[:, :, i0:i1].expand(batch, kv_heads, tc, -1)  # [B, Hkv, tc, K]
    idx, _ = idx.sort(dim=-1)
    repeat = torch.zeros_like(idx, dtype=torch.bool)
    repeat[..., 1:] = idx[..., 1:] == idx[..., :-1]
    valid = (idx >= 0) & ~repeat  # [B, Hkv, tc, K]
    safe = idx.clamp(min=0)
    if inputs.causal:  # the position rule on the gathered keys' positions
        key_pos = inputs.key_positions.gather(1, safe.reshape(batch, -1)).view(idx.shape)
        valid = valid & (key_pos <= inputs.query_positions[:, None, i0:i1, None])
    b_of = torch.arange(batch, device=safe.device).view(batch, 1, 1, 1)
    h_of = torch.arange(kv_heads, device=safe.device).view(1, kv_heads, 1, 1)
    # whole rows of the listed keys only, in the inputs' dtype and strides (no copy or conversion of all S keys)
    k_sel = k[b_of, h_of, safe].to(compute)  # [B, Hkv, tc, K, D]
    v_sel = k_sel[..., :dv] if shares_rows(k, v) else v[b_of, h_of, safe].to(compute)  # [B, Hkv, tc, K, Dv]
    visible = valid[:, :, None].expand(batch, kv_heads, group, tc, idx.shape[3])  # [B, Hkv, G, tc, K]
    for part in others:  # any other part of the mask, read on the gathered columns
        visible = visible & _gathered(part, safe, batch, kv_heads, group, i0, i1, s)
    q_g = q[:, :, i0:i1].to(compute).reshape(batch, kv_heads, group, tc, d)  # [B, Hkv, G, tc, D]
    scores = torch.einsum("bhgtd,bhtkd->bhgtk", q_g, k_sel) * inputs.scale  # [B, Hkv, G, tc, K]
    bad = ~torch.isfinite(scores)  # a non-finite key (before softcap, which would make inf finite)
    row_bad = (bad & visible).any(-1)  # [B, Hkv, G, tc]: it is visible: the row is NaN, as the reference's
    if inputs.softcap is not None:
        scores = inputs.softcap * torch.tanh(scores / inputs.softcap)
    scores = scores.masked_fill(~visible | bad, float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0).detach()
    p = torch.exp(scores - row_max)  # hidden entries exactly 0
    total = p.sum(-1, keepdim=True)  # [B, Hkv, G, tc, 1]
    channel_bad = None
    if not bool(torch.isfinite(v_sel.sum())):  # a gathered value is NaN/inf (or the sum overflowed): zero them,
        value_bad = ~torch.isfinite(v_sel)  # so a hidden one adds 0, and poison the channels a visible one reaches
        v_sel = torch.where(value_bad, 0.0, v_sel)
        channel_bad = (visible[..., None] & value_bad[:, :, None]).any(-2)  # [B, Hkv, G, tc, Dv]
    out = torch.einsum("bhgtk,bhtkd->bhgtd", p, v_sel) / torch.where(total > 0, total, 1.0)
    lse = torch.where(total[..., 0] > 0, row_max[..., 0] + torch.log(total[..., 0]), float("-inf"))
    if channel_bad is not None:
        out = out.masked_fill(channel_bad, float("nan"))
    out = out.masked_fill(row_bad[..., None], float("nan"))
    lse = lse.masked_fill(row_bad, float("-inf"))
    return out.reshape(batch, q_heads, tc, dv), lse.reshape(batch, q_heads, tc)


def _gathered(part, safe, batch: int, kv_heads: int, group: int, i0: int, i1: int, s: int) -> torch.Tensor:
    """bool ``[B, Hkv, G, tc, K]``: ``part``'s entries at the gathered columns (its block per batch row)."""
    q_heads, tc = kv_heads * group, i1 - i0
    rows = []
    for b in range(batch):
        block = part.block(b if part.batched() else 0, i0, i1, 0, s)
        block = block.reshape((1,) * (3 - block.dim()) + tuple(block.shape)).expand(q_heads, tc, s)  # [Hq, tc, S]
        columns = safe[b].repeat_interleave(group, dim=0)  # [Hq, tc, K]
        rows.append(block.gather(2, columns).view(kv_heads, group, tc, -1))
    return torch.stack(rows)
