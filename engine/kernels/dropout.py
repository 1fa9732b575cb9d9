"""Attention dropout whose pattern is a function of (seed, batch row, head, query index, key index).

The weight of query ``i`` for key ``j`` in head ``h`` of batch row ``b`` is kept iff a 32-bit hash of
``(seed, b, h, i, j)`` is at least ``round(p * 2^32)``; kept weights are scaled by ``1 / (1 - p)``, so the
expected output is the output without dropout. Because the pattern is a pure function of indices:

- it is the same whatever the tiles (the tiled kernel, its backward and the reference agree exactly);
- the backward regenerates it from the seed instead of storing a ``[B, Hq, T, S]`` mask;
- the seed is drawn once per call from the caller's generator: the same generator state, the same pattern.

The hash is murmur3's 32-bit finaliser, chained over the five numbers (all in int64 holding 32-bit values,
so products wrap only above bit 63 and the low 32 bits stay exact).
"""

from __future__ import annotations

import math

import torch

_LOW = 0xFFFFFFFF


def _mix(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser: a bijection of 32-bit values that spreads every input bit over the output."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _LOW
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _LOW
    return h ^ (h >> 16)


def dropout_threshold(dropout_p: float) -> int:
    """A hash below this drops its weight: ``round(p * 2^32)`` (keep probability ``1 - p`` to within 2^-32)."""
    return min(math.floor(dropout_p * 2**32 + 0.5), 2**32)


def keep_scale(seed: int, dropout_p: float, batch: torch.Tensor, heads: torch.Tensor, query_index: torch.Tensor,
               key_index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``keep / (1 - p)`` broadcast over the index tensors (int64, e.g. ``[b,1,1,1]``, ``[1,Hq,1,1]``,
    ``[1,1,tq,1]``, ``[1,1,1,tk]``): 0 where dropped, ``1 / (1 - p)`` where kept, in ``dtype``."""
    h = _mix((batch ^ (seed & _LOW)) & _LOW)
    h = _mix(h ^ ((seed >> 32) & _LOW) ^ heads)
    h = _mix(h ^ (query_index & _LOW))
    h = _mix(_mix(h ^ (key_index & _LOW)) ^ 0x9E3779B9)  # [b, Hq, tq, tk]
    keep = h >= dropout_threshold(dropout_p)
    return keep.to(dtype) / (1.0 - dropout_p)
