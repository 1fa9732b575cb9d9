"""Shared shape handling: positions ``[T]``/``[S]`` give ``[T, S]``; ``[B, T]``/``[B, S]`` give ``[B, 1, T, S]``."""

from __future__ import annotations

import torch


def pairwise(query_values: torch.Tensor, key_values: torch.Tensor, name: str):
    """Return ``(qv[..., :, None], kv[..., None, :])`` broadcastable to ``[T, S]`` or ``[B, 1, T, S]``."""
    for label, x in (("query", query_values), ("key", key_values)):
        if not isinstance(x, torch.Tensor) or x.dim() not in (1, 2):
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: {label} values must be a tensor of shape [L] or [B, L], got {shape}")
    if query_values.dim() == 1 and key_values.dim() == 1:
        return query_values[:, None], key_values[None, :]  # [T, 1], [1, S]
    if query_values.dim() == 1:
        query_values = query_values.expand(key_values.shape[0], -1)
    if key_values.dim() == 1:
        key_values = key_values.expand(query_values.shape[0], -1)
    if query_values.shape[0] != key_values.shape[0]:
        raise ValueError(f"{name}: batch sizes differ: queries {tuple(query_values.shape)}, "
                         f"keys {tuple(key_values.shape)}")
    return query_values[:, None, :, None], key_values[:, None, None, :]  # [B, 1, T, 1], [B, 1, 1, S]
