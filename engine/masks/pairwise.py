"""PairwiseMask: the machinery every mask family shares, a relation between per-query and per-key values.

Positions (causal, window), document ids (documents) or validity flags (padding) are ``[L]`` or ``[B, L]``
vectors; the mask is ``relate(query_values[i], key_values[j])``. Per tile, the min and max of each side
(for bool flags: all and any) bound the relation without reading a ``[T, S]`` tensor.

A family is one subclass, in its own module, that states its relation twice: elementwise (``relate``)
and on the per-tile value ranges (``bounds``); nothing else in the engine needs to know it::

    class CausalMask(PairwiseMask):                       # engine/masks/causal.py
        def relate(self, q, k):  return k <= q
        def bounds(self, q_lo, q_hi, k_lo, k_hi):  return k_lo <= q_hi, k_hi <= q_lo   # (some, every)
"""

from __future__ import annotations

import math

import torch

from engine.masks.structured import StructuredMask
from engine.masks.tile_reduce import tile_reduce


def _rows(values: torch.Tensor) -> torch.Tensor:
    """``[L]`` or ``[B, L]`` as ``[1|B, L]``; rows that are one expanded row (stride 0) count once."""
    if values.dim() == 1:
        return values[None]  # [1, L]
    if values.shape[0] > 1 and values.stride(0) == 0:
        return values[:1]  # [1, L]
    return values  # [B, L]


def _widen(values: torch.Tensor | None) -> torch.Tensor | None:
    """Integer values as int64 (a no-op for int64); bool validity flags stay bool."""
    if values is None or values.dtype in (torch.bool, torch.int64):
        return values
    if values.is_floating_point() or values.is_complex():
        raise ValueError(f"mask positions and ids must be integers, got dtype {values.dtype}")
    return values.long()


def _check_values(query_values: torch.Tensor | None, key_values: torch.Tensor, name: str) -> None:
    """Values must be ``[L]`` or ``[B, L]`` tensors, with one batch size where both are ``[B, L]``."""
    for label, x in (("query", query_values), ("key", key_values)):
        if x is None and label == "query":
            continue
        if not isinstance(x, torch.Tensor) or x.dim() not in (1, 2):
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: {label} values must be a tensor of shape [L] or [B, L], got {shape}")
    if query_values is not None and query_values.dim() == key_values.dim() == 2 \
            and query_values.shape[0] != key_values.shape[0]:
        raise ValueError(f"{name}: batch sizes differ: queries {tuple(query_values.shape)}, "
                         f"keys {tuple(key_values.shape)}")


class PairwiseMask(StructuredMask):
    """``relate(query_values[i], key_values[j])`` for one family of masks (a subclass per family).

    Values are ``[L]`` (shared by every batch row: dense shape ``[T, S]``) or ``[B, L]`` (dense shape
    ``[B, 1, T, S]``); ``query_values=None`` gives a key-only mask ``[B, 1, 1, S]`` (every query side counts
    as True).
    """

    name = "pairwise"
    key_only = False  # True for a family whose masks may have no query side (query_values=None)

    def __init__(self, query_values: torch.Tensor | None, key_values: torch.Tensor) -> None:
        if query_values is None and not self.key_only:
            raise ValueError(f"{type(self).__name__} relates queries to keys: query_values must be given")
        _check_values(query_values, key_values, type(self).__name__)
        # Values are compared after subtraction (q - k < window): widen them to int64 so that a narrow or
        # unsigned dtype (uint8 wraps around) cannot misplace a tile boundary. Rows are read before widening,
        # which copies: an expanded [B, L] stays one shared row.
        self._qv = None if query_values is None else _widen(_rows(query_values))  # [1|B, T]
        self._kv = _widen(_rows(key_values))  # [1|B, S]
        self.query_values, self.key_values = _widen(query_values), _widen(key_values)
        super().__init__(self.to_dense_shape(), key_values.device)

    # --- what a family states ----------------------------------------------------------------------
    def relate(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Bool: may query value ``q`` see key value ``k`` (broadcasting tensors)."""
        raise NotImplementedError

    def bounds(self, q_lo, q_hi, k_lo, k_hi) -> tuple[torch.Tensor, torch.Tensor]:
        """``(some, every)`` per tile from the value ranges ``[nq, 1]`` and ``[1, nk]``: some pair of the tile
        may be visible / every pair is. Sound, may be conservative (an unsure tile is partial)."""
        raise NotImplementedError

    # --- the machinery ----------------------------------------------------------------------------
    def to_dense_shape(self) -> torch.Size:
        q, k = self.query_values, self.key_values
        if q is None:
            return torch.Size([k.shape[0] if k.dim() == 2 else 1, 1, 1, k.shape[-1]])  # [B, 1, 1, S]
        if q.dim() == 1 and k.dim() == 1:
            return torch.Size([q.shape[0], k.shape[0]])  # [T, S]
        batch = q.shape[0] if q.dim() == 2 else k.shape[0]
        return torch.Size([batch, 1, q.shape[-1], k.shape[-1]])  # [B, 1, T, S]

    def _relate(self, q: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
        return self.relate(torch.ones_like(k) if q is None else q, k)

    def to_dense(self) -> torch.Tensor:
        k = self.key_values
        if self.query_values is None:
            return self._relate(None, k.reshape(-1, k.shape[-1])[:, None, None, :])  # [B, 1, 1, S]
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
        k_lo, k_hi = tile_reduce(k, block_k, "min")[None, :], tile_reduce(k, block_k, "max")[None, :]  # [1, nk]
        if self._qv is None:  # a key-only mask: every query counts as True
            nq = math.ceil(t / block_q)
            true = torch.ones(nq, 1, dtype=torch.bool, device=k.device)  # [nq, 1]
            some, every = self.bounds(true, true, k_lo, k_hi)
            return some.expand(nq, -1), every.expand(nq, -1)
        q = self._qv[b if self._qv.shape[0] > 1 else 0]  # [T]
        q_lo, q_hi = tile_reduce(q, block_q, "min")[:, None], tile_reduce(q, block_q, "max")[:, None]  # [nq, 1]
        return self.bounds(q_lo, q_hi, k_lo, k_hi)  # [nq, nk] each

    def _describe(self) -> str:
        return self.name
