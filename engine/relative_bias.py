"""A bucketed relative-position bias: one learned value per (head, bucket of ``key_pos - query_pos``).

The bias of query ``i`` and key ``j`` is ``table[h, bucket(key_pos[j] - query_pos[i])]``: it depends on
positions only, so a kernel computes it for the tile it is working on and no dense ``[T, S]`` bias is ever
built. The buckets (T5's scheme) are exact for short distances and logarithmic for long ones::

    num_buckets = 32, bidirectional, max_distance = 128:  16 buckets per direction, each split as
        distance 0..7         -> buckets 0..7 (one per distance)
        distance 8..127       -> buckets 8..15, logarithmically (8-9, 10-11, 12-15, 16-22, ...)
        distance >= 128       -> bucket 15
    keys after the query (key_pos > query_pos) use buckets 16..31 the same way.

    Causal (bidirectional=False): only keys at or before the query have a bucket, all 32 for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RelativePositionBias:
    """``table [Hq, num_buckets]`` (float), read at ``bucket(key_pos - query_pos)``; pass it as ``bias=``.

    bidirectional: half the buckets for keys after the query (encoders, cross-attention), else all of them
    for keys at or before it. max_distance: distances from here on share the last bucket.
    """

    table: torch.Tensor
    bidirectional: bool = True
    max_distance: int = 128

    @property
    def num_buckets(self) -> int:
        return self.table.shape[-1]

    def buckets(self, relative: torch.Tensor) -> torch.Tensor:
        """int64 bucket of each ``relative = key_pos - query_pos`` (any shape)."""
        per_side = self.num_buckets // 2 if self.bidirectional else self.num_buckets
        if self.bidirectional:
            side = (relative > 0).long() * per_side  # keys after the query: the upper half
            distance = relative.abs()
        else:
            side = torch.zeros_like(relative)
            distance = (-relative).clamp(min=0)  # keys after the query are masked anyway: bucket 0
        exact = per_side // 2  # distances below this get one bucket each
        # the same float32 steps as T5's own bucketing, so a bucket edge falls on the same distance
        scaled = (torch.log(distance.float() / exact) / math.log(self.max_distance / exact) * (per_side - exact))
        far = (exact + scaled.to(torch.long)).clamp(max=per_side - 1)
        return side + torch.where(distance < exact, distance, far)

    def block(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """``[b, Hq, tq, tk]`` bias from query_positions ``[b, tq]`` and key_positions ``[b, tk]`` (int64)."""
        relative = key_positions[:, None, :] - query_positions[:, :, None]  # [b, tq, tk]
        return self.table[:, self.buckets(relative)].transpose(0, 1)  # [b, Hq, tq, tk]
