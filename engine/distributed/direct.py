"""Direct attention: each K/V shard goes straight to the ranks whose queries can see some of it, and only to them.

The ring passes every shard round every rank, visible or not (it skips the compute, not the bytes). Here every rank
publishes the bounds of its shards (query and key positions, document ids: ``ShardBounds``) in the call's rank
check, so every rank knows the whole visibility graph: rank s sends its shard to rank r iff some query of r may see
some key of s, decided from the bounds alone (conservative: a pair of bounds that may overlap counts as seen)::

    T = 16k on P = 4 contiguous shards of 4k, window 512: rank r's queries see keys of r and of r - 1 only
    ring:    every rank sends 3 shards forward (and 3 + 4 accumulators back)
    direct:  rank r sends its shard to r + 1 only; its dK/dV come back from r + 1 only

Forward: the sends and receives are posted at once; the rank attends its queries to its own shard while they travel,
then to each received shard as it arrives, merging in place by log-sum-exp. The received shards are kept for the
backward, which sends each source rank the gradient of its shard from this rank's queries (and receives its own
shard's from the ranks it sent it to), summed at home. Memory: the shards a rank can see (one or two neighbours
for a window; every rank for plain causal attention, where ``ring`` holds less).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.distributed.shard import KeyShard, Queries
from engine.distributed.transport import transfer
from engine.kernels.common import compute_dtype, nothing_seen
from engine.kernels.merge import merge_into

__all__ = ["DirectAttention", "ShardBounds", "visibility_graph"]


@dataclass(frozen=True)
class ShardBounds:
    """What a rank's shards span (over every batch row): its query positions and ids, its key positions and ids
    (None where the rank has no queries / no keys, or no documents)."""

    queries: tuple[int, int] | None
    keys: tuple[int, int] | None
    query_ids: tuple[int, int] | None
    key_ids: tuple[int, int] | None

    @staticmethod
    def of(queries: Queries, own: KeyShard) -> ShardBounds:
        def span(x):
            return None if x is None or x.numel() == 0 else (int(x.min()), int(x.max()))
        return ShardBounds(span(queries.positions), span(own.positions), span(queries.documents),
                           span(own.documents))


def _may_see(reader: ShardBounds, owner: ShardBounds, causal: bool, window: int | None) -> bool:
    """Whether some query of ``reader`` may see some key of ``owner`` (False only when the bounds prove it cannot)."""
    if reader.queries is None or owner.keys is None:
        return False
    (q_low, q_high), (k_low, k_high) = reader.queries, owner.keys
    if (causal or window is not None) and k_low > q_high:  # every key after every query
        return False
    if window is not None and q_low - k_high >= window:  # every key before every query's window
        return False
    if reader.query_ids is not None and owner.key_ids is not None:
        (a, b), (c, d) = reader.query_ids, owner.key_ids
        if b < c or d < a:  # no document in common
            return False
    return True


def visibility_graph(bounds: list[ShardBounds], causal: bool, window: int | None) -> list[list[int]]:
    """``sources[r]``: the other ranks whose shards rank r's queries may see, in rank order."""
    world = len(bounds)
    return [[s for s in range(world) if s != r and _may_see(bounds[r], bounds[s], causal, window)]
            for r in range(world)]


def direct_forward(queries: Queries, own: KeyShard, lengths: list[int], sources: list[list[int]], group,
                   timeout: timedelta | None):
    """``(out, lse, received shards by source rank)`` over the shards this rank's queries may see."""
    rank = dist.get_rank(group)
    q = queries.q
    b, h, t, _ = q.shape
    readers = [r for r, seen in enumerate(sources) if rank in seen]  # who reads this rank's shard
    incoming = {s: own.like(lengths[s]) for s in sources[rank]}
    wait = transfer({r: own.tensors() for r in readers}, {s: shard.tensors() for s, shard in incoming.items()},
                    group, timeout, f"a peer (sending its shard to ranks {readers}, receiving from {sorted(incoming)})")
    out, lse = nothing_seen((b, h, t), own.v.shape[3], q.dtype, q.device)  # [B, Hq, T_r, Dv], [B, Hq, T_r]
    if queries.sees(own):  # the own shard while the others travel
        merge_into(out, lse, *queries.at_step(rank).attend(own))
    wait()
    for source, shard in incoming.items():
        if queries.sees(shard):
            merge_into(out, lse, *queries.at_step(source).attend(shard))
    return out.to(q.dtype), lse, incoming


def direct_backward(queries: Queries, own: KeyShard, incoming: dict[int, KeyShard], out, lse, grad_out, grad_lse,
                    sources: list[list[int]], group, timeout: timedelta | None):
    """``(dq, dk, dv, d_table)``: each source's shard gets the gradient from this rank's queries, sent home; this
    rank's shard sums the gradients its readers send back."""
    rank = dist.get_rank(group)
    readers = [r for r, seen in enumerate(sources) if rank in seen]
    compute = compute_dtype(queries.q.dtype)
    dq = torch.zeros(queries.q.shape, dtype=compute, device=queries.q.device)
    dk = torch.zeros(own.k.shape, dtype=compute, device=own.k.device)
    dv = torch.zeros(own.v.shape, dtype=compute, device=own.v.device)
    d_table = None
    back = {}  # source rank -> [dK, dV] of its shard from this rank's queries
    for source, shard in [(rank, own)] + list(incoming.items()):
        if queries.sees(shard):
            g_q, g_k, g_v, *g_table = queries.at_step(source).gradients(shard, out, lse, grad_out, grad_lse)
            dq += g_q
            if g_table:
                d_table = g_table[0] if d_table is None else d_table + g_table[0]
        else:
            g_k, g_v = torch.zeros_like(shard.k), torch.zeros_like(shard.v)
        if source == rank:
            dk += g_k
            dv += g_v
        else:
            back[source] = [g_k.to(compute), g_v.to(compute)]
    returned = {r: [torch.empty(own.k.shape, dtype=compute, device=dk.device),
                    torch.empty(own.v.shape, dtype=compute, device=dv.device)] for r in readers}
    transfer(back, returned, group, timeout,
             f"a peer (sending gradients to ranks {sorted(back)}, receiving from {readers})")()
    for g_k, g_v in returned.values():
        dk += g_k
        dv += g_v
    return dq.to(queries.q.dtype), dk.to(own.k.dtype), dv.to(own.v.dtype), d_table


class DirectAttention(torch.autograd.Function):
    """Autograd through the direct exchange: forward by ``direct_forward``, backward by ``direct_backward``."""

    @staticmethod
    def forward(ctx, q, k, v, table, queries: Queries, own: KeyShard, lengths, sources, group, timeout):
        queries = queries.with_q(q.detach())
        own = KeyShard(k.detach(), v.detach(), own.positions, own.documents)
        out, lse, incoming = direct_forward(queries, own, lengths, sources, group, timeout)
        ctx.save_for_backward(out, lse)
        ctx.queries, ctx.own, ctx.incoming, ctx.rest = queries, own, incoming, (sources, group, timeout)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        out, lse = ctx.saved_tensors
        dq, dk, dv, d_table = direct_backward(ctx.queries, ctx.own, ctx.incoming, out, lse, grad_out, grad_lse,
                                              *ctx.rest)
        return dq, dk, dv, d_table, None, None, None, None, None, None
