"""The worker side of ``run.py bench cp`` (lab.bench.cp): what each rank measures, how it counts the
bytes it sends, and the formula those counts are checked against (stated in lab.bench.cp's docstring)."""

from __future__ import annotations

import os
import statistics
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine import causal_attention, window_mask
from engine.distributed import context_parallel_attention, zigzag_indices
from engine.distributed.direct import ShardBounds, visibility_graph
from lab.measure import peak_allocated_bytes

METHODS = ("ring", "allgather", "direct")
MASKS = ("causal", "window")
POSITION_BYTES = 8  # int64 positions travel with every K/V shard
ACCUMULATOR_BYTES = 4  # the ring's dK/dV accumulators are fp32 (compute dtype) for fp32 inputs


class SentBytes:
    """Bytes this rank sends, counted by wrapping ``dist.isend``, ``dist.all_gather``, ``dist.all_reduce`` and
    ``dist.reduce_scatter`` (the attention's only transfers; see the formula in the module docstring)."""

    def __init__(self) -> None:
        self.total = 0
        isend, all_gather, all_reduce = dist.isend, dist.all_gather, dist.all_reduce
        reduce_scatter = dist.reduce_scatter

        def counted_isend(tensor, *rest, **options):
            self.total += _nbytes(tensor)
            return isend(tensor, *rest, **options)

        def counted_all_gather(pieces, tensor, *rest, **options):
            self.total += (len(pieces) - 1) * _nbytes(tensor)
            return all_gather(pieces, tensor, *rest, **options)

        def counted_all_reduce(tensor, *rest, **options):
            world = dist.get_world_size(options.get("group"))
            self.total += _ring_all_reduce_bytes(_nbytes(tensor), world)
            return all_reduce(tensor, *rest, **options)

        def counted_reduce_scatter(output, pieces, *rest, **options):  # every piece but its own, once
            self.total += sum(_nbytes(p) for p in pieces) - _nbytes(output)
            return reduce_scatter(output, pieces, *rest, **options)

        dist.isend, dist.all_gather, dist.all_reduce = counted_isend, counted_all_gather, counted_all_reduce
        dist.reduce_scatter = counted_reduce_scatter


class ShardCalls:
    """How many K/V shards the ring computed against: calls of ``Queries.attend`` in this process."""

    def __init__(self) -> None:
        from engine.distributed import shard

        self.count = 0
        attend = shard.Queries.attend

        def counted_attend(queries, key_shard):
            self.count += 1
            return attend(queries, key_shard)

        shard.Queries.attend = counted_attend


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _ring_all_reduce_bytes(nbytes: int, world: int) -> int:
    """What one rank sends in a ring all-reduce of ``nbytes``: reduce-scatter then all-gather, ``2 (P-1) / P``."""
    return 2 * (world - 1) * nbytes // world


def worker(rank: int, world: int, store: str, s: dict[str, Any], plan, messages) -> None:
    """One rank: for each ``(P, configs)`` of the plan, measure with the group of ranks ``0 .. P-1`` (their
    collectives time out after ``--timeout``) or, outside it, wait for them (the world's barrier times out at
    the deadline, when the parent kills every worker anyway)."""
    torch.set_num_threads(s["threads"])
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=max(s["deadline"], s["timeout"])))
    try:
        groups = {p: dist.new_group(list(range(p)), timeout=timedelta(seconds=s["timeout"])) for p, _ in plan}
        sent, calls = SentBytes(), ShardCalls()
        for p, configs in plan:
            for mask, method in configs if rank < p else []:
                messages.put(("row", measure(rank, p, groups[p], s, mask, method, sent, calls)))
                if rank == 0:
                    messages.put(("step", f"P={p} {mask} {method}"))
            dist.barrier()  # the world: every rank moves to the next P together
    except Exception:
        print(f"rank {rank} of {world}:\n{traceback.format_exc()}", flush=True)
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    # torch 2.13's profiler (peak_allocated_bytes) beside gloo sometimes aborts in C++ teardown at interpreter exit
    # ("terminate called without an active exception"), after all the work is done: flush the results to the
    # parent and leave without that teardown.
    messages.close()
    messages.join_thread()
    os._exit(0)


def shard_positions(mask: str, s: dict[str, Any], rank: int, world: int) -> torch.Tensor:
    """Int64 ``[T_r]``: the sequence indices rank ``rank`` holds (queries and keys alike)."""

    if mask == "causal" or s["window_layout"] == "zigzag":
        return zigzag_indices(s["length"], rank, world)
    return torch.tensor_split(torch.arange(s["length"]), world)[rank]


def visible_shards(query_positions: torch.Tensor, shards: list[torch.Tensor], window: int | None) -> int:
    """How many key shards hold a key some query sees (``k <= q``, and ``q - k < window``), exactly."""
    count = 0
    for keys in shards:
        keys = keys.sort().values
        newest = torch.searchsorted(keys, query_positions, right=True)  # keys <= q: keys[:newest]
        oldest = torch.zeros_like(newest) if window is None else torch.searchsorted(keys, query_positions - window,
                                                                                      right=True)
        count += bool((newest > oldest).any())
    return count


def measure(rank: int, world: int, group, s: dict[str, Any], mask: str, method: str, sent: SentBytes,
            calls: ShardCalls) -> dict[str, Any]:
    """One rank's row for one (mask, method) on ``group`` (``world`` ranks): times, memory, bytes sent (counted
    and by the formula)."""
    call, inputs, grad_out = _problem(rank, world, group, s, mask, method)
    window = s["window"] if mask == "window" else None

    def forward():
        with torch.no_grad():
            return call()

    phase = {}

    def train():
        for x in inputs:
            x.grad = None
        out = call()
        phase["forward"] = sent.total
        out.backward(grad_out)

    dist.barrier(group=group)
    sent.total, calls.count = 0, 0
    forward_alloc = peak_allocated_bytes(forward)
    forward_bytes, computed = sent.total, calls.count
    dist.barrier(group=group)
    sent.total = 0
    train_alloc = peak_allocated_bytes(train)
    backward_bytes = sent.total - phase["forward"]
    own = sum(_nbytes(x) for x in inputs)  # this rank's q, k, v
    everyone = [shard_positions(mask, s, r, world) for r in range(world)]
    lengths = [len(x) for x in everyone]
    expected = expected_bytes(method, rank, lengths, s, everyone, window)
    positions = everyone[rank]
    return {"mask": mask, "method": method, "P": world, "rank": rank, "T_r": len(positions),
            "fwd ms": _median_ms(forward, s["repeats"], group), "train ms": _median_ms(train, s["repeats"], group),
            "fwd MiB": (own + forward_alloc) / 2**20, "train MiB": (own + train_alloc) / 2**20,
            "fwd alloc MiB": forward_alloc / 2**20, "train alloc MiB": train_alloc / 2**20,
            "sent fwd": forward_bytes, "formula fwd": expected[0], "sent bwd": backward_bytes,
            "formula bwd": expected[1], "sent fwd MiB": forward_bytes / 2**20, "sent bwd MiB": backward_bytes / 2**20,
            "exact": None if method == "single" else (forward_bytes, backward_bytes) == expected,
            "computed": computed if method == "ring" and world > 1 else None,
            "visible": visible_shards(positions, everyone, window) if method == "ring" else None}


def _problem(rank: int, world: int, group, s: dict[str, Any], mask: str, method: str):
    """``(call, (q, k, v), grad_out)`` for this rank: its shards of one random sequence (the same seed on every
    rank) and a function that runs the method on them."""

    generator = torch.Generator().manual_seed(s["seed"])
    b, t, d = s["batch"], s["length"], s["head_dim"]
    full = [torch.randn(b, h, t, d, generator=generator) for h in (s["heads"], s["kv_heads"], s["kv_heads"])]
    grad_full = torch.randn(b, s["heads"], t, d, generator=generator)  # [B, Hq, T, D]
    positions = torch.arange(t) if method == "single" else shard_positions(mask, s, rank, world)  # [T_r]
    q, k, v = (x.index_select(2, positions).requires_grad_(True) for x in full)  # [B, H, T_r, D] each
    grad_out = grad_full.index_select(2, positions)  # [B, Hq, T_r, D]
    del full, grad_full
    window = s["window"] if mask == "window" else None
    if method == "single":
        allowed = None if window is None else window_mask(positions, positions, window)
        call = lambda: causal_attention(q, k, v, positions, positions, allowed)
    else:
        timeout = timedelta(seconds=s["timeout"])
        call = lambda: context_parallel_attention(q, k, v, positions, positions, group=group, window=window,
                                                  method=method, timeout=timeout)
    return call, (q, k, v), grad_out


def _median_ms(fn, repeats: int, group) -> float:
    """Median wall time of ``fn()`` (already warmed up), each run started on every rank at once (a barrier)."""
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def expected_bytes(method: str, rank: int, lengths: list[int], s: dict[str, Any],
                   positions: list[torch.Tensor] | None = None, window: int | None = None) -> tuple[int, int]:
    """``(forward, backward)`` bytes rank ``rank`` sends, by the formula of the module docstring (fp32);
    ``positions``: every rank's (direct: who reads whose shard)."""
    world, b, h, d, e = len(lengths), s["batch"], s["kv_heads"], s["head_dim"], 4
    if world == 1 or method == "single":
        return 0, 0
    shard = lambda n: 2 * b * h * n * d * e + POSITION_BYTES * b * n
    held = [lengths[(rank - step) % world] for step in range(world)]  # the shard rank holds at each step
    if method == "ring":
        forward = sum(shard(n) for n in held[:-1])
        backward = sum(shard(n) for n in held[:-1]) + sum(2 * b * h * n * d * ACCUMULATOR_BYTES for n in held)
        return forward, backward
    if method == "direct":
        spans = [(int(x.min()), int(x.max())) if len(x) else None for x in positions]
        sources = visibility_graph([ShardBounds(span, span, None, None) for span in spans], True, window)
        readers = [r for r in range(world) if rank in sources[r]]
        return (len(readers) * shard(lengths[rank]),
                sum(2 * b * h * lengths[src] * d * ACCUMULATOR_BYTES for src in sources[rank]))
    piece = b * h * max(lengths) * d * e  # one rank's slice of dK (or dV), padded to the longest
    return (world - 1) * shard(max(lengths)), 2 * (world - 1) * piece


# --- results ------------------------------------------------------------------------------------------------------


