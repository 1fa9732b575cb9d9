"""All-gather attention: every rank gathers all K/V shards (with positions and ids) once, then runs one local call.

Shards may differ in length: each is padded to the longest before ``all_gather`` and cut back after, so the
gathered keys are every rank's shard in rank order. Backward: each rank's gradient of the gathered K/V is summed
over ranks into the slice of the rank that owns it (``reduce_scatter``, each slice padded to the longest): a rank
sends ``(P - 1) / P`` of the gathered gradient, half of what an ``all_reduce`` of all of it moves (``2 (P - 1) / P``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.distributed.shard import KeyShard


def _gather(x: torch.Tensor, lengths: list[int], group) -> torch.Tensor:
    """Every rank's ``x [..., S_r, E]`` (sequence on dim 2 for K/V, dim 1 for ``[B, S_r]``) concatenated."""
    dim = 2 if x.dim() == 4 else 1
    longest = max(lengths)
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, longest - x.shape[dim]]
    padded = F.pad(x, pad).contiguous()
    pieces = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(pieces, padded, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(pieces, lengths)], dim=dim)


class _GatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, v, lengths, group):
        ctx.lengths, ctx.group = lengths, group
        return _gather(k, lengths, group), _gather(v, lengths, group)

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        rank, lengths = dist.get_rank(ctx.group), ctx.lengths
        longest = max(lengths)
        grads = []
        for grad in (grad_k, grad_v):  # [B, Hkv, S_total, E], this rank's queries' share
            pieces = [F.pad(piece, [0, 0, 0, longest - piece.shape[2]]).contiguous()
                      for piece in torch.split(grad, lengths, dim=2)]  # every rank's slice, [B, Hkv, longest, E]
            mine = torch.empty_like(pieces[0])
            dist.reduce_scatter(mine, pieces, group=ctx.group)  # the owner's slice, summed over every rank's queries
            grads.append(mine.narrow(2, 0, lengths[rank]))
        return grads[0], grads[1], None, None


class _DependsOn(torch.autograd.Function):
    """``(out, lse)`` unchanged, with ``k``/``v`` as inputs (zero gradient): every rank's backward reaches the
    gather's collective, even a rank whose queries saw nothing (or that has none)."""

    @staticmethod
    def forward(ctx, out, lse, k, v):
        ctx.shapes = (k, v)
        return out.view_as(out), lse.view_as(lse)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        k, v = ctx.shapes
        return grad_out, grad_lse, torch.zeros_like(k), torch.zeros_like(v)


def depends_on_gathered(out: torch.Tensor, lse: torch.Tensor, gathered: KeyShard):
    return _DependsOn.apply(out, lse, gathered.k, gathered.v)


def gather_shards(own: KeyShard, k: torch.Tensor, v: torch.Tensor, lengths: list[int], group) -> KeyShard:
    """All ranks' keys as one shard, K/V differentiable (``k``/``v`` are ``own``'s, with their autograd)."""
    k_all, v_all = _GatherKV.apply(k, v, lengths, group)  # [B, Hkv, S_total, D], [B, Hkv, S_total, Dv]
    documents = None if own.documents is None else _gather(own.documents, lengths, group)
    return KeyShard(k_all, v_all, _gather(own.positions, lengths, group), documents)
