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

from engine.masks.pairwise import PairwiseMask

# q - k < window on int64: positions in [-2^62, 2^62) keep q - k exact.
POSITION_LIMIT = 1 << 62


class WindowMask(PairwiseMask):
    """``k <= q`` and ``q - k < window``. Per tile: some key may be visible if the tiles' position ranges come
    within the band; every key is if the whole key range lies in every query's band."""

    name = "window"

    def __init__(self, query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> None:
        check_window(window, optional=False)
        if window > POSITION_LIMIT:
            raise ValueError(f"window must be at most 2^62 = {POSITION_LIMIT} keys, got {window} "
                             f"(for an unbounded window use the causal rule alone)")
        super().__init__(query_positions, key_positions)
        for values in (self.query_values, self.key_values):
            _check_range(values)
        self.window = window

    def relate(self, q, k):
        return sees(q, k, self.window)

    def bounds(self, q_lo, q_hi, k_lo, k_hi):
        return range_sees(q_lo, q_hi, k_lo, k_hi, self.window)

    def _describe(self) -> str:
        return f"window={self.window}"


def sees(query_pos, key_pos, window):
    """The rule with a window, stated once (tensors broadcast; ints too): ``key_pos <= query_pos`` and, unless
    ``window`` is None, ``query_pos - key_pos < window``. Every path that applies a window calls this (the mask,
    the paged kernels' visibility, Flex's ``mask_mod``)."""
    visible = key_pos <= query_pos
    return visible if window is None else visible & (query_pos - key_pos < window)


def range_sees(q_lo, q_hi, k_lo, k_hi, window):
    """``(some, every)`` of ``sees`` over queries at ``q_lo .. q_hi`` and keys at ``k_lo .. k_hi`` (tensors that
    broadcast, or ints): some query may see some key / every query sees every key. Sound, exact for ranges."""
    some, every = k_lo <= q_hi, k_hi <= q_lo
    if window is not None:
        some, every = some & (q_lo - k_hi < window), every & (q_hi - k_lo < window)
    return some, every


def check_window(window, optional: bool = True) -> None:
    """The one check of a window argument: a positive int (keys a query sees, its own included), or None where
    ``optional``; a ValueError names what was given otherwise."""
    if window is None and optional:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int (keys seen, own included){' or None' if optional else ''}, "
                         f"got {window!r}")


def _check_range(positions: torch.Tensor) -> None:
    """Refuse positions so large that ``q - k`` could overflow int64."""
    if positions.numel() == 0:
        return
    low, high = (int(x) for x in torch.aminmax(positions))
    if low < -POSITION_LIMIT or high >= POSITION_LIMIT:
        raise ValueError(f"window masks need positions in [-2^62, 2^62) so that q - k cannot overflow int64, "
                         f"got positions from {low} to {high}")


def window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> WindowMask:
    """Bool ``[T, S]`` (``[B, 1, T, S]`` for per-row positions): ``p - window < key_pos <= p``.

    A StructuredMask: kernels skip the key tiles outside the band, so a window costs O(T * window).
    """
    return WindowMask(query_positions, key_positions, window)
