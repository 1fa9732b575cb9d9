"""Kernel ``reference``: the attention chapter's PyTorch listing of ``causal_attention``, made safe for empty
rows and non-finite masked keys.

(``engine.reference``, a package of its own, holds the independent oracles: stdlib lists and loops.)

It materialises the ``[B, Hq, T, S]`` score matrix, so it is the oracle, not the fast path: the readable
twin of ``sdpa`` (one fused call) and the kernel every other one is tested against.
"""

from __future__ import annotations

import torch

from engine.inputs import AttentionInputs
from engine.kernels.common import compute_dtype
from engine.kernels.scores import dropout_block, modify_scores
from engine.kernels.visibility import dense_visibility
from engine.quantized import QuantizedKV


def reference_attention(inputs: AttentionInputs, return_lse: bool = False):
    """Materialise scores, mask before the softmax, return ``(out [B, Hq, T, Dv], lse [B, Hq, T])``."""
    q, k, v = inputs.q, inputs.k, inputs.v
    compute = compute_dtype(q.dtype)
    if isinstance(k, QuantizedKV):  # a quantized cache's oracle: attention over its dequantised entries
        k, v = k.dequantize(compute), v.dequantize(compute)  # [B, Hkv, S, D], [B, Hkv, S, Dv]
    group = q.shape[1] // k.shape[1]
    mask = dense_visibility(inputs)  # [B|1, Hq|1, T, S]
    kf, vf = k.to(compute), v.to(compute)
    key_bad = val_bad = None
    if not bool(torch.isfinite(kf).all()):
        key_bad = ~torch.isfinite(kf).all(-1)  # [B, Hkv, S] keys whose vector holds NaN/inf
        kf = torch.where(key_bad[..., None], 0.0, kf)
    if not bool(torch.isfinite(vf).all()):
        val_bad = ~torch.isfinite(vf)  # [B, Hkv, S, Dv]
        vf = torch.where(val_bad, 0.0, vf)
    if group > 1:  # query head h reads KV head h // G: [K0, K0, K1, K1] for G = 2
        kf = kf.repeat_interleave(group, dim=1)  # [B, Hq, S, D]
        vf = vf.repeat_interleave(group, dim=1)  # [B, Hq, S, Dv]
    scores = (q.to(compute) @ kf.transpose(-2, -1)) * inputs.scale  # [B, Hq, T, S]
    if inputs.softcap is not None:
        scores = inputs.softcap * torch.tanh(scores / inputs.softcap)
    everything = (slice(0, q.shape[0]), 0, q.shape[2], 0, k.shape[2])  # one block: every row, query and key
    scores = modify_scores(inputs, scores, *everything)  # ALiBi, bias, score_mod (engine.modifiers)
    if key_bad is not None:  # a *visible* non-finite key poisons its row, as it would without masking
        bad = key_bad.repeat_interleave(group, dim=1)[:, :, None, :] & mask  # [B, Hq, T, S]
        scores = torch.where(bad, float("nan"), scores)
    scores = scores.masked_fill(~mask, float("-inf"))  # [B, Hq, T, S]
    row_max = scores.amax(dim=-1, keepdim=True)  # [B, Hq, T, 1]
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0).detach()
    exp = torch.exp(scores - row_max)  # [B, Hq, T, S]; masked entries are exactly 0
    denom = exp.sum(dim=-1, keepdim=True)  # [B, Hq, T, 1]
    weights = exp / torch.where(denom > 0, denom, 1.0)  # empty rows stay 0, never 0/0
    if inputs.modifiers.dropout_p > 0:  # the lse is of the weights before dropout
        weights = weights * dropout_block(inputs, *everything, q.shape[1], compute, q.device)  # [B, Hq, T, S]
    out = weights @ vf  # [B, Hq, T, Dv]
    if val_bad is not None:  # visible non-finite values give non-finite outputs; masked ones do not leak
        bad_v = val_bad.repeat_interleave(group, dim=1).to(compute)  # [B, Hq, S, Dv]
        reached = (mask.to(compute) @ bad_v) > 0  # [B, Hq, T, Dv]
        out = torch.where(reached, float("nan"), out)
    lse = None
    if return_lse:
        lse = torch.where(denom[..., 0] > 0, row_max[..., 0] + torch.log(denom[..., 0]),
                          float("-inf"))  # [B, Hq, T] in the compute dtype
    return out.to(q.dtype), lse
