"""A float64 oracle for attention with score modifiers, written from the definitions (no engine code).

    s[b,h,i,j] = (q . k) * scale, softcap, + bias[b,h,i,j] - slope[b,h] * |kpos[b,j] - qpos[b,i]|,
                 score_mod(s, b, h, qpos, kpos)
    visible    = (kpos[b,j] <= qpos[b,i] if causal) and allowed[b,h,i,j]
    lse        = log(sum_visible exp(s) + exp(sink[h]))           (no sink: -inf for a row that sees nothing)
    out        = sum_visible exp(s - lse) * keep[b,h,i,j] * v       (keep: 1, or a dropout pattern / (1 - p))

Differentiable in every float input (q, k, v, bias, sinks) by autograd.
"""

from __future__ import annotations

import torch


def oracle(q, k, v, qpos=None, kpos=None, allowed=None, scale=None, causal=True, softcap=None, sinks=None,
           alibi=None, bias=None, score_mod=None, keep=None):
    """``(out [B, Hq, T, Dv], lse [B, Hq, T])`` in float64; qpos ``[B, T]``/``[T]``, kpos ``[B, S]``/``[S]``,
    alibi ``[Hq]``/``[B, Hq]``, bias a dense tensor broadcastable to ``[B, Hq, T, S]``."""
    b, hq, t, d = q.shape
    s = k.shape[2]
    group = hq // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    qpos = torch.arange(s - t, s) if qpos is None else qpos
    kpos = torch.arange(s) if kpos is None else kpos
    qpos, kpos = qpos.expand(b, t)[:, None, :, None], kpos.expand(b, s)[:, None, None, :]  # [B,1,T,1], [B,1,1,S]
    scale = d ** -0.5 if scale is None else scale
    scores = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.double()
    if alibi is not None:
        slopes = alibi.double().reshape(-1, hq)[:, :, None, None]  # [B|1, Hq, 1, 1]
        scores = scores - slopes * (kpos - qpos).abs().double()
    if score_mod is not None:
        batch = torch.arange(b)[:, None, None, None]
        heads = torch.arange(hq)[None, :, None, None]
        scores = score_mod(scores, batch, heads, qpos, kpos).expand(b, hq, t, s)
    visible = torch.ones(b, hq, t, s, dtype=torch.bool)
    if causal:
        visible = visible & (kpos <= qpos)
    if allowed is not None:
        visible = visible & torch.as_tensor(allowed.to_dense() if hasattr(allowed, "to_dense") else allowed)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_column = sinks.double()[None, :, None, None].expand(b, hq, t, 1)
        lse = torch.cat([scores, sink_column], dim=-1).logsumexp(dim=-1)  # [B, Hq, T]
    else:
        lse = scores.logsumexp(dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, 0.0)[..., None]
    weights = torch.exp(scores - safe)  # [B, Hq, T, S]; 0 where hidden
    if keep is not None:
        weights = weights * keep
    out = torch.einsum("bhij,bhjd->bhid", weights, v)  # [B, Hq, T, Dv]
    return out, lse

