"""Structured masks: a bool mask kept as a predicate over per-token values, so kernels can skip tiles.

A mask helper (``window_mask``, ``document_mask``, ...) returns a ``StructuredMask``: a ``PairwiseMask``
(engine.masks.pairwise), ``AllOf`` / ``AnyOf`` / ``Not`` of masks, or a bool tensor wrapped as ``DenseMask``.
Wherever a bool tensor is expected it behaves as the dense ``[T, S]`` (or ``[B, 1, T, S]``) tensor it
describes: torch functions, indexing, ``torch.equal`` and ``==`` materialise it on demand, and ``&``, ``|``,
``~`` build a new structured mask (also with a plain bool tensor on either side). Kernels instead ask two cheap
questions that never read a dense ``[T, S]`` tensor:

    tile_bounds(b, block_q, block_k, T, S) -> (some [nq, nk], every [nq, nk])   one answer per tile
    block(b, i0, i1, j0, j1)               -> bool [tq, tk] (broadcastable to [Hq, tq, tk])

``some[i, j]`` False promises that tile (i, j) holds no True (the tile is skipped); ``every[i, j]``
True promises it holds no False (no mask is applied). Both are sound but may be conservative: an
unsure tile is "partial" and gets its exact mask from ``block``. Example, window 3 over positions 0..5
with 2 x 2 tiles (rows = query tiles, columns = key tiles)::

    1 . | . . | . .        tile (0, 0) partial   tile (0, 1) empty     tile (0, 2) empty
    1 1 | . . | . .
    ----+-----+----
    1 1 | 1 . | . .        tile (1, 0) partial   tile (1, 1) partial   tile (1, 2) empty
    . 1 | 1 1 | . .
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from engine.masks.tile_reduce import tile_reduce
from engine.shapes import broadcast_shape


class StructuredMask:
    """Base class: a bool mask broadcastable to ``[B, Hq, T, S]`` that kernels summarise per tile."""

    dtype = torch.bool

    def __init__(self, shape: Sequence[int], device: torch.device) -> None:
        self._shape = torch.Size(shape)
        self._device = torch.device(device)

    # --- what kernels use -------------------------------------------------------------------------
    def to_dense(self) -> torch.Tensor:
        """The bool tensor this mask stands for (shape ``self.shape``)."""
        raise NotImplementedError

    def block(self, b: int, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        """Exact bool mask of queries ``i0:i1`` x keys ``j0:j1`` of row b, broadcastable to ``[Hq, tq, tk]``."""
        raise NotImplementedError

    def tile_bounds(self, b: int, block_q: int, block_k: int, t: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(some, every)``, bool ``[ceil(T / block_q), ceil(S / block_k)]`` each, for batch row b."""
        raise NotImplementedError

    def batched(self) -> bool:
        """True when the mask differs between batch rows (kernels then plan each row apart)."""
        raise NotImplementedError

    # --- tensor-like surface ----------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def dim(self) -> int:
        return len(self._shape)

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self._shape if dim is None else self._shape[dim]

    def numel(self) -> int:
        return math.prod(self._shape)

    def __and__(self, other: Any) -> StructuredMask:
        return AllOf([self, as_structured(other)])

    def __rand__(self, other: Any) -> StructuredMask:
        return AllOf([as_structured(other), self])

    def __or__(self, other: Any) -> StructuredMask:
        return AnyOf([self, as_structured(other)])

    def __ror__(self, other: Any) -> StructuredMask:
        return AnyOf([as_structured(other), self])

    def __invert__(self) -> StructuredMask:
        return Not(self)

    def __eq__(self, other: Any) -> torch.Tensor:  # type: ignore[override]
        return self.to_dense() == _dense(other)

    def __ne__(self, other: Any) -> torch.Tensor:  # type: ignore[override]
        return self.to_dense() != _dense(other)

    __hash__ = object.__hash__

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.to_dense()[index]

    def __len__(self) -> int:
        return self._shape[0]

    def __iter__(self):
        return iter(self.to_dense())

    def __bool__(self) -> bool:
        return bool(self.to_dense())

    def __array__(self, dtype: Any = None, copy: Any = None):
        array = self.to_dense().cpu().numpy()
        return array if dtype is None else array.astype(dtype)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.to_dense(), name)  # any other tensor method works on the dense values

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._describe()}, shape={list(self._shape)})"

    def _describe(self) -> str:
        return ""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not kwargs and len(args) == 2:
            if func in _AND:
                return AllOf([as_structured(args[0]), as_structured(args[1])])
            if func in _OR:
                return AnyOf([as_structured(args[0]), as_structured(args[1])])
        if not kwargs and len(args) == 1 and func in _NOT:
            return Not(as_structured(args[0]))
        args = tuple(_dense_tree(a) for a in args)
        kwargs = {key: _dense_tree(value) for key, value in kwargs.items()}
        return func(*args, **kwargs)


_AND = {torch.Tensor.__and__, torch.Tensor.__rand__, torch.logical_and, torch.bitwise_and,
        torch.Tensor.logical_and, torch.Tensor.bitwise_and}
_OR = {torch.Tensor.__or__, torch.Tensor.__ror__, torch.logical_or, torch.bitwise_or,
       torch.Tensor.logical_or, torch.Tensor.bitwise_or}
_NOT = {torch.Tensor.__invert__, torch.logical_not, torch.bitwise_not, torch.Tensor.logical_not,
        torch.Tensor.bitwise_not}


def _dense(x: Any) -> Any:
    return x.to_dense() if isinstance(x, StructuredMask) else x


def _dense_tree(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return type(x)(_dense_tree(item) for item in x)
    return _dense(x)


def as_structured(x: Any) -> StructuredMask:
    """A StructuredMask as is; a bool tensor (broadcastable to ``[B, Hq, T, S]``) wrapped as DenseMask."""
    if isinstance(x, StructuredMask):
        return x
    if isinstance(x, torch.Tensor) and x.dtype == torch.bool and x.dim() <= 4:
        return DenseMask(x)
    if isinstance(x, torch.Tensor) and x.dtype == torch.bool:
        got = f"a {x.dim()}-D bool tensor of shape {list(x.shape)}"
    else:
        got = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
    raise ValueError(f"a mask must be a bool tensor of at most 4 dims [B, Hq, T, S] or a StructuredMask, got {got}")


class DenseMask(StructuredMask):
    """A plain bool tensor broadcastable to ``[B, Hq, T, S]``, summarised per tile by reading it once."""

    def __init__(self, mask: torch.Tensor) -> None:
        if mask.dtype != torch.bool or mask.dim() > 4:
            raise ValueError(f"DenseMask needs a bool tensor of at most 4 dims, got {mask.dtype} {tuple(mask.shape)}")
        self.mask = mask
        super().__init__(mask.shape, mask.device)

    @property
    def _mask4(self) -> torch.Tensor:
        return self.mask.reshape((1,) * (4 - self.mask.dim()) + tuple(self.mask.shape))  # [B|1, H|1, T|1, S|1]

    def to_dense(self) -> torch.Tensor:
        return self.mask

    def batched(self) -> bool:
        return self._mask4.shape[0] > 1

    def block(self, b: int, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        m = self._mask4[b if self._mask4.shape[0] > 1 else 0]  # [H|1, T|1, S|1]
        rows = slice(i0, i1) if m.shape[1] > 1 else slice(None)
        cols = slice(j0, j1) if m.shape[2] > 1 else slice(None)
        return m[:, rows, cols]  # [H|1, tq|1, tk|1]

    def tile_bounds(self, b: int, block_q: int, block_k: int, t: int, s: int):
        m = self._mask4[b if self._mask4.shape[0] > 1 else 0]  # [H|1, T|1, S|1]
        nq, nk = math.ceil(t / block_q), math.ceil(s / block_k)
        bounds = []
        for op, x in (("any", m.any(dim=0)), ("all", m.all(dim=0))):  # [T|1, S|1], over heads
            if x.shape[0] > 1:
                x = tile_reduce(x, block_q, op, dim=0)  # [nq, S|1]
            if x.shape[1] > 1:
                x = tile_reduce(x, block_k, op, dim=1)  # [nq|1, nk]
            bounds.append(x.expand(nq, nk))
        return bounds[0], bounds[1]

    def _describe(self) -> str:
        return "dense"


# --- combinators: what &, | and ~ build ---------------------------------------------------------------


class _Combined(StructuredMask):
    """Parts joined by one elementwise operator (``&`` or ``|``); nested joins of the same kind flatten."""

    symbol = ""
    op: Any = None  # the elementwise operator of two bool tensors (each subclass's)

    def __init__(self, parts: Sequence[StructuredMask]) -> None:
        flat: list[StructuredMask] = []
        for part in parts:
            flat += part.parts if isinstance(part, type(self)) else [part]
        self.parts = flat
        super().__init__(broadcast_shape(*(p.shape for p in flat)), flat[0].device)

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
    op = staticmethod(lambda a, b: a & b)


class AnyOf(_Combined):
    """``parts[0] | parts[1] | ...``: a tile is full if any part's is, empty if every part's is."""

    symbol = "|"
    op = staticmethod(lambda a, b: a | b)


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
