"""RMSNorm, the normalisation of Llama-family decoders and of MLA's latent vectors (engine.latent).

    rms_norm(x) = x / sqrt(mean(x^2) + eps) * weight          per row of the last axis

computed in fp32 (fp64 for fp64 input) and cast back to x's dtype before the weight, as the checkpoints expect.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``[..., E] -> [..., E]``; ``weight`` ``[E]`` starts at ones (the name checkpoints use)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)  # [..., E]
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
