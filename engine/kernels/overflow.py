"""Values near the top of the float range: room in the accumulator, by exact power-of-two scaling.

The fused and tiled kernels sum ``p * v`` with weights ``p = exp(s - max) <= 1`` and divide by the weights'
sum at the end, so their accumulator reaches up to ``S * max|v|`` while the output, a convex combination of V's
rows, stays within ``max|v|``. With fp32 values near 1e38 that sum overflows (inf, or NaN where +inf meets
-inf) although the answer is representable. A kernel whose output is non-finite from finite inputs runs once
more on V with each channel that lacks room scaled down by a power of two (exact: only exponents change), and
its output is scaled back::

    600 keys, equal weights, v[:, c] = 1e38  ->  acc 6e40 = inf;   v[:, c] * 2^-10  ->  acc 5.9e37,
                                                                   out[c] = 5.9e37 / 600 * 2^10 = 1e38

The lse does not depend on V, so it is the same in both runs. Entries of a scaled channel below 2^-126 * 2^e
(far under the channel's maximum) lose bits as subnormals; nothing else changes.
"""

from __future__ import annotations

import torch

from engine.inputs import AttentionInputs
from engine.kernels.common import compute_dtype


def value_headroom(v: torch.Tensor, keys: int) -> torch.Tensor | None:
    """Powers of two ``[Dv]`` in v's dtype such that ``keys * max|v[..., c] * factor[c]|`` stays within half the
    compute dtype's range; None when every channel has that room already (an overflow had another cause)."""
    if v.numel() == 0:
        return None
    top = torch.finfo(compute_dtype(v.dtype)).max
    largest = v.detach().abs().amax(dim=tuple(range(v.dim() - 1))).double()  # [Dv]
    shift = torch.ceil(torch.log2(largest * (2.0 * max(keys, 1)) / top)).clamp(min=0.0)  # [Dv] (NaN/inf -> inf)
    shift = shift.nan_to_num(0.0, posinf=0.0)  # a non-finite channel is the NaN guard's, not ours
    if not bool((shift > 0).any()):
        return None
    return torch.exp2(-shift).to(v.dtype)  # [Dv]


def with_headroom(inputs: AttentionInputs, return_lse: bool, run):
    """``run(inputs, return_lse) -> (out, lse)`` on V scaled by ``value_headroom`` and its output scaled back, or
    as it is when V has room (the caller found a non-finite output from finite q, K and V)."""
    factor = value_headroom(inputs.v, inputs.k.shape[2])
    if factor is None:
        return run(inputs, return_lse)
    out, lse = run(inputs.with_tensors(v=inputs.v * factor), return_lse)
    return out / factor.to(out.dtype), lse  # [B, Hq, T, Dv]: exact, |out| <= max|v|
