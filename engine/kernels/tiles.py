"""Tile plans: which (query tile, key tile) pairs a kernel must compute, and which need a mask.

The visibility of a call is one structured mask, the position rule ``key_pos <= query_pos`` (when
causal) ``&`` the ``allowed`` mask. Its per-tile bounds sort every tile into one of three kinds::

    keys ->   tile 0    tile 1    tile 2          EMPTY    skipped: its K/V are never read
    q tile 0  PARTIAL   EMPTY     EMPTY           FULL     computed without a mask
    q tile 1  FULL      PARTIAL   EMPTY           PARTIAL  computed, then masked exactly by ``block``
    q tile 2  FULL      FULL      PARTIAL

so a sliding window or packed documents cost the visible tiles only, not ``T * S``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.dispatch import AttentionInputs
from engine.masks.combine import AllOf
from engine.masks.pairwise import PairwiseMask
from engine.masks.structured import StructuredMask, as_structured

EMPTY, FULL, PARTIAL = 0, 1, 2


def visibility_mask(inputs: AttentionInputs) -> StructuredMask | None:
    """The call's visibility as one structured mask (None: every key is visible to every query)."""
    parts: list[StructuredMask] = []
    if inputs.causal:
        parts.append(PairwiseMask("causal", inputs.query_positions, inputs.key_positions))  # [B, 1, T, S]
    if inputs.allowed is not None:
        parts.append(as_structured(inputs.allowed))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else AllOf(parts)


@dataclass
class TilePlan:
    """Kinds of the tiles of one batch row: ``kinds[i][j]`` for query tile i and key tile j."""

    block_q: int
    block_k: int
    t: int
    s: int
    kinds: list[list[int]]

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

    def counts(self) -> dict[str, int]:
        flat = [kind for row in self.kinds for kind in row]
        return {"empty": flat.count(EMPTY), "full": flat.count(FULL), "partial": flat.count(PARTIAL)}


def plan_tiles(mask: StructuredMask | None, b: int, t: int, s: int, block_q: int, block_k: int) -> TilePlan:
    """Sort the tiles of batch row b into EMPTY / FULL / PARTIAL from the mask's per-tile bounds."""
    nq, nk = -(-t // block_q), -(-s // block_k)
    if mask is None or t == 0 or s == 0:
        kinds = torch.full((nq, nk), FULL if s and t else EMPTY, dtype=torch.int8)
    else:
        some, every = mask.tile_bounds(b, block_q, block_k, t, s)  # [nq, nk] each
        kinds = torch.where(every, FULL, torch.where(some, PARTIAL, EMPTY)).to(torch.int8)
    return TilePlan(block_q, block_k, t, s, kinds.tolist())


def batch_query_tiles(mask: StructuredMask | None, batch: int, t: int, s: int, block_q: int, block_k: int):
    """Yield ``(b, i0, i1, tiles)`` for every batch row and query tile; the plan is made once when the mask
    is the same for every row, once per row otherwise."""
    plan = None
    for b in range(batch):
        if plan is None or (mask is not None and mask.batched()):
            plan = plan_tiles(mask, b, t, s, block_q, block_k)
        for i0, i1, tiles in plan.query_tiles():
            yield b, i0, i1, tiles
