"""``context_parallel_attention``: one sequence split across processes, every mask exact.

Each rank holds a shard of the queries and a shard of the keys/values, each with its own positions (and
document ids). The result is ``causal_attention`` over the whole sequence (every rank's shards concatenated
in rank order, along T and along S, same positions, window and documents), restricted to this rank's query
rows. Shards need not be contiguous nor of equal length: positions say where each token is, so a load-balanced
layout (``zigzag_indices``) is a choice of positions, not a special case.

The transport is ``torch.distributed`` (gloo on CPU, nccl on GPU), set up by the caller, usually through
``torchrun``; always give ``init_process_group`` a ``timeout`` so a dead rank makes the others fail instead of
waiting 30 minutes. Every rank must make the same calls (forward and backward) in the same order.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from engine.distributed.allgather import depends_on_gathered, gather_shards
from engine.distributed.direct import DirectAttention, ShardBounds, visibility_graph
from engine.distributed.ring import RingAttention
from engine.distributed.shard import KeyShard, Queries
from engine.inputs import prepare_inputs, resolve_positions
from engine.kernels.sinks import apply_sinks
from engine.masks.window import check_window
from engine.relative_bias import RelativePositionBias

METHODS = ("auto", "ring", "allgather", "direct")
# Options every rank must pass identically, and the shapes every rank's shard must share.
_SAME_ON_EVERY_RANK = ("B", "Hq", "Hkv", "D", "Dv", "dtype", "device", "causal", "window", "scale", "softcap",
                       "method", "documents", "sinks", "alibi_slopes", "bias", "score_mod", "dropout")


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    *,
    group=None,
    window: int | None = None,
    query_document_ids: torch.Tensor | None = None,
    key_document_ids: torch.Tensor | None = None,
    causal: bool = True,
    softcap: float | None = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    bias: RelativePositionBias | torch.Tensor | None = None,
    score_mod=None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    return_lse: bool = False,
    method: str = "auto",
    timeout: timedelta | None = None,
):
    """Attention of this rank's queries over every rank's keys.

    Args:
        q, k, v: this rank's shards ``[B, Hq, T_r, D]``, ``[B, Hkv, S_r, D]``, ``[B, Hkv, S_r, Dv]`` (T_r or S_r
            may be 0: a rank with no queries still passes its keys on).
        query_positions, key_positions: this rank's global positions, ``[T_r]`` / ``[B, T_r]`` and ``[S_r]`` /
            ``[B, S_r]`` (required: they are what places the shards in the sequence).
        group: a ``torch.distributed`` process group (default: the world).
        window: sliding window (engine convention: ``window`` keys, own included).
        query_document_ids, key_document_ids: packed documents, this rank's ids (both or neither).
        causal, softcap, scale: as in ``causal_attention`` (scale defaults to ``1 / sqrt(D)``).
        sinks: ``[Hq]`` attention sinks (gpt-oss), the same on every rank: they join each row once, after the merge
            of every shard (not once per shard). Their gradient on a rank covers its own rows: all-reduce it across
            the group as for any replicated parameter (DDP does).
        alibi_slopes: ``[Hq]`` or ``[B, Hq]``, the same on every rank: the bias of each shard comes from the global
            positions, so every shard's scores are exact.
        bias: a ``RelativePositionBias`` (T5's bucketed bias, from positions: exact per shard; a learned table's
            gradient on a rank covers its rows, all-reduce it as for sinks), or this rank's rows of a dense bias,
            ``[B|1, Hq|1, T_r, S_total]`` whose last axis is the global key position (each shard's columns are
            cut from it; its gradient is this rank's own). With a dense bias the key positions must be the same
            in every batch row.
        score_mod: ``(score, batch, head, query_pos, key_pos) -> score`` on global positions; every rank must pass
            the same function (it cannot be compared across processes).
        dropout_p, generator: attention dropout. The seed is drawn once per call from ``generator`` (every rank's
            must be in the same state: the seeds are compared) and the pattern hashes global positions, so it is
            the pattern one process draws for the whole sequence with the same generator state (where its query
            and key indices are the positions), whatever the sharding. Positions must be the same in every row.
        return_lse: also return the lse ``[B, Hq, T_r]`` (compute dtype).
        method: ``"auto"`` (default: ``direct`` where the bounds show that some rank's queries cannot see some
            other rank's keys, as with a window or documents, else ``ring``), ``"ring"`` (K/V shards travel round,
            compute overlaps the transfer, invisible shards are skipped),
            ``"allgather"`` (K/V gathered once, one local call: fewer, larger messages) or ``"direct"`` (each
            shard sent only to the ranks whose queries may see it, decided from every rank's position and id
            bounds: a window's neighbours; engine.distributed.direct).
        timeout: bound on each wait of the ring (default: the process group's timeout).

    Returns ``out [B, Hq, T_r, Dv]`` (and ``lse``), equal to ``causal_attention`` on the whole sequence for these
    rows; gradients flow to q, k and v of every rank.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("context_parallel_attention needs torch.distributed initialised "
                         "(torch.distributed.init_process_group(..., timeout=...), e.g. under torchrun)")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if query_positions is None or key_positions is None:
        raise ValueError("query_positions and key_positions are required: they place this rank's shards in the "
                         "sequence (see engine.distributed.zigzag_indices)")
    if (query_document_ids is None) != (key_document_ids is None):
        raise ValueError("give both query_document_ids and key_document_ids, or neither")
    check_window(window)
    dense = isinstance(bias, torch.Tensor)
    if bias is not None and not dense and not isinstance(bias, RelativePositionBias):
        raise ValueError(f"bias must be a RelativePositionBias or a dense tensor [B|1, Hq|1, T_r, S_total], got "
                         f"{type(bias).__name__}")
    if dense and bias.dim() != 4:
        raise ValueError(f"a dense bias must be 4-D [B|1, Hq|1, T_r, S_total] (this rank's rows, every key's column), "
                         f"got shape {list(bias.shape)}")
    modifiers = {name: x for name, x in (("alibi_slopes", alibi_slopes), ("bias", bias), ("score_mod", score_mod))
                 if x is not None}
    checked = {**modifiers, "bias": bias.narrow(-1, 0, min(k.shape[2], bias.shape[-1]))} if dense else modifiers
    inputs = prepare_inputs(q, k, v, query_positions, key_positions, None, scale, causal=causal, softcap=softcap,
                            sinks=sinks, dropout_p=dropout_p, generator=generator,
                            **checked)  # (the modifiers validated like any call's; a dense bias's shape)
    dropout = (float(dropout_p), inputs.modifiers.dropout_seed) if dropout_p else None  # one seed for the call
    batch, t, s = q.shape[0], q.shape[2], k.shape[2]
    queries = Queries(q, inputs.query_positions, _ids(query_document_ids, batch, t, q.device, "query_document_ids"),
                      window, causal, softcap, inputs.scale, modifiers=modifiers, dropout=dropout)
    own = KeyShard(k, v, inputs.key_positions.contiguous(),
                   _ids(key_document_ids, batch, s, q.device, "key_document_ids"))
    world = dist.get_world_size(group)
    everyone = _check_ranks(queries, own, method, sinks, modifiers, group)
    lengths = [theirs["S"] for theirs in everyone]  # S_r of every rank
    if dense:
        _check_dense_bias(bias, own, sum(lengths))
    if dropout is not None:
        _check_same_rows(queries.positions, own.positions, "attention dropout (its pattern hashes them)")
    sources = visibility_graph([theirs["bounds"] for theirs in everyone], causal, window)
    if method == "auto":  # every rank decides alike: the same bounds on every rank
        method = "direct" if sum(map(len, sources)) < world * (world - 1) else "ring"
    if world == 1:
        out, lse = queries.plan_for(own).run(q, k, v, return_lse=True)  # (the plan keeps the call's dropout seed)
    elif method in ("ring", "direct"):
        learned = bias if dense else (bias.table if bias is not None else None)
        table = learned if learned is not None and learned.requires_grad else None
        if method == "ring":
            out, lse = RingAttention.apply(q, k, v, table, queries, own, lengths, group, timeout)
        else:
            out, lse = DirectAttention.apply(q, k, v, table, queries, own, lengths, sources, group, timeout)
    else:
        everything = gather_shards(own, k, v, lengths, group)
        out, lse = queries.plan_for(everything).run(q, everything.k, everything.v, return_lse=True)
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            out, lse = depends_on_gathered(out, lse, everything)
    if sinks is not None:  # once per row, after every shard's part is merged
        out, lse = apply_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out


def _ids(ids: torch.Tensor | None, batch: int, length: int, device, name: str) -> torch.Tensor | None:
    """Document ids as int64 ``[B, L]`` (validated like positions), or None."""
    if ids is None:
        return None
    return resolve_positions(ids, batch, length, 0, device, name).contiguous()


def _values(x: torch.Tensor | None):
    """A modifier tensor as plain numbers every rank can compare (None stays None)."""
    return None if x is None else tuple(x.detach().double().flatten().tolist())


def _check_same_rows(query_positions: torch.Tensor, key_positions: torch.Tensor, why: str) -> None:
    for name, positions in (("query", query_positions), ("key", key_positions)):
        if positions.numel() and bool((positions != positions[:1]).any()):
            raise ValueError(f"{why}: the {name} positions must be the same in every batch row")


def _check_dense_bias(bias: torch.Tensor, own: KeyShard, total: int) -> None:
    """A dense bias's columns are the global key positions: as many as every rank's keys, the same positions in
    every row."""
    if bias.shape[-1] != total:
        raise ValueError(f"a dense bias must have one column per key of the whole sequence (its last axis indexed by "
                         f"global key position): S_total = {total}, got {bias.shape[-1]}")
    positions = own.positions
    if positions.numel() and (bool((positions != positions[:1]).any()) or int(positions.min()) < 0
                              or int(positions.max()) >= total):
        raise ValueError(f"with a dense bias the key positions must be the same in every batch row and lie in "
                         f"[0, {total}) (they index its columns)")


def _bias_description(bias):
    """A RelativePositionBias as numbers every rank can compare (its table and its bucketing); a dense bias as its
    kind (its rows are each rank's own)."""
    if bias is None:
        return None
    if isinstance(bias, torch.Tensor):
        return ("dense", bias.requires_grad)
    return (_values(bias.table), bias.num_buckets, bias.max_distance, bias.bidirectional)


def _check_ranks(queries: Queries, own: KeyShard, method: str, sinks, modifiers: dict, group) -> list[dict]:
    """Every rank's description, compared: a ValueError on every rank names the rank that differs. Returns every
    rank's description (its number of keys ``S``, the ``bounds`` of its shards)."""
    q = queries.q
    mine = {"B": q.shape[0], "Hq": q.shape[1], "Hkv": own.k.shape[1], "D": q.shape[3], "Dv": own.v.shape[3],
            "dtype": str(q.dtype), "device": q.device.type, "causal": queries.causal, "window": queries.window,
            "scale": queries.scale, "softcap": queries.softcap, "method": method,
            "documents": queries.documents is not None, "S": own.k.shape[2], "sinks": _values(sinks),
            "alibi_slopes": _values(modifiers.get("alibi_slopes")), "bias": _bias_description(modifiers.get("bias")),
            "score_mod": "score_mod" in modifiers, "bounds": ShardBounds.of(queries, own),
            "dropout": queries.dropout}
    everyone: list[dict] = [{} for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather_object(everyone, mine, group=group)
    except RuntimeError as error:  # a rank died or never called: every other rank says so instead of hanging
        raise RuntimeError(f"context_parallel_attention: rank {dist.get_rank(group)} could not reach every rank of "
                           f"its group (one died, hung or skipped this call): {error}") from error
    first = everyone[0]
    for rank, theirs in enumerate(everyone):
        for key in _SAME_ON_EVERY_RANK:
            a, b = first[key], theirs[key]
            if a != b:
                raise ValueError(f"context_parallel_attention: rank {rank} has {key}={b!r} but rank 0 has {key}={a!r} "
                                 f"(every rank must pass the same {key})")
    return everyone
