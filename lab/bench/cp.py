"""``run.py bench cp``: context-parallel attention over P processes (gloo on CPU), ring vs all-gather.

This module runs the bench (processes, tables, plots); what each rank measures and counts is in cp_worker.py.

The bench starts ``max(P)`` worker processes (one torch thread each, gloo). For each P of ``--procs`` (default
1, 2, 4) ranks ``0 .. P-1`` form a process group and run every method (``ring``, ``allgather``) on every mask:
``causal`` with zigzag shards (load-balanced) and a sliding ``window`` with contiguous shards
(``--window-layout``); the other ranks wait in a barrier meanwhile, idle. Each rank of the group measures its own:

* median wall time of the forward (under ``no_grad``) and of forward + backward; a barrier starts the ranks
  together before every repeat, so a step lasts as long as its slowest rank;
* ``MiB``: its shards of q, k, v plus the peak that one call allocates (``peak_allocated_bytes``: every tensor,
  the output and the gradients included), as in ``bench scaling``;
* bytes sent, counted by wrapping ``torch.distributed.isend``, ``all_gather``, ``all_reduce`` and
  ``reduce_scatter`` inside the worker, beside the formula below (the table's ``exact`` column: counted ==
  formula, both phases);
* for the ring, the K/V shards its queries were computed against (``Queries.attend`` calls) beside the shards
  they can see (from positions, exactly).

The peer is ``causal_attention`` over the whole sequence with the same mask in one process (``method``
``single``, run by rank 0 while the others wait); ``x single`` columns divide by its time and memory.

Bytes sent by rank ``r`` of P (shard lengths ``L_0 .. L_{P-1}``, element size ``e``, fp32 accumulators, int64
positions; a collective counts what the bandwidth-optimal algorithm sends)::

    shard(L)        = 2 B Hkv L D e + 8 B L                 K and V with their positions
    ring forward    = sum_{s=0}^{P-2} shard(L_{r-s})        P-1 steps; each passes on the shard it holds
    ring backward   = sum_{s=0}^{P-2} shard(L_{r-s}) + sum_{s=0}^{P-1} 2 B Hkv L_{r-s} D 4
                                                            the dK/dV accumulators make P moves (the last
                                                            takes them home), the K/V shards P-1
    allgather fwd   = (P-1) shard(max L)                    every piece padded to the longest, sent to P-1 ranks
    allgather bwd   = 2 (P-1) B Hkv (max L) D e               reduce_scatter of the gathered dK and of dV: every
                                                            other rank's slice, padded to the longest
    direct fwd      = |readers(r)| shard(L_r)               its shard to each rank whose queries may see it
    direct bwd      = sum_{s in sources(r)} 2 B Hkv L_s D 4  dK/dV of each shard it read, home (fp32)
                                                            (readers / sources: engine.distributed.direct's
                                                            visibility graph from the shards' position bounds)

P = 1 sends nothing (one local call). Not counted: the rank check's ``all_gather_object`` (a pickled dict of a
few hundred bytes per call) and the barriers the bench adds.

    python run.py bench cp --quick        # seconds: T=512, P = 1, 2, 4
    python run.py bench cp                # T=8192, B=1, Hq=8, Hkv=2, D=64, fp32, window 512
"""

from __future__ import annotations

import argparse
import os
import queue as queue_mod
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from lab.bench.cp_model import model_main
from lab.bench.cp_worker import MASKS, METHODS, worker
from lab.measure import format_table, machine_info, progress, save_results
from lab.options import add_common, apply_threads, parse_count, parse_counts, positive_float, positive_int

QUICK = {"length": 512, "batch": 1, "heads": 4, "kv_heads": 2, "head_dim": 16, "window": 64}
FULL = {"length": 8192, "batch": 1, "heads": 8, "kv_heads": 2, "head_dim": 64, "window": 512}
TABLE = ["mask", "method", "P", "rank", "fwd ms", "train ms", "fwd MiB", "train MiB", "sent fwd MiB",
         "sent bwd MiB", "exact", "computed", "visible"]
SUMMARY = ["mask", "method", "P", "fwd ms", "train ms", "x single fwd", "x single train", "fwd MiB", "train MiB",
           "x single fwd MiB", "x single train MiB", "sent MiB"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "bench_cp", impl_help="comma-separated methods: ring, allgather, direct, or 'all' (default)")
    parser.add_argument("--procs", type=parse_counts, default=[1, 2, 4],
                        help="comma-separated process counts P (default 1,2,4; this machine has few cores, so "
                        "no speed-up is expected: the figures are memory and bytes per rank)")
    parser.add_argument("--masks", default="causal,window", help="comma-separated: causal, window (default both)")
    for flag, key, what in (("--length", "length", "sequence length T"), ("--batch", "batch", "batch size B"),
                            ("--heads", "heads", "query heads Hq"), ("--kv-heads", "kv_heads", "key/value heads Hkv"),
                            ("--head-dim", "head_dim", "head dim D"), ("--window", "window", "sliding window")):
        parser.add_argument(flag, type=parse_count if key == "length" else positive_int, default=None,
                            help=f"{what} (default {FULL[key]}; {QUICK[key]} with --quick)")
    parser.add_argument("--window-layout", choices=("contiguous", "zigzag"), default="contiguous",
                        help="shards for the window mask (default contiguous: a window is balanced already, and "
                        "the ring can skip shards no query sees); causal always uses zigzag")
    parser.add_argument("--timeout", type=positive_float, default=120.0,
                        help="seconds any one wait of a measured group may last (its collectives' timeout and "
                        "the ring's; default 120)")
    parser.add_argument("--model", action="store_true",
                        help="no processes: the scale model (lab/bench/cp_model.py) projected to P = 8-1,024 "
                        "on stated hardware, and checked against --measured")
    parser.add_argument("--measured", default=None,
                        help="--model: a measured run's cp_summary.json to check the model against")
    parser.add_argument("--link-gbs", type=positive_float, default=5.0,
                        help="--model --measured: this machine's link between processes, GB/s (default 5: gloo on "
                        "loopback)")
    parser.add_argument("--deadline", type=positive_float, default=1800.0,
                        help="seconds the worker processes may run in all before the bench kills them (default "
                        "1800; 120 with --quick)")


def main(args: argparse.Namespace) -> int:
    apply_threads(args)
    if args.model:
        paths = model_main(args, Path(args.out))
        print("\nsaved " + ", ".join(str(p) for p in paths))
        return 0
    try:
        s = _settings(args)
    except ValueError as error:
        print(f"error: {error}")
        return 2
    print(f"context parallelism: T={s['length']}, B={s['batch']}, Hq={s['heads']}, Hkv={s['kv_heads']}, "
          f"D={s['head_dim']}, fp32, window {s['window']} ({s['window_layout']} shards), causal on zigzag shards; "
          f"P = {', '.join(map(str, args.procs))}; methods {', '.join(s['methods'])}; {s['threads']} torch "
          f"thread(s) per process; {s['repeats']} repeat(s)")
    plan = [(p, _configs(p, s, p in args.procs)) for p in sorted(set(args.procs) | {1})]  # the peer: P = 1
    bar = progress([], "bench cp", total=sum(len(configs) for _, configs in plan), quiet=args.quiet)
    started, load_before = time.perf_counter(), _load()
    rows, error = run_workers(plan, s, bar)
    bar.close()
    errors = [] if error is None else [error]
    order = {name: i for i, name in enumerate(("single", *METHODS))}
    rows.sort(key=lambda r: (MASKS.index(r["mask"]), r["P"], order[r["method"]], r["rank"]))
    _add_ratios(rows)
    summary = summarise(rows)
    print(format_table(rows, TABLE))
    print("\nper (mask, method, P): the slowest rank's time and the largest rank's memory; x single: over the "
          "single-process causal_attention\n")
    print(format_table(summary, SUMMARY))
    if max(load_before) > 1.5:
        print(f"\nnote: the load average was {load_before} at the start: other work shared the CPUs")
    for error in errors:
        print(f"\nerror: {error}")
    meta = {**machine_info(), "command": "python run.py bench cp", "settings": s, "errors": errors,
            "load_before": load_before, "load_after": _load(), "seconds": round(time.perf_counter() - started, 1),
            "bytes_formula": __doc__.split("::")[1]}
    out = Path(args.out)
    paths = save_results(out, "cp", rows, meta) + save_results(out, "cp_summary", summary, meta)
    if summary:
        paths.append(plot(summary, out / "cp.png"))
    print("\nsaved " + ", ".join(str(p) for p in paths))
    mismatched = [r for r in rows if r["exact"] is False]
    return 1 if errors or mismatched else 0


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return [0.0, 0.0, 0.0]


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """Everything a worker needs, as plain values; --quick fills in the sizes not given."""
    sizes = QUICK if args.quick else FULL
    s = {key: getattr(args, key) or default for key, default in sizes.items()}
    methods = list(METHODS) if args.impl in ("all", "") else [m.strip() for m in args.impl.split(",") if m.strip()]
    masks = [m.strip() for m in args.masks.split(",") if m.strip()]
    if set(methods) - set(METHODS) or not methods:
        raise ValueError(f"--impl: expected methods from {METHODS}, got {args.impl!r}")
    if set(masks) - set(MASKS) or not masks:
        raise ValueError(f"--masks: expected masks from {MASKS}, got {args.masks!r}")
    if s["heads"] % s["kv_heads"]:
        raise ValueError(f"--heads ({s['heads']}) must be a multiple of --kv-heads ({s['kv_heads']})")
    deadline = min(args.deadline, 120.0) if args.quick else args.deadline
    return {**s, "methods": methods, "masks": masks, "window_layout": args.window_layout, "seed": args.seed,
            "repeats": 1 if args.quick else args.repeats, "threads": args.threads, "timeout": args.timeout,
            "deadline": deadline}


def _configs(world: int, s: dict[str, Any], measured: bool) -> list[tuple[str, str]]:
    """``(mask, method)`` pairs one group runs; the P = 1 group also runs the single-process peer."""
    methods = (["single"] if world == 1 else []) + (s["methods"] if measured else [])
    return [(mask, method) for mask in s["masks"] for method in methods]


# --- the parent: start the workers, collect their rows, kill them at the deadline ----------------------------------


def run_workers(plan: list[tuple[int, list[tuple[str, str]]]], s: dict[str, Any], bar) -> tuple[list[dict], str | None]:
    """Start ``max(P)`` worker processes and run ``plan`` (``(P, configs)`` in turn: ranks ``0 .. P-1`` measure,
    the others wait in a barrier, idle); returns the rows and an error (None when all went well).

    The workers are killed once ``s["deadline"]`` seconds have passed, so no run can hang."""
    rows: list[dict] = []
    messages = mp.get_context("spawn").Queue()

    def drain() -> None:
        while True:
            try:
                kind, payload = messages.get_nowait()
            except queue_mod.Empty:
                return
            if kind == "row":
                rows.append(payload)
            else:
                bar.update(1)
                bar.set_postfix_str(payload)

    world = max(p for p, _ in plan)
    with tempfile.TemporaryDirectory(prefix="bench_cp_") as folder:
        context = mp.start_processes(worker, args=(world, f"{folder}/store", s, plan, messages), nprocs=world,
                                     join=False, start_method="spawn")
        end = time.monotonic() + s["deadline"]
        try:
            while not context.join(timeout=0.2):
                drain()
                if time.monotonic() > end:
                    _kill(context.processes)
                    return rows, f"killed after the {s['deadline']:g} s deadline (raise --deadline for larger sizes)"
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:  # join stopped the other ranks
            drain()
            return rows, str(error).strip().splitlines()[-1]
        finally:
            _kill(context.processes)
        drain()
    return rows, None


def _kill(processes) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(timeout=10)


# --- the workers: one process per rank --------------------------------------------------------------------------


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's time and memory over the single-process peer's with the same mask."""
    single = {r["mask"]: r for r in rows if r["method"] == "single"}
    for r in rows:
        peer = single.get(r["mask"])
        for column in ("fwd ms", "train ms", "fwd MiB", "train MiB"):
            r[f"x single {column}"] = r[column] / peer[column] if peer and peer[column] else None


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (mask, method, P): the slowest rank's times, the largest rank's memory and bytes sent."""
    keys = list(dict.fromkeys((r["mask"], r["method"], r["P"]) for r in rows))
    summary = []
    for mask, method, world in keys:
        mine = [r for r in rows if (r["mask"], r["method"], r["P"]) == (mask, method, world)]
        row = {"mask": mask, "method": method, "P": world, "ranks": len(mine)}
        for column in ("fwd ms", "train ms", "fwd MiB", "train MiB", "fwd alloc MiB", "train alloc MiB"):
            row[column] = max(r[column] for r in mine)
        row["sent MiB"] = max(r["sent fwd"] + r["sent bwd"] for r in mine) / 2**20
        row["formula MiB"] = max(r["formula fwd"] + r["formula bwd"] for r in mine) / 2**20
        peer = next((r for r in rows if r["method"] == "single" and r["mask"] == mask), None)
        for column, label in (("fwd ms", "x single fwd"), ("train ms", "x single train"),
                              ("fwd MiB", "x single fwd MiB"), ("train MiB", "x single train MiB")):
            row[label] = row[column] / peer[column] if peer else None
        summary.append(row)
    return summary


def plot(summary: list[dict[str, Any]], path: Path) -> Path:
    """Memory per rank vs P (forward, forward + backward; single process and 1/P dashed) and bytes sent per rank
    vs P (counted; the formula dotted)."""
    from lab import plots

    fig, axes = plots.figure(ncols=3, width=4.8)
    lines = list(dict.fromkeys((r["mask"], r["method"]) for r in summary if r["method"] != "single"))
    procs = sorted({r["P"] for r in summary})
    for ax, column, title in ((axes[0], "fwd MiB", "forward: peak MiB per rank"),
                              (axes[1], "train MiB", "forward + backward: peak MiB per rank"),
                              (axes[2], "sent MiB", "MiB sent per rank (fwd + bwd)")):
        for index, (mask, method) in enumerate(lines):
            mine = sorted((r for r in summary if (r["mask"], r["method"]) == (mask, method)), key=lambda r: r["P"])
            plots.series(ax, [r["P"] for r in mine], [r[column] for r in mine], f"{method}, {mask}", index)
            if column == "sent MiB":
                formula = [(r["P"], r["formula MiB"]) for r in mine if r["formula MiB"] > 0]
                ax.plot([p for p, _ in formula], [y for _, y in formula], ":", color="grey")
        plots.loglog(ax, title, "processes P", "MiB" if column != "sent MiB" else "MiB (dotted: formula)")
        if column == "sent MiB":
            ax.set_yscale("linear")
        for index, r in enumerate(x for x in summary if x["method"] == "single" and column != "sent MiB"):
            color = f"C{index + len(lines)}"
            ax.axhline(r[column], linestyle="--", color=color, label=f"single process, {r['mask']}")
            ax.plot(procs, [r[column] / p for p in procs], ":", color=color, label=f"single / P, {r['mask']}")
        ax.legend(fontsize=7)
    return plots.save(fig, path)
