"""Context parallelism end to end: one sequence split across processes, checked against one process.

Every rank builds the same sequence from ``--seed``, keeps its zigzag shard, runs ``context_parallel_attention``
forward and backward, and the shards of the output, lse and gradients are gathered back into sequence order.
Rank 0 then runs ``engine.causal_attention`` on the whole sequence in one process (same dtype and device) and
prints the largest difference of each, the time and each rank's peak memory. Every rank exits 1 when a
difference exceeds its tolerance.

    torchrun --standalone --nproc-per-node 2 examples/context_parallel.py              # 2 ranks, gloo on CPU
    torchrun --standalone --nproc-per-node 3 examples/context_parallel.py --window 256 --documents 3
    torchrun --standalone --nproc-per-node 8 examples/context_parallel.py --device cuda  # nccl, one GPU per rank
    python examples/context_parallel.py                                                # a world of 1

See docs/DISTRIBUTED.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import causal_attention, document_mask, window_mask  # noqa: E402
from engine.distributed import METHODS, context_parallel_attention, zigzag_indices, zigzag_unshard  # noqa: E402
from lab.measure import PeakMemory  # noqa: E402

DTYPES = {"float64": torch.float64, "float32": torch.float32}
NAMES = ("out", "lse", "dq", "dk", "dv")  # what is compared, in this order


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=1024, help="tokens in the sequence (T = S)")
    parser.add_argument("--window", type=int, default=None, help="sliding window: keys seen, own included")
    parser.add_argument("--documents", type=int, default=None,
                        help="pack this many documents (boundaries drawn from --seed); a query sees its own only")
    parser.add_argument("--method", choices=METHODS, default="ring", help="how K/V reach every rank")
    parser.add_argument("--batch", type=int, default=1, help="B")
    parser.add_argument("--heads", type=int, default=8, help="query heads Hq")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads Hkv (a divisor of Hq)")
    parser.add_argument("--head-dim", type=int, default=64, help="D = Dv")
    parser.add_argument("--dtype", choices=DTYPES, default="float64", help="of the run and of the reference")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: backend gloo; cuda: backend nccl, GPU LOCAL_RANK for each rank")
    parser.add_argument("--seed", type=int, default=0, help="the sequence and the upstream gradients")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="process-group timeout in seconds: a rank that waits longer on another fails")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args(argv)
    if args.length < 1:
        parser.error(f"--length must be at least 1, got {args.length}")
    return args


def init_distributed(device_kind: str, timeout: float) -> torch.device:
    """Join the process group (under torchrun), or make a world of 1 (plain ``python``); returns this rank's
    device. Always with a timeout: a dead rank makes the others fail after ``timeout`` seconds, not hang."""
    backend = "nccl" if device_kind == "cuda" else "gloo"
    if device_kind == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is available")
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)  # before any collective: rank r's NCCL calls run on GPU local_rank
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if "RANK" in os.environ:  # torchrun (or another launcher) set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    else:  # plain python: a world of 1 on an in-memory store, no network
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout))
    return device


def document_ids(length: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Int64 ``[L]``: ``count`` contiguous documents, their ``count - 1`` boundaries drawn at random."""
    if not 1 <= count <= max(length, 1):
        raise SystemExit(f"--documents must be between 1 and --length ({length}), got {count}")
    starts = torch.randperm(length - 1, generator=generator)[: count - 1] + 1  # first token of documents 1..
    ids = torch.zeros(length, dtype=torch.int64)
    ids[starts] = 1
    return ids.cumsum(0)  # [L]: 0 0 0 1 1 2 ...


def make_sequence(args: argparse.Namespace) -> dict[str, torch.Tensor | None]:
    """The whole sequence and its upstream gradients, identical on every rank (CPU, from ``--seed``)."""
    g = torch.Generator().manual_seed(args.seed)
    b, hq, hkv, t, d, dtype = args.batch, args.heads, args.kv_heads, args.length, args.head_dim, DTYPES[args.dtype]
    seq = {
        "q": torch.randn(b, hq, t, d, generator=g, dtype=dtype),  # [B, Hq, T, D]
        "k": torch.randn(b, hkv, t, d, generator=g, dtype=dtype),  # [B, Hkv, S, D]
        "v": torch.randn(b, hkv, t, d, generator=g, dtype=dtype),  # [B, Hkv, S, Dv]
        "grad_out": torch.randn(b, hq, t, d, generator=g, dtype=dtype),  # [B, Hq, T, Dv]
        "grad_lse": torch.randn(b, hq, t, generator=g, dtype=dtype),  # [B, Hq, T]
        "positions": torch.arange(t),  # [T]
    }
    seq["documents"] = None if args.documents is None else document_ids(t, args.documents, g)  # [T]
    return seq


def run_shard(seq: dict, rank: int, world: int, args: argparse.Namespace, device: torch.device) -> dict:
    """This rank's zigzag shard through ``context_parallel_attention`` forward and backward: the out, lse and
    gradients of the shard, with its timings and peak memory."""
    index = zigzag_indices(args.length, rank, world)  # [T_r]: chunks r and 2P-1-r
    q, k, v = (seq[name][:, :, index].to(device).requires_grad_(True) for name in ("q", "k", "v"))
    grad_out, grad_lse = seq["grad_out"][:, :, index].to(device), seq["grad_lse"][:, :, index].to(device)
    docs = None if seq["documents"] is None else seq["documents"][index].to(device)  # [T_r]
    positions = index.to(device)  # global positions: what places the shard in the sequence

    def forward():
        return context_parallel_attention(q, k, v, positions, positions, window=args.window, method=args.method,
                                          query_document_ids=docs, key_document_ids=docs, return_lse=True)

    def backward(out, lse):  # loss = sum(out * grad_out) + sum(lse * grad_lse); every rank must call it
        torch.autograd.backward([out, lse], [grad_out, grad_lse])

    def step():
        backward(*forward())

    peak = measure_peak(step, device)  # also the warm-up
    for x in (q, k, v):
        x.grad = None
    dist.barrier()
    start = now(device)
    out, lse = forward()
    middle = now(device)
    backward(out, lse)
    end = now(device)
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "tokens": len(index),
            "forward_s": middle - start, "backward_s": end - middle, "peak_bytes": peak}


def now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def measure_peak(fn, device: torch.device) -> int:
    """Peak bytes allocated during ``fn()`` above the level before it (the rank's shard inputs excluded): CUDA's
    allocator statistics on a GPU, the C heap sampled every 0.2 ms on CPU (``lab.measure.PeakMemory``;
    not the profiler, whose memory events under gloo made a rank abort at exit now and then, torch 2.13)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with PeakMemory() as peak:
        fn()
    return peak.extra_bytes


def gather(shard: torch.Tensor, length: int, world: int) -> torch.Tensor:
    """Every rank's zigzag shard (sequence on dim 2) back in sequence order: padded to the longest shard for
    ``all_gather`` (shards differ by up to 2 tokens when ``2P`` does not divide ``length``), cut back, unsharded."""
    lengths = [len(zigzag_indices(length, r, world)) for r in range(world)]
    pad = [0, 0] * (shard.dim() - 3) + [0, max(lengths) - shard.shape[2]]
    padded = F.pad(shard.detach(), pad).contiguous()
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded)
    return zigzag_unshard([p.narrow(2, 0, n) for p, n in zip(pieces, lengths)], dim=2)


def single_process(seq: dict, args: argparse.Namespace, device: torch.device) -> dict:
    """The reference: ``engine.causal_attention`` on the whole sequence in this one process (rank 0's device),
    forward and backward, with the same masks given as ``allowed``."""
    q, k, v = (seq[name].to(device).requires_grad_(True) for name in ("q", "k", "v"))
    positions = seq["positions"].to(device)  # [T]
    allowed = None if args.window is None else window_mask(positions, positions, args.window)
    if seq["documents"] is not None:
        docs = document_mask(seq["documents"].to(device))
        allowed = docs if allowed is None else allowed & docs
    start = now(device)
    out, lse = causal_attention(q, k, v, positions, positions, allowed, return_lse=True)
    middle = now(device)
    torch.autograd.backward([out, lse], [seq["grad_out"].to(device), seq["grad_lse"].to(device)])
    end = now(device)
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "forward_s": middle - start, "backward_s": end - middle}


def compare(gathered: dict, reference: dict, dtype: torch.dtype, length: int) -> list[tuple[str, float, float]]:
    """``(name, max |difference|, tolerance)`` of each compared tensor. Both sides are exact in real arithmetic
    and round differently (the ring merges P partial results by log-sum-exp; gradients are summed in another
    order), so the tolerance is roundoff of sums of ``length`` terms: ``8 eps sqrt(T) max(1, max |reference|)``."""
    rows = []
    for name in NAMES:
        ours, theirs = gathered[name].cpu(), reference[name].cpu()
        diff = (ours - theirs).abs().max().item() if ours.numel() else 0.0
        scale = max(1.0, theirs.abs().max().item() if theirs.numel() else 1.0)
        rows.append((name, diff, 8 * torch.finfo(dtype).eps * math.sqrt(max(length, 1)) * scale))
    return rows


def describe(args: argparse.Namespace, world: int, device: torch.device, seq: dict) -> str:
    tokens = " + ".join(str(len(zigzag_indices(args.length, r, world))) for r in range(world))
    masks = "causal"
    if args.window is not None:
        masks += f", window {args.window}"
    if seq["documents"] is not None:
        lengths = torch.bincount(seq["documents"]).tolist()
        masks += f", {args.documents} documents ({', '.join(map(str, lengths))} tokens)"
    return (f"context_parallel_attention: {world} rank{'s' * (world > 1)} ({dist.get_backend()}, {device.type}), "
            f"method {args.method}, zigzag shards of {tokens} tokens\n"
            f"sequence: B={args.batch} Hq={args.heads} Hkv={args.kv_heads} T=S={args.length} D={args.head_dim} "
            f"{args.dtype}, {masks}, seed {args.seed}")


def report(rows: list, ranks: list[dict], reference: dict, args: argparse.Namespace) -> bool:
    """Rank 0's printout; True when every difference is within its tolerance."""
    print(f"difference from single-process engine.causal_attention on the whole sequence ({args.dtype}):")
    print(f"  {'':4} {'max |diff|':>10} {'tolerance':>10}")
    for name, diff, tolerance in rows:
        print(f"  {name:4} {diff:10.1e} {tolerance:10.1e}")
    name, diff, _ = max(rows, key=lambda row: row[1])
    ok = all(d <= tol for _, d, tol in rows)
    print(f"max difference: {diff:.1e} ({name}), within tolerance: {'yes' if ok else 'NO'}")
    slowest = max(ranks, key=lambda r: r["forward_s"] + r["backward_s"])
    print(f"time (slowest rank): forward {slowest['forward_s'] * 1e3:.1f} ms, backward "
          f"{slowest['backward_s'] * 1e3:.1f} ms; single process: forward {reference['forward_s'] * 1e3:.1f} ms, "
          f"backward {reference['backward_s'] * 1e3:.1f} ms")
    memory = ", ".join(f"rank {r}: {info['peak_bytes'] / 2**20:.1f} MiB" for r, info in enumerate(ranks))
    print(f"peak memory of forward + backward, per rank (above its inputs): {memory}")
    return ok


@record  # under torchrun, a failing rank's traceback is reported by the launcher
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = init_distributed(args.device, args.timeout)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        seq = make_sequence(args)
        if rank == 0:
            print(describe(args, world, device, seq), flush=True)
        result = run_shard(seq, rank, world, args, device)
        gathered = {name: gather(result[name], args.length, world) for name in NAMES}
        timings = {key: result[key] for key in ("tokens", "forward_s", "backward_s", "peak_bytes")}
        ranks: list[dict] = [{} for _ in range(world)]
        dist.all_gather_object(ranks, timings)
        verdict = [True]
        if rank == 0:
            reference = single_process(seq, args, device)
            verdict[0] = report(compare(gathered, reference, DTYPES[args.dtype], args.length), ranks, reference, args)
        dist.broadcast_object_list(verdict, src=0)  # every rank exits with rank 0's verdict
        return 0 if verdict[0] else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
