"""Tile plans: which (query tile, key tile) pairs a kernel must compute, and which need a mask.

The visibility of a call is one structured mask (engine.kernels.visibility). Its per-tile bounds sort
every tile into one of three kinds::

    keys ->   tile 0    tile 1    tile 2          EMPTY    skipped: its K/V are never read
    q tile 0  PARTIAL   EMPTY     EMPTY           FULL     computed without a mask
    q tile 1  FULL      PARTIAL   EMPTY           PARTIAL  computed, then masked exactly by ``block``
    q tile 2  FULL      FULL      PARTIAL

so a sliding window or packed documents cost the visible tiles only, not ``T * S``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.masks.structured import StructuredMask

# The tile kinds, one vocabulary for every kernel. CAUSAL refines PARTIAL for the fused op: a square span whose
# mask is exactly the top-left triangle, which the op computes with its own ``is_causal`` (engine.kernels.sdpa.calls).
EMPTY, FULL, PARTIAL, CAUSAL = "empty", "full", "partial", "causal"
_KINDS = (EMPTY, FULL, PARTIAL)  # indexed by the codes plan_tiles computes: 0, 1, 2


@dataclass
class TilePlan:
    """Kinds of the tiles of one batch row: ``kinds[i][j]`` for query tile i and key tile j."""

    block_q: int
    block_k: int
    t: int
    s: int
    kinds: list[list[str]]  # EMPTY, FULL or PARTIAL

    def query_tiles(self):
        """Yield ``(i0, i1, [(j0, j1, full), ...])`` for every query tile, listing its non-empty key tiles."""
        for i, row in enumerate(self.kinds):
            i0 = i * self.block_q
            tiles = [(j * self.block_k, min((j + 1) * self.block_k, self.s), kind == FULL)
                     for j, kind in enumerate(row) if kind != EMPTY]
            yield i0, min(i0 + self.block_q, self.t), tiles

    def runs(self, tiles: list[tuple[int, int, bool]]) -> list[tuple[int, int, bool]]:
        """Merge consecutive key tiles of the same kind: ``[(j0, j1, full), ...]`` spans for one call each."""
        spans: list[tuple[int, int, bool]] = []
        for j0, j1, full in tiles:
            if spans and spans[-1][1] == j0 and spans[-1][2] == full:
                spans[-1] = (spans[-1][0], j1, full)
            else:
                spans.append((j0, j1, full))
        return spans


def plan_tiles(mask: StructuredMask | None, b: int, t: int, s: int, block_q: int, block_k: int) -> TilePlan:
    """Sort the tiles of batch row b into EMPTY / FULL / PARTIAL from the mask's per-tile bounds."""
    nq, nk = -(-t // block_q), -(-s // block_k)
    if mask is None or t == 0 or s == 0:
        return TilePlan(block_q, block_k, t, s, [[FULL if s and t else EMPTY] * nk for _ in range(nq)])
    some, every = mask.tile_bounds(b, block_q, block_k, t, s)  # [nq, nk] each
    codes = torch.where(every, 1, torch.where(some, 2, 0)).to(torch.int8)  # indexes of _KINDS
    return TilePlan(block_q, block_k, t, s, [[_KINDS[code] for code in row] for row in codes.tolist()])


def batch_query_tiles(mask: StructuredMask | None, batch: int, t: int, s: int, block_q: int, block_k: int):
    """Yield ``(b, i0, i1, tiles)`` for every batch row and query tile; the plan is made once when the mask
    is the same for every row, once per row otherwise."""
    plan = None
    for b in range(batch):
        if plan is None or (mask is not None and mask.batched()):
            plan = plan_tiles(mask, b, t, s, block_q, block_k)
        for i0, i1, tiles in plan.query_tiles():
            yield b, i0, i1, tiles
