"""PairwiseMask: one mask family as a relation between a per-query value and a per-key value.

Positions (causal, window), document ids (documents) or validity flags (padding) are ``[L]`` or ``[B, L]``
vectors; the mask is ``relation(query_values[i], key_values[j])``. Per tile, the min and max of each side
bound the relation without reading a ``[T, S]`` tensor (see StructuredMask.tile_bounds).
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


# Window masks subtract positions (q - k < window): positions in [-2^62, 2^62) keep q - k exact in int64.
POSITION_LIMIT = 1 << 62


def check_window_range(values: torch.Tensor | None, window: int) -> None:
    """Refuse positions or a window so large that ``q - k < window`` could overflow int64."""
    if window > POSITION_LIMIT:
        raise ValueError(f"window must be at most 2^62 = {POSITION_LIMIT} keys, got {window} "
                         f"(for an unbounded window use the causal rule alone)")
    if values is None or values.numel() == 0:
        return
    low, high = (int(x) for x in torch.aminmax(values))
    if low < -POSITION_LIMIT or high >= POSITION_LIMIT:
        raise ValueError(f"window masks need positions in [-2^62, 2^62) so that q - k cannot overflow int64, "
                         f"got positions from {low} to {high}")


def _widen(values: torch.Tensor | None) -> torch.Tensor | None:
    """Integer values as int64 (a no-op for int64); bool validity flags stay bool."""
    if values is None or values.dtype in (torch.bool, torch.int64):
        return values
    if values.is_floating_point() or values.is_complex():
        raise ValueError(f"mask positions and ids must be integers, got dtype {values.dtype}")
    return values.long()


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
        # Positions and ids are compared after subtraction (q - k < window): widen them to int64 so that a
        # narrow or unsigned dtype (uint8 wraps around) cannot misplace a tile boundary.
        query_values, key_values = _widen(query_values), _widen(key_values)
        if relation == "window":
            check_window_range(query_values, window)
            check_window_range(key_values, window)
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
            k_some, k_every = tile_reduce(k, block_k, "any")[None, :], tile_reduce(k, block_k, "all")[None, :]
            if self._qv is None:
                return k_some.expand(nq, -1), k_every.expand(nq, -1)
            q = self._qv[b if self._qv.shape[0] > 1 else 0]  # [T]
            q_some, q_every = tile_reduce(q, block_q, "any")[:, None], tile_reduce(q, block_q, "all")[:, None]
            return q_some & k_some, q_every & k_every  # [nq, nk]
        q = self._qv[b if self._qv.shape[0] > 1 else 0]  # [T]
        q_lo, q_hi = tile_reduce(q, block_q, "min")[:, None], tile_reduce(q, block_q, "max")[:, None]  # [nq, 1]
        k_lo, k_hi = tile_reduce(k, block_k, "min")[None, :], tile_reduce(k, block_k, "max")[None, :]  # [1, nk]
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
