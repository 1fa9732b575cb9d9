"""Tolerances derived from precision, not trial and error.

A kernel run in ``dtype`` is compared with a float64 oracle; its error may be at most twice the error of a
plain run done entirely in ``dtype`` (scores, softmax and the weighted sum all in that dtype), plus a
floor of a few units of ``dtype``'s epsilon for outputs where the plain run happens to be exact.
"""

from __future__ import annotations

import math

import torch


def plain_attention(q, k, v, mask, scale, dtype):
    """Naive attention done entirely in ``dtype``: q ``[B,Hq,T,D]``, k/v ``[B,Hkv,S,*]``, mask bool."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).to(dtype)  # [B, Hq, S, D]
    v = v.repeat_interleave(group, dim=1).to(dtype)  # [B, Hq, S, Dv]
    scores = (q.to(dtype) @ k.transpose(-2, -1)) * scale  # [B, Hq, T, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v  # [B, Hq, T, Dv]


def assert_within_precision(out: torch.Tensor, oracle: torch.Tensor, plain: torch.Tensor, dtype: torch.dtype) -> None:
    """``|out - oracle| <= 2 * |plain - oracle| + floor`` in the max norm (oracle is float64)."""
    assert out.shape == oracle.shape, (out.shape, oracle.shape)
    assert bool(torch.isfinite(out).all()), "output holds NaN/inf"
    err = (out.double() - oracle).abs().max().item() if out.numel() else 0.0
    plain_err = (plain.double() - oracle).abs().max().item() if out.numel() else 0.0
    scale = max(1.0, oracle.abs().max().item() if out.numel() else 1.0)
    floor = 4 * torch.finfo(dtype).eps * scale
    bound = 2 * plain_err + floor
    assert err <= bound, f"{dtype}: error {err:.3g} > 2 x plain {plain_err:.3g} + floor {floor:.3g}"
    assert math.isfinite(err)
