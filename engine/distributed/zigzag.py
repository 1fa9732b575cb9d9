"""Load-balanced sharding for causal attention: the zigzag layout and its inverse.

Under the causal rule the last tokens of a sequence see the most keys, so contiguous shards give the last rank
the most work. The zigzag layout cuts the sequence into ``2P`` chunks and gives rank ``r`` chunks ``r`` and
``2P - 1 - r``: an early and a late chunk, about equal work per rank::

    P = 2, 8 tokens, chunks [0 1] [2 3] [4 5] [6 7]:   rank 0 holds 0 1 6 7,   rank 1 holds 2 3 4 5

Positions say where each token is, so ``context_parallel_attention`` needs nothing else: pass each rank its
shard and ``zigzag_indices(length, rank, world)`` as its positions.
"""

from __future__ import annotations

import torch


def zigzag_indices(length: int, rank: int, world: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Int64 ``[L_r]``: the sequence indices rank ``rank`` of ``world`` holds (chunks ``r`` and ``2P-1-r``).

    ``length`` need not divide by ``2 * world``: chunks are ``torch.tensor_split`` pieces, sizes differing by one.
    """
    for name, value in (("length", length), ("world", world), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if world < 1 or not 0 <= rank < world or length < 0:
        raise ValueError(f"need world >= 1, 0 <= rank < world and length >= 0, got length={length}, "
                         f"rank={rank}, world={world}")
    chunks = torch.tensor_split(torch.arange(length, device=device), 2 * world)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]])  # [L_r]


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of ``x`` along ``dim`` (the sequence axis: 2 for ``[B, H, L, D]``)."""
    return x.index_select(dim, zigzag_indices(x.shape[dim], rank, world, x.device))


def zigzag_unshard(shards: list[torch.Tensor], dim: int = 2) -> torch.Tensor:
    """The inverse: every rank's shard (in rank order, e.g. from ``all_gather``) back in sequence order."""
    world = len(shards)
    length = sum(s.shape[dim] for s in shards)
    order = torch.cat([zigzag_indices(length, r, world, shards[0].device) for r in range(world)])  # [L]
    gathered = torch.cat(shards, dim=dim)  # [.., L, ..] in zigzag order
    return gathered.index_select(dim, torch.argsort(order))
