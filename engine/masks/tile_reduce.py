"""Per-tile reductions of per-token values: the building block of every mask family's tile bounds."""

from __future__ import annotations

import math

import torch


def tile_reduce(x: torch.Tensor, tile: int, op: str, dim: int = 0) -> torch.Tensor:
    """Reduce axis ``dim`` of x over consecutive tiles of ``tile`` entries (min/max/any/all).

    ``[L] -> [ceil(L / tile)]``; along ``dim`` of a 2-D tensor the other axis is kept.
    """
    x = x.movedim(dim, 0)
    length = x.shape[0]
    n = math.ceil(length / tile)
    pad = n * tile - length
    if pad:  # repeating the last entry leaves every reduction unchanged
        x = torch.cat([x, x[-1:].expand(pad, *x.shape[1:])])
    x = x.reshape(n, tile, *x.shape[1:])  # [n, tile, ...]
    reduced = {"min": x.amin, "max": x.amax, "any": x.any, "all": x.all}[op](dim=1)  # [n, ...]
    return reduced.movedim(0, dim)
