"""Causal: key j visible to query i iff ``key_positions[j] <= query_positions[i]``."""

from __future__ import annotations

import torch

from engine.masks.pairwise import PairwiseMask


class CausalMask(PairwiseMask):
    """``key_pos <= query_pos``. Per tile: some key is visible if the smallest key is at or before the latest
    query; every key is if the largest key is at or before the earliest query."""

    name = "causal"

    def relate(self, q, k):
        return k <= q

    def bounds(self, q_lo, q_hi, k_lo, k_hi):
        return k_lo <= q_hi, k_hi <= q_lo


def causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor) -> CausalMask:
    """Bool ``[T, S]`` (or ``[B, 1, T, S]`` for per-row positions): the position rule, spelled out.

    Example: query positions ``[2, 3]`` against keys ``[0, 1, 2, 3]``::

        [[T, T, T, F],
         [T, T, T, T]]

    Returned as a StructuredMask (kernels skip tiles from position ranges; it compares equal to the
    dense tensor and materialises wherever a tensor is needed).
    """
    return CausalMask(query_positions, key_positions)
