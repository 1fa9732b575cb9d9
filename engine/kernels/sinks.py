"""Attention sinks: one learned logit per query head, an extra term ``exp(sink[h])`` in every row's softmax
denominator that carries no value (gpt-oss). A step after the kernel, for every kernel:

    out' = out * exp(lse - lse'),   lse' = logaddexp(lse, sink)        (exp(lse - lse') = sigmoid(lse - sink))

The kernel's softmax is over the visible keys; adding the sink to the denominator rescales that row by the
share of the weight its keys keep. So sinks need only each row's lse, which every kernel returns; gradients
reach the sinks, and the kernel's out and lse, by autograd through these two lines. A row that sees no key
(lse -inf) keeps output 0; its lse' is the sink's (the sink is the one term of its denominator).

Example: lse = log 3 (three scores of 0), sink = 0: lse' = log 4, the output is scaled by 3/4.
"""

from __future__ import annotations

import torch

from engine.kernels.common import compute_dtype


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out' [B, Hq, T, Dv] in out's dtype, lse' [B, Hq, T] in lse's dtype)`` from a kernel's out and lse and
    ``sinks [Hq]``."""
    compute = compute_dtype(out.dtype)
    sink = sinks.to(compute)[None, :, None]  # [1, Hq, 1]
    lse_all = torch.logaddexp(lse.to(compute), sink)  # [B, Hq, T]
    kept = torch.exp(lse.to(compute) - lse_all)  # [B, Hq, T]; 0 for rows that see nothing
    return (out.to(compute) * kept[..., None]).to(out.dtype), lse_all.to(lse.dtype)
