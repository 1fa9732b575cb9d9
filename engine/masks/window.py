"""Sliding window: each query sees only the last ``window`` keys, its own position included.

Convention (stated once): with window w, query at position p sees key positions ``p-w+1 .. p``, that is
exactly w keys when they all exist. ``window=1`` sees only itself; ``window >= p+1`` is plain causal.

    window = 3, positions 0..5 (rows = queries):
        1 . . . . .
        1 1 . . . .
        1 1 1 . . .
        . 1 1 1 . .
        . . 1 1 1 .
        . . . 1 1 1
"""

from __future__ import annotations

import torch

from engine.masks._shape import pairwise
from engine.masks.pairwise import PairwiseMask


def window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> PairwiseMask:
    """Bool ``[T, S]`` (``[B, 1, T, S]`` for per-row positions): ``p - window < key_pos <= p``.

    A StructuredMask: kernels skip the key tiles outside the band, so a window costs O(T * window).
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int (number of keys seen, own included), got {window!r}")
    pairwise(query_positions, key_positions, "window_mask")  # validates shapes
    return PairwiseMask("window", query_positions, key_positions, window=window)
