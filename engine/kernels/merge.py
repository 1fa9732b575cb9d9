"""Merge attention results computed over disjoint key sets, exactly, by their log-sum-exp.

If part a attended over keys A and part b over keys B (A and B disjoint), then over A + B::

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

Example: keys split 3 + 2, lse_a = log 3 (three scores of 0), lse_b = log 1 (two scores, one of them
-inf): lse = log 4, weights 3/4 and 1/4. A part that saw no key (lse -inf) gets weight 0; if every part
is empty the merged row is 0 with lse -inf, never NaN. This is the basis of split-KV decoding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kernels.common import NEG_INF, compute_dtype


def merge_attention_states(outputs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine partial attention results over disjoint key sets.

    Args:
        outputs: partial outputs ``[..., T, Dv]`` (e.g. ``[B, Hq, T, Dv]``), one per key set, any float dtype.
        lses: their log-sum-exps ``[..., T]`` (base e, ``-inf`` where a part saw no key).

    Returns:
        ``(out [..., T, Dv] in the first output's dtype, lse [..., T])``; the merge runs in fp32 (fp64 for
        fp64 outputs) and the lse keeps that dtype, so merges chain without rounding.
    """
    if len(outputs) != len(lses) or not outputs:
        raise ValueError(f"need as many outputs as lses, at least one; got {len(outputs)} and {len(lses)}")
    for out, lse in zip(outputs, lses):
        if tuple(out.shape[:-1]) != tuple(lse.shape):
            raise ValueError(f"each lse must have its output's shape without the last axis, got output "
                             f"{tuple(out.shape)} and lse {tuple(lse.shape)}")
    ct = compute_dtype(outputs[0].dtype)
    lse_all = torch.stack([lse.to(ct) for lse in lses])  # [P, ..., T]
    top = lse_all.amax(dim=0)  # [..., T]
    top = top.masked_fill(top == NEG_INF, 0.0)  # every part empty: weights exp(-inf) = 0, no NaN
    weights = torch.exp(lse_all - top)  # [P, ..., T]
    total = weights.sum(dim=0)  # [..., T]
    merged = torch.zeros(outputs[0].shape, dtype=ct, device=outputs[0].device)
    for w, out in zip(weights, outputs):
        merged += w[..., None] * out.to(ct)  # an empty part (out 0, weight 0) adds exactly 0
    seen = total > 0
    merged = merged / torch.where(seen, total, 1.0)[..., None]
    lse = torch.where(seen, top + torch.log(total), NEG_INF)
    return merged.to(outputs[0].dtype), lse
