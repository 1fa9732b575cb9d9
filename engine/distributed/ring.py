"""Ring attention: K/V shards travel round the ranks while each rank attends its queries to the one it holds.

Step s of P: rank r holds the shard of rank ``r - s`` (mod P). It posts the send of that shard to ``r + 1`` and
the receive of the next one from ``r - 1`` (non-blocking), computes its queries' attention against the shard
it holds (skipped when positions prove that no query sees it), merges it into the running result by
log-sum-exp (so a rank holds one output, not P), then waits. Only the Hkv heads travel (GQA), with their
positions and document ids.

Backward: the shards travel round again with their dK/dV accumulators. At each step a rank posts the move of the
K/V shard it holds, adds its queries' share of that shard's gradient to the accumulator while the shard travels
(from the merged output and lse, recomputing the weights), then sends the accumulator after it; after P steps
every accumulator is back home with the sum over all ranks.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from engine.distributed.shard import KeyShard, Queries
from engine.distributed.transport import transfer
from engine.kernels.common import compute_dtype, nothing_seen
from engine.kernels.merge import merge_into


def _exchange(tensors: list[torch.Tensor], buffers: list[torch.Tensor], group, timeout: timedelta | None):
    """Post sends of ``tensors`` to the next rank and receives into ``buffers`` from the previous; returns a
    function that waits for all of them and returns ``buffers`` (engine.distributed.transport)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    after, before = (rank + 1) % world, (rank - 1) % world
    wait = transfer({after: tensors}, {before: buffers}, group, timeout,
                    f"the ring (sending to rank {after}, receiving from rank {before})")
    return lambda: wait()[before]


def ring_forward(queries: Queries, own: KeyShard, lengths: list[int], group, timeout: timedelta | None):
    """``(out [B, Hq, T_r, Dv] in q's dtype, lse [B, Hq, T_r] in the compute dtype)`` over every rank's keys."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q = queries.q
    b, h, t, _ = q.shape
    compute = compute_dtype(q.dtype)
    out = lse = None  # the merge so far: the first part seen becomes it (no zeros held beside it)
    shard = own
    for step in range(world):
        wait = None
        if step < world - 1:  # the next shard is on its way while this one is computed
            incoming = own.like(lengths[(rank - step - 1) % world])
            wait = _exchange(shard.tensors(), incoming.tensors(), group, timeout)
        if queries.sees(shard):
            part_out, part_lse = queries.at_step(step).attend(shard)
            if out is None:
                out, lse = part_out.to(compute), part_lse.to(compute)
            else:
                merge_into(out, lse, part_out, part_lse)  # exact, running, in place
            del part_out, part_lse
        if wait is not None:
            shard = incoming.from_tensors(wait())
    if out is None:  # no query here sees any key: 0 and -inf
        out, lse = nothing_seen((b, h, t), own.v.shape[3], q.dtype, q.device)
    return out.to(q.dtype), lse


def ring_backward(queries: Queries, own: KeyShard, out, lse, grad_out, grad_lse, lengths: list[int], group,
                  timeout: timedelta | None):
    """``(dq, dk, dv, d_table)`` of this rank's q and its own K/V shard, summed over every rank's queries, and of a
    learned bias table from this rank's rows (None without one: it stays on its rank, as q's gradient does)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    compute = compute_dtype(queries.q.dtype)
    dq = torch.zeros(queries.q.shape, dtype=compute, device=queries.q.device)  # [B, Hq, T_r, D]
    shard = own
    dk = torch.zeros(own.k.shape, dtype=compute, device=own.k.device)  # [B, Hkv, S, D] of the shard held
    dv = torch.zeros(own.v.shape, dtype=compute, device=own.v.device)  # [B, Hkv, S, Dv]
    d_table = None
    for step in range(world):
        last = step == world - 1  # the last move takes only dK/dV home: the owner has its K/V
        source = (rank - step - 1) % world
        shard_wait = None
        if world > 1 and not last:  # the next K/V shard travels while this one's gradients are computed
            incoming = own.like(lengths[source])
            shard_wait = _exchange(shard.tensors(), incoming.tensors(), group, timeout)
        if queries.sees(shard):
            g_q, g_k, g_v, *g_table = queries.at_step(step).gradients(shard, out, lse, grad_out, grad_lse)
            dq += g_q
            dk += g_k
            dv += g_v
            if g_table:  # (a learned RelativePositionBias: tiled_backward's fourth gradient)
                d_table = g_table[0] if d_table is None else d_table + g_table[0]
        if world > 1:  # the accumulators follow their shard; after `world` moves they are home
            grads_in = [torch.empty((*dk.shape[:2], lengths[source], dk.shape[3]), dtype=compute, device=dk.device),
                        torch.empty((*dv.shape[:2], lengths[source], dv.shape[3]), dtype=compute, device=dv.device)]
            dk, dv = _exchange([dk, dv], grads_in, group, timeout)()
            if shard_wait is not None:
                shard = incoming.from_tensors(shard_wait())
    return dq.to(queries.q.dtype), dk.to(own.k.dtype), dv.to(own.v.dtype), d_table


class RingAttention(torch.autograd.Function):
    """Autograd through the ring: forward by ``ring_forward``, backward by ``ring_backward``."""

    @staticmethod
    def forward(ctx, q, k, v, table, queries: Queries, own: KeyShard, lengths, group, timeout):
        # table: a learned RelativePositionBias's table (or None), an input so that its gradient reaches it
        queries = queries.with_q(q.detach())
        own = KeyShard(k.detach(), v.detach(), own.positions, own.documents)
        out, lse = ring_forward(queries, own, lengths, group, timeout)
        ctx.save_for_backward(out, lse)
        ctx.queries, ctx.own, ctx.rest = queries, own, (lengths, group, timeout)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        out, lse = ctx.saved_tensors
        dq, dk, dv, d_table = ring_backward(ctx.queries, ctx.own, out, lse, grad_out, grad_lse, *ctx.rest)
        return dq, dk, dv, d_table, None, None, None, None, None
