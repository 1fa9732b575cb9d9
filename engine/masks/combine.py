"""Composed masks: ``a & b``, ``a | b`` and ``~a`` keep their structure, so kernels still skip tiles.

Per tile, ``&`` is empty if any part is empty and full if every part is full; ``|`` the other way round;
``~`` swaps empty and full. Each stays exact tile by tile through ``block``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.masks.structured import StructuredMask


class AllOf(StructuredMask):
    """``parts[0] & parts[1] & ...``: a tile is empty if any part's is, full if every part's is."""

    def __init__(self, parts: Sequence[StructuredMask]) -> None:
        flat: list[StructuredMask] = []
        for part in parts:
            flat += part.parts if isinstance(part, AllOf) else [part]
        self.parts = flat
        super().__init__(torch.broadcast_shapes(*(p.shape for p in flat)), flat[0].device)

    def to_dense(self) -> torch.Tensor:
        out = self.parts[0].to_dense()
        for part in self.parts[1:]:
            out = out & part.to_dense()
        return out

    def batched(self) -> bool:
        return any(p.batched() for p in self.parts)

    def block(self, b, i0, i1, j0, j1):
        out = self.parts[0].block(b, i0, i1, j0, j1)
        for part in self.parts[1:]:
            out = out & part.block(b, i0, i1, j0, j1)
        return out

    def tile_bounds(self, b, block_q, block_k, t, s):
        some, every = self.parts[0].tile_bounds(b, block_q, block_k, t, s)
        for part in self.parts[1:]:
            p_some, p_every = part.tile_bounds(b, block_q, block_k, t, s)
            some, every = some & p_some, every & p_every
        return some, every

    def _describe(self) -> str:
        return " & ".join(repr(p) for p in self.parts)


class AnyOf(StructuredMask):
    """``parts[0] | parts[1] | ...``: a tile is full if any part's is, empty if every part's is."""

    def __init__(self, parts: Sequence[StructuredMask]) -> None:
        flat: list[StructuredMask] = []
        for part in parts:
            flat += part.parts if isinstance(part, AnyOf) else [part]
        self.parts = flat
        super().__init__(torch.broadcast_shapes(*(p.shape for p in flat)), flat[0].device)

    def to_dense(self) -> torch.Tensor:
        out = self.parts[0].to_dense()
        for part in self.parts[1:]:
            out = out | part.to_dense()
        return out

    def batched(self) -> bool:
        return any(p.batched() for p in self.parts)

    def block(self, b, i0, i1, j0, j1):
        out = self.parts[0].block(b, i0, i1, j0, j1)
        for part in self.parts[1:]:
            out = out | part.block(b, i0, i1, j0, j1)
        return out

    def tile_bounds(self, b, block_q, block_k, t, s):
        some, every = self.parts[0].tile_bounds(b, block_q, block_k, t, s)
        for part in self.parts[1:]:
            p_some, p_every = part.tile_bounds(b, block_q, block_k, t, s)
            some, every = some | p_some, every | p_every
        return some, every

    def _describe(self) -> str:
        return " | ".join(repr(p) for p in self.parts)


class Not(StructuredMask):
    """``~part``: empty where the part is full, full where it is empty."""

    def __init__(self, part: StructuredMask) -> None:
        self.part = part
        super().__init__(part.shape, part.device)

    def to_dense(self) -> torch.Tensor:
        return ~self.part.to_dense()

    def batched(self) -> bool:
        return self.part.batched()

    def block(self, b, i0, i1, j0, j1):
        return ~self.part.block(b, i0, i1, j0, j1)

    def tile_bounds(self, b, block_q, block_k, t, s):
        some, every = self.part.tile_bounds(b, block_q, block_k, t, s)
        return ~every, ~some

    def _describe(self) -> str:
        return repr(self.part)
