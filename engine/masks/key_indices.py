"""Top-k sparse attention as a mask family: each query sees only the keys listed for it (DeepSeek V3.2's and GLM-5's
indexer picks them), intersected with the position rule and any other mask.

``key_index_mask(key_indices, num_keys, q_heads)`` takes int ``key_indices [B, Hkv|1, T, K]`` (key j of the call's
key axis, -1 = no key; a key listed twice counts once) and returns a ``KeyIndexMask``: a StructuredMask of shape
``[B, Hq|1, T, S]`` whose every kernel reads it as any mask (its tiles come from the indices, O(T·K) to summarise),
and which the ``sparse`` kernel reads directly, gathering only the listed keys (O(T·K·D), never a dense
``[T, S]``)::

    S = 6, K = 2: key_indices[0, 0] = [[0, -1], [1, 0], [2, 0], [4, 3]]     (queries at positions 0..3)
    mask        1 . . . . .      query 0: key 0
                1 1 . . . .      query 1: keys 1, 0
                1 . 1 . . .      query 2: keys 2, 0
                . . . . . .      query 3: keys 4, 3 -> with the causal rule only key 3 (position 3 <= 3)

Per-KV-head indices (``Hkv > 1``) serve each KV head's group of query heads (head h reads the list of KV head
h // G). An index outside ``[-1, S)`` is refused with a ValueError.
"""

from __future__ import annotations

import math

import torch

from engine.masks.structured import AllOf, StructuredMask

__all__ = ["KeyIndexMask", "key_index_mask", "split_listed"]


class KeyIndexMask(StructuredMask):
    """Keys listed per query (``key_index_mask``): ``indices`` int64 ``[B, H|1, T, K]`` (H the KV heads), seen by
    ``[B, Hq|1, T, S]``."""

    def __init__(self, indices: torch.Tensor, num_keys: int, q_heads: int) -> None:
        self.indices, self.num_keys = indices, num_keys
        self.group = q_heads // indices.shape[1] if indices.shape[1] > 1 else 1
        heads = q_heads if indices.shape[1] > 1 else 1
        super().__init__((indices.shape[0], heads, indices.shape[2], num_keys), indices.device)

    def _dense(self, b: int, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        """bool ``[H|1, i1-i0, j1-j0]`` (KV heads) of batch row b."""
        idx = self.indices[b if self.indices.shape[0] > 1 else 0, :, i0:i1]  # [H, tq, K]
        inside = (idx >= j0) & (idx < j1)
        column = torch.where(inside, idx - j0, j1 - j0)  # the column past the end catches -1 and outside keys
        out = torch.zeros(*idx.shape[:2], j1 - j0 + 1, dtype=torch.bool, device=idx.device)
        return out.scatter_(2, column, True)[..., :j1 - j0]

    def to_dense(self) -> torch.Tensor:
        rows = [self._dense(b, 0, self.shape[2], 0, self.num_keys) for b in range(self.indices.shape[0])]
        dense = torch.stack(rows)  # [B, H|1, T, S]
        return dense.repeat_interleave(self.group, dim=1) if self.group > 1 else dense

    def block(self, b: int, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        part = self._dense(b, i0, i1, j0, j1)  # [H|1, tq, tk]
        return part.repeat_interleave(self.group, dim=0) if self.group > 1 else part

    def tile_bounds(self, b: int, block_q: int, block_k: int, t: int, s: int):
        idx = self.indices[b if self.indices.shape[0] > 1 else 0]  # [H, T, K]
        nq, nk = math.ceil(t / block_q), math.ceil(s / block_k)
        rows = (torch.arange(idx.shape[1], device=idx.device) // block_q)[None, :, None].expand(idx.shape)
        listed = idx >= 0
        some = torch.zeros(nq * nk, dtype=torch.bool, device=idx.device)
        some[(rows * nk + idx.clamp(min=0) // block_k)[listed]] = True
        return some.view(nq, nk), torch.zeros(nq, nk, dtype=torch.bool, device=idx.device)  # never "every"

    def batched(self) -> bool:
        return self.indices.shape[0] > 1

    def _describe(self) -> str:
        return f"top-{self.indices.shape[3]} key indices"


def key_index_mask(key_indices: torch.Tensor, num_keys: int, q_heads: int) -> KeyIndexMask:
    """The mask of ``key_indices`` (int ``[B, Hkv|1, T, K]``, -1 = none) over ``num_keys`` keys for ``q_heads`` query
    heads; a ValueError names what was expected and what was given."""
    if not isinstance(key_indices, torch.Tensor) or key_indices.dtype not in (torch.int32, torch.int64) or \
            key_indices.dim() != 4:
        raise ValueError(f"key_indices must be an int32 / int64 tensor [B, Hkv|1, T, K], got "
                         f"{getattr(key_indices, 'dtype', type(key_indices).__name__)} "
                         f"{list(getattr(key_indices, 'shape', []))}")
    heads = key_indices.shape[1]
    if heads != 1 and q_heads % heads != 0:
        raise ValueError(f"key_indices must have 1 head or one per KV head (a divisor of Hq = {q_heads}), got {heads}")
    if key_indices.numel():
        low, high = (int(x) for x in torch.aminmax(key_indices))  # (one pass, read back once)
        if low < -1 or high >= num_keys:
            raise ValueError(f"key_indices must lie in [-1, S) = [-1, {num_keys}) (-1: no key), got values in "
                             f"[{low}, {high}]")
    return KeyIndexMask(key_indices.long(), num_keys, q_heads)


def split_listed(allowed) -> tuple[KeyIndexMask | None, list]:
    """``(the KeyIndexMask of a call's allowed mask or None, the mask's other parts)``."""
    if allowed is None:
        return None, []
    parts = list(allowed.parts) if isinstance(allowed, AllOf) else [allowed]
    listed = [p for p in parts if isinstance(p, KeyIndexMask)]
    return (listed[0], [p for p in parts if p is not listed[0]]) if listed else (None, parts)
