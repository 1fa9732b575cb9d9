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

    @property
    def per_side(self) -> int:
        """Buckets for each direction: half of them when bidirectional, else all."""
        return self.num_buckets // 2 if self.bidirectional else self.num_buckets

    @property
    def exact_buckets(self) -> int:
        """Distances below this get one bucket each (half of a direction's buckets); the rest are logarithmic."""
        return self.per_side // 2

    def buckets(self, relative: torch.Tensor) -> torch.Tensor:
        """int64 bucket of each ``relative = key_pos - query_pos`` (any shape)."""
        per_side, exact = self.per_side, self.exact_buckets
        if self.bidirectional:
            side = (relative > 0).long() * per_side  # keys after the query: the upper half
            distance = relative.abs()
        else:
            side = torch.zeros_like(relative)
            distance = (-relative).clamp(min=0)  # keys after the query are masked anyway: bucket 0
        # the same float32 steps as T5's own bucketing, so a bucket edge falls on the same distance
        scaled = (torch.log(distance.float() / exact) / math.log(self.max_distance / exact) * (per_side - exact))
        far = (exact + scaled.to(torch.long)).clamp(max=per_side - 1)
        return side + torch.where(distance < exact, distance, far)

    def block(self, query_positions: torch.Tensor, key_positions: torch.Tensor,
              visible: torch.Tensor | None = None) -> torch.Tensor:
        """``[b, Hq, tq, tk]`` bias from query_positions ``[b, tq]`` and key_positions ``[b, tk]`` (int64); with
        ``visible`` (bool ``[b|1, tq, tk]``) hidden pairs get -inf (a fused op's additive mask)."""
        if _consecutive(query_positions) and _consecutive(key_positions):
            out = self._diagonals(query_positions[:, 0], key_positions[:, 0], query_positions.shape[1],
                                  key_positions.shape[1])
            return out if visible is None else out.masked_fill_(~visible[:, None], float("-inf"))
        relative = key_positions[:, None, :] - query_positions[:, :, None]  # [b, tq, tk]
        buckets, table = self.buckets(relative), self.table  # [b, tq, tk], [Hq, num_buckets]
        if visible is not None:  # hidden pairs read an extra bucket of -inf
            hidden = torch.full_like(table[:, :1], float("-inf"))  # [Hq, 1]
            buckets, table = buckets.masked_fill(~visible, self.num_buckets), torch.cat([table, hidden], dim=1)
        out = table.index_select(1, buckets.flatten())  # [Hq, b*tq*tk] (index_select: ~2x faster than table[:, idx])
        return out.view(-1, *buckets.shape).transpose(0, 1)  # [b, Hq, tq, tk]

    def add_block_grad(self, grad_table: torch.Tensor, grad_block: torch.Tensor, query_positions: torch.Tensor,
                       key_positions: torch.Tensor) -> None:
        """Add the gradient of a block that ``block`` read, ``grad_block [b, Hq, tq, tk]`` (0 where hidden), to
        ``grad_table [Hq, num_buckets]``: the block gathers ``table[h, bucket]``, so its gradient scatter-adds
        each entry into its bucket."""
        buckets = self.buckets(key_positions[:, None, :] - query_positions[:, :, None])  # [b, tq, tk]
        heads = grad_table.shape[0]
        grad_table.index_add_(1, buckets.flatten(), grad_block.transpose(0, 1).reshape(heads, -1))  # [Hq, buckets]

    def _diagonals(self, query_start: torch.Tensor, key_start: torch.Tensor, tq: int, tk: int) -> torch.Tensor:
        """The block when positions run ``start, start+1, ...``: constant along diagonals, so one line of
        ``tq + tk - 1`` values per head, viewed as the block with its rows reversed, then read back in order
        (one copy)::

            line  = bias at key - query = r0 - (tq-1) .. r0 + tk - 1        r0 = key_start - query_start
            query i (row tq-1-i of the view), key j  ->  line[j - i + tq - 1]
        """
        heads = self.table.shape[0]
        offsets = torch.arange(-(tq - 1), tk, device=query_start.device)  # [tq + tk - 1]
        relative = (key_start - query_start)[:, None] + offsets  # [b, L]
        line = self.table[:, self.buckets(relative)].transpose(0, 1).contiguous()  # [b, Hq, L]
        length = line.shape[-1]
        rows_reversed = line.as_strided((line.shape[0], heads, tq, tk), (heads * length, length, 1, 1))
        # (flip keeps the view's odd strides; index_select on this overlapping view is ~50x slower on 2 threads)
        backwards = torch.arange(tq - 1, -1, -1, device=line.device)
        return rows_reversed[:, :, backwards]  # [b, Hq, tq, tk], contiguous


def _consecutive(positions: torch.Tensor) -> bool:
    """True when every row of ``positions [b, n]`` counts up by one."""
    return positions.shape[1] <= 1 or bool((positions.diff(dim=-1) == 1).all())
