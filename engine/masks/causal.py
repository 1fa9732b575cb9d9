"""Causal: key j visible to query i iff ``key_positions[j] <= query_positions[i]``."""

from __future__ import annotations

import torch

from engine.masks._shape import pairwise
from engine.masks.pairwise import PairwiseMask


def causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor) -> PairwiseMask:
    """Bool ``[T, S]`` (or ``[B, 1, T, S]`` for per-row positions): the position rule, spelled out.

    Example: query positions ``[2, 3]`` against keys ``[0, 1, 2, 3]``::

        [[T, T, T, F],
         [T, T, T, T]]

    Returned as a StructuredMask (kernels skip tiles from position ranges; it compares equal to the
    dense tensor and materialises wherever a tensor is needed).
    """
    pairwise(query_positions, key_positions, "causal_mask")  # validates shapes
    return PairwiseMask("causal", query_positions, key_positions)
