"""Choose the kernel that runs a causal_attention call, and say why."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionInputs:
    """Validated arguments of causal_attention with defaults resolved.

    q ``[B, Hq, T, D]``, k ``[B, Hkv, S, D]``, v ``[B, Hkv, S, Dv]``; query_positions ``[B, T]`` and
    key_positions ``[B, S]`` (int64, possibly expanded views); allowed is None or a bool tensor
    broadcastable to ``[B, Hq, T, S]``.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    query_positions: torch.Tensor
    key_positions: torch.Tensor
    allowed: torch.Tensor | None
    scale: float
    causal: bool
    softcap: float | None


# A kernel: (inputs, return_lse) -> (out [B, Hq, T, Dv] in q's dtype, lse [B, Hq, T] fp32 or None)
Kernel = Callable[[AttentionInputs, bool], tuple[torch.Tensor, "torch.Tensor | None"]]


def _reference(inputs: AttentionInputs, return_lse: bool):
    from engine.kernels.reference import dense_attention

    return dense_attention(inputs, return_lse=return_lse)


# Every kernel by name; `causal_attention(..., kernel=name)` forces one.
KERNELS: dict[str, Kernel] = {"reference": _reference}


def select_kernel(inputs: AttentionInputs) -> tuple[str, str]:
    """Return ``(kernel name, reason)`` for inputs under ``kernel="auto"``."""
    return "reference", "the dense reference is the only kernel built so far"


def run_attention(inputs: AttentionInputs, kernel: str = "auto", return_lse: bool = False):
    """Run the chosen kernel; returns ``(out [B, Hq, T, Dv], lse [B, Hq, T] or None)``."""
    if kernel == "auto":
        kernel, _ = select_kernel(inputs)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be 'auto' or one of {sorted(KERNELS)}, got {kernel!r}")
    return KERNELS[kernel](inputs, return_lse)
