"""Composed masks: ``a & b``, ``a | b`` and ``~a`` keep their structure, so kernels still skip tiles.

Per tile, ``&`` is empty if any part is empty and full if every part is full; ``|`` the other way round;
``~`` swaps empty and full. Each stays exact tile by tile through ``block``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.masks.structured import StructuredMask


class _Combined(StructuredMask):
    """Parts joined by one elementwise operator (``&`` or ``|``); nested joins of the same kind flatten."""

    symbol = ""

    @staticmethod
    def op(a, b):
        raise NotImplementedError

    def __init__(self, parts: Sequence[StructuredMask]) -> None:
        flat: list[StructuredMask] = []
        for part in parts:
            flat += part.parts if isinstance(part, type(self)) else [part]
        self.parts = flat
        super().__init__(torch.broadcast_shapes(*(p.shape for p in flat)), flat[0].device)

    def _fold(self, get):
        out = get(self.parts[0])
        for part in self.parts[1:]:
            out = self.op(out, get(part))
        return out

    def to_dense(self) -> torch.Tensor:
        return self._fold(lambda p: p.to_dense())

    def batched(self) -> bool:
        return any(p.batched() for p in self.parts)

    def block(self, b, i0, i1, j0, j1):
        return self._fold(lambda p: p.block(b, i0, i1, j0, j1))

    def tile_bounds(self, b, block_q, block_k, t, s):
        # "some visible" and "every visible" per tile combine with the same operator as the masks.
        bounds = [p.tile_bounds(b, block_q, block_k, t, s) for p in self.parts]
        some, every = bounds[0]
        for p_some, p_every in bounds[1:]:
            some, every = self.op(some, p_some), self.op(every, p_every)
        return some, every

    def _describe(self) -> str:
        return f" {self.symbol} ".join(repr(p) for p in self.parts)


class AllOf(_Combined):
    """``parts[0] & parts[1] & ...``: a tile is empty if any part's is, full if every part's is."""

    symbol = "&"

    @staticmethod
    def op(a, b):
        return a & b


class AnyOf(_Combined):
    """``parts[0] | parts[1] | ...``: a tile is full if any part's is, empty if every part's is."""

    symbol = "|"

    @staticmethod
    def op(a, b):
        return a | b


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
