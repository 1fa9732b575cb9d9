"""Structured masks: a bool mask kept as a predicate over per-token values, so kernels can skip tiles.

A mask helper (``window_mask``, ``document_mask``, ...) returns a ``StructuredMask``. Wherever a bool
tensor is expected it behaves as the dense ``[T, S]`` (or ``[B, 1, T, S]``) tensor it describes: torch
functions, indexing, ``torch.equal`` and ``==`` materialise it on demand, and ``&``, ``|``, ``~`` build a
new structured mask (also with a plain bool tensor on either side). Kernels instead ask two cheap
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


def _tile_reduce(x: torch.Tensor, tile: int, op: str, dim: int = 0) -> torch.Tensor:
    """Reduce axis ``dim`` of x over consecutive tiles of ``tile`` entries (min/max/any/all).

    ``[L] -> [ceil(L / tile)]``; along ``dim`` of a 2-D tensor the other axis is kept.
    """
    x = x.movedim(dim, 0)
    length = x.shape[0]
    n = math.ceil(length / tile)
    pad = n * tile - length
    if pad:  # repeating the last entry leaves every reduction unchanged
        x = torch.cat([x, x[-1:].expand(pad, *x.shape[1:])])
    x = x.reshape(n, tile, *x.shape[1:])  # [n, tile, ...]
    reduced = {"min": x.amin, "max": x.amax, "any": x.any, "all": x.all}[op](dim=1)  # [n, ...]
    return reduced.movedim(0, dim)


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
        """Exact bool mask of queries ``i0:i1`` x keys ``j0:j1`` of batch row b, broadcastable to
        ``[Hq, i1 - i0, j1 - j0]``."""
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
    kind = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
    raise ValueError(f"a mask must be a bool tensor (at most 4-D) or a StructuredMask, got {kind}")


def _rows(values: torch.Tensor) -> torch.Tensor:
    """``[L]`` or ``[B, L]`` as ``[1|B, L]``; rows that are one expanded row (stride 0) count once."""
    if values.dim() == 1 or (values.shape[0] > 1 and values.stride(0) == 0):
        return values.reshape(-1, values.shape[-1])[:1]  # [1, L]
    return values  # [B, L]


class PairwiseMask(StructuredMask):
    """``relation(query_values[i], key_values[j])`` for one family of masks.

    relation, with q = query value and k = key value:
        ``"causal"``    k <= q                       (positions)
        ``"window"``    k <= q and q - k < window    (positions; exactly ``window`` keys, own included)
        ``"document"``  q == k                       (document ids)
        ``"padding"``   q and k                      (bool validity; a missing side counts as valid)

    Values are ``[L]`` (shared by every batch row: dense shape ``[T, S]``) or ``[B, L]`` (dense shape
    ``[B, 1, T, S]``); ``query_values=None`` gives a key-only mask ``[B, 1, 1, S]``.
    """

    RELATIONS = ("causal", "window", "document", "padding")

    def __init__(self, relation: str, query_values: torch.Tensor | None, key_values: torch.Tensor,
                 window: int | None = None) -> None:
        if relation not in self.RELATIONS:
            raise ValueError(f"relation must be one of {self.RELATIONS}, got {relation!r}")
        if relation == "window" and window is None:
            raise ValueError("relation 'window' needs a window size")
        self.relation, self.window = relation, window
        self.query_values, self.key_values = query_values, key_values
        self._qv = None if query_values is None else _rows(query_values)  # [1|B, T]
        self._kv = _rows(key_values)  # [1|B, S]
        super().__init__(self.to_dense_shape(), key_values.device)

    def to_dense_shape(self) -> torch.Size:
        q, k = self.query_values, self.key_values
        if q is None:
            return torch.Size([k.shape[0], 1, 1, k.shape[-1]])  # [B, 1, 1, S]
        if q.dim() == 1 and k.dim() == 1:
            return torch.Size([q.shape[0], k.shape[0]])  # [T, S]
        batch = q.shape[0] if q.dim() == 2 else k.shape[0]
        return torch.Size([batch, 1, q.shape[-1], k.shape[-1]])  # [B, 1, T, S]

    def _relate(self, q: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
        if self.relation == "causal":
            return k <= q
        if self.relation == "window":
            return (k <= q) & (q - k < self.window)
        if self.relation == "document":
            return q == k
        return k if q is None else q & k

    def to_dense(self) -> torch.Tensor:
        k = self.key_values
        if self.query_values is None:
            return self._relate(None, k[:, None, None, :])  # [B, 1, 1, S]
        q = self.query_values
        if q.dim() == 1 and k.dim() == 1:
            return self._relate(q[:, None], k[None, :])  # [T, S]
        batch = self._shape[0]
        q, k = q.expand(batch, -1), k.expand(batch, -1)
        return self._relate(q[:, None, :, None], k[:, None, None, :])  # [B, 1, T, S]

    def batched(self) -> bool:
        return self._kv.shape[0] > 1 or (self._qv is not None and self._qv.shape[0] > 1)

    def block(self, b: int, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        k = self._kv[b if self._kv.shape[0] > 1 else 0, j0:j1]  # [tk]
        if self._qv is None:
            return self._relate(None, k[None, :])  # [1, tk]
        q = self._qv[b if self._qv.shape[0] > 1 else 0, i0:i1]  # [tq]
        return self._relate(q[:, None], k[None, :])  # [tq, tk]

    def tile_bounds(self, b: int, block_q: int, block_k: int, t: int, s: int):
        k = self._kv[b if self._kv.shape[0] > 1 else 0]  # [S]
        nq = math.ceil(t / block_q)
        if self.relation == "padding":
            k_some, k_every = _tile_reduce(k, block_k, "any")[None, :], _tile_reduce(k, block_k, "all")[None, :]
            if self._qv is None:
                return k_some.expand(nq, -1), k_every.expand(nq, -1)
            q = self._qv[b if self._qv.shape[0] > 1 else 0]  # [T]
            q_some, q_every = _tile_reduce(q, block_q, "any")[:, None], _tile_reduce(q, block_q, "all")[:, None]
            return q_some & k_some, q_every & k_every  # [nq, nk]
        q = self._qv[b if self._qv.shape[0] > 1 else 0]  # [T]
        q_lo, q_hi = _tile_reduce(q, block_q, "min")[:, None], _tile_reduce(q, block_q, "max")[:, None]  # [nq, 1]
        k_lo, k_hi = _tile_reduce(k, block_k, "min")[None, :], _tile_reduce(k, block_k, "max")[None, :]  # [1, nk]
        if self.relation == "causal":  # every key of the tile <= every query; some key <= some query
            return k_lo <= q_hi, k_hi <= q_lo
        if self.relation == "window":
            some = (k_lo <= q_hi) & (q_lo - k_hi < self.window)
            every = (k_hi <= q_lo) & (q_hi - k_lo < self.window)
            return some, every
        some = (q_lo <= k_hi) & (k_lo <= q_hi)  # the id ranges overlap
        every = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)  # one id on both sides
        return some, every

    def _describe(self) -> str:
        return self.relation + (f", window={self.window}" if self.relation == "window" else "")


class DenseMask(StructuredMask):
    """A plain bool tensor broadcastable to ``[B, Hq, T, S]``, summarised per tile by reading it once."""

    def __init__(self, mask: torch.Tensor) -> None:
        if mask.dtype != torch.bool or mask.dim() > 4:
            raise ValueError(f"DenseMask needs a bool tensor of at most 4 dims, got {mask.dtype} {tuple(mask.shape)}")
        self.mask = mask
        self._mask4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # [B|1, H|1, T|1, S|1]
        super().__init__(mask.shape, mask.device)

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
        for op, heads in (("any", m.any(dim=0)), ("all", m.all(dim=0))):  # [T|1, S|1], over heads
            x = heads
            if x.shape[0] > 1:
                x = _tile_reduce(x, block_q, op, dim=0)  # [nq, S|1]
            if x.shape[1] > 1:
                x = _tile_reduce(x, block_k, op, dim=1)  # [nq|1, nk]
            bounds.append(x.expand(nq, nk))
        return bounds[0], bounds[1]

    def _describe(self) -> str:
        return "dense"


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
