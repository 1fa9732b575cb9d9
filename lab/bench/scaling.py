"""``run.py bench scaling``: time and peak memory of causal prefill vs sequence length T, per implementation.

Exercise D ("Measure the quadratic") of the attention-from-first-principles notes and stretch exercise 4 of the
attention chapter (runtime and peak memory of causal_attention vs T): the score matrix is T x T per head, so a
materialising kernel should grow as T^2 in time *and* memory, and a tiled one as T^2 in time but T in memory.
For each implementation this bench

1. runs T = min-t, 2 min-t, ... max-t (doubling) while the next point is predicted to stay within
   ``--max-seconds`` per call and ``--ram-budget`` of memory (this machine is shared);
2. times each point (median of ``--repeats``) and measures its peak tensor memory: the inputs q, k, v plus the
   peak of what the call allocates (torch's allocator, exact; the output included);
3. fits ``time ~ T^p`` and ``memory ~ T^p`` on log-log axes over the points with T >= ``--fit-from``;
4. solves the memory fit for the T at which one call would no longer fit in ``--memory`` (default: this
   machine's RAM) at the benched B and heads.

Inputs: q, k, v ``[B, H, T, D]`` (self-attention, Hq = Hkv), random normal, dtype ``--dtype``.
"""

from __future__ import annotations

import argparse
import math

import torch

from lab import implementations, plots
from lab.fitting import fit_power_law, solve_power_law
from lab.measure import format_table, machine_info, median_ms, peak_allocated_bytes, progress, save_results
from lab.options import add_common, apply_threads, byte_size, positive_float, positive_int
from lab.units import available_memory_bytes, format_bytes, machine_memory_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "scaling")
    parser.add_argument("--min-t", type=positive_int, default=128, help="first sequence length (default 128)")
    parser.add_argument("--max-t", type=positive_int, default=32768,
                        help="last sequence length to try, doubling from --min-t (default 32768)")
    parser.add_argument("--batch", type=positive_int, default=1, help="batch size B (default 1)")
    parser.add_argument("--heads", type=positive_int, default=2, help="heads H = Hq = Hkv (default 2)")
    parser.add_argument("--head-dim", type=positive_int, default=64, help="head dim D (default 64)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="input dtype (default fp32)")
    parser.add_argument("--max-seconds", type=positive_float, default=5.0,
                        help="skip a point whose predicted time per call exceeds this many seconds (default 5)")
    parser.add_argument("--ram-budget", type=byte_size, default=None,
                        help="skip a point whose predicted peak memory exceeds this size, e.g. 4GiB "
                        "(default: a quarter of the memory available now)")
    parser.add_argument("--memory", type=byte_size, default=None,
                        help="memory size for the 'stops fitting at T' column, e.g. 80GiB or 16GB "
                        "(default: this machine's RAM)")
    parser.add_argument("--fit-from", type=positive_int, default=1024,
                        help="fit exponents over points with T >= this (default 1024; small T is overhead-bound)")


def sequence_lengths(min_t: int, max_t: int) -> list[int]:
    """``min_t, 2 min_t, 4 min_t, ... <= max_t``."""
    if min_t > max_t:
        raise ValueError(f"--min-t ({min_t}) must not exceed --max-t ({max_t})")
    lengths = [min_t]
    while lengths[-1] * 2 <= max_t:
        lengths.append(lengths[-1] * 2)
    return lengths


def predict(points: list[dict], key: str, t: int, default_exponent: float) -> float:
    """Extrapolate ``key`` to length t from the last point (quadratic time, default memory exponent)."""
    if not points:
        return 0.0
    last = points[-1]
    exponent = 2.0 if key == "ms" else default_exponent
    if len(points) >= 2 and key == "peak_bytes":  # measured slope of the last two points, never below 1
        a, b = points[-2], points[-1]
        if a[key] > 0 and b[key] > 0:
            exponent = max(1.0, math.log(b[key] / a[key]) / math.log(b["T"] / a["T"]))
    return last[key] * (t / last["T"]) ** exponent


def run_points(args: argparse.Namespace, impls: dict, lengths: list[int], ram_budget: int) -> list[dict]:
    """Measure every (implementation, T) that stays within the time and memory budgets."""
    dtype = DTYPES[args.dtype]
    generator = torch.Generator().manual_seed(args.seed)
    done: dict[str, list[dict]] = {name: [] for name in impls}
    stopped: dict[str, str] = {}
    skipped: dict[str, str] = {}  # kernels whose fast path does not apply to a shape (forcing would time a fallback)
    rows = []
    for t, name in progress([(t, n) for t in lengths for n in impls], "bench scaling", quiet=args.quiet):
        if name in stopped:
            continue
        ms_guess = predict(done[name], "ms", t, 2.0)
        mem_guess = predict(done[name], "peak_bytes", t, 2.0)
        if ms_guess > args.max_seconds * 1e3 or mem_guess > ram_budget:
            stopped[name] = (f"T={t}: predicted {ms_guess / 1e3:.1f} s, {format_bytes(mem_guess)} "
                             f"(limits {args.max_seconds:g} s, {format_bytes(ram_budget)})")
            continue
        shape = (args.batch, args.heads, t, args.head_dim)
        q, k, v = (torch.randn(shape, generator=generator).to(dtype) for _ in range(3))  # [B, H, T, D]
        why_not = implementations.why_not_fast(name, q, k, v)
        if why_not is not None:
            skipped.setdefault(name, f"T={t}: {why_not}")
            continue
        fn = impls[name]
        ms = median_ms(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v), repeats=args.repeats, warmup=1)
        allocated = peak_allocated_bytes(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v))
        peak = allocated + sum(x.numel() * x.element_size() for x in (q, k, v))  # inputs + what the call adds
        point = {"impl": name, "T": t, "ms": ms, "alloc_MiB": allocated / 2**20, "peak_bytes": peak,
                 "peak_MiB": peak / 2**20}
        done[name].append(point)
        rows.append(point)
    for name, why in stopped.items():
        print(f"{name}: stopped before {why}")
    for name, why in skipped.items():
        print(f"{name}: not measured where its fast path does not apply, from {why}")
    peer = {r["T"]: r["ms"] for r in rows if r["impl"] == implementations.PEER}
    for r in rows:
        r["x_peer_time"] = r["ms"] / peer[r["T"]] if r["T"] in peer else float("nan")
    return rows


def fit_rows(rows: list[dict], impls: dict, fit_from: int, memory: int) -> list[dict]:
    """Per implementation: fitted time and memory exponents and the T at which one call outgrows ``memory``."""
    fits = []
    for name in impls:
        points = [r for r in rows if r["impl"] == name]
        used = [r for r in points if r["T"] >= fit_from]
        if len(used) < 2:  # too few large points: fit what there is
            used = points
        if len({r["T"] for r in used}) < 2:
            fits.append({"impl": name, "points": len(used), "time_exponent": float("nan"),
                         "memory_exponent": float("nan"), "fits_until_T": float("nan")})
            continue
        time_p, time_c = fit_power_law([r["T"] for r in used], [r["ms"] for r in used])
        mem_p, mem_c = fit_power_law([r["T"] for r in used], [r["peak_bytes"] for r in used])
        fits.append({"impl": name, "points": len(used), "fit_T": f"{used[0]['T']}..{used[-1]['T']}",
                     "time_exponent": time_p, "time_coefficient": time_c,
                     "memory_exponent": mem_p, "memory_coefficient": mem_c,
                     "fits_until_T": solve_power_law(mem_p, mem_c, memory)})
    return fits


def plot(rows: list[dict], fits: list[dict], memory: int, path) -> None:
    """Three panels: time vs T, peak memory vs T (log-log, with T and T^2 guides), and where each stops fitting."""
    fig, (ax_time, ax_mem, ax_fit) = plots.figure(ncols=3, width=5.0, height=4.4)
    plots.loglog(ax_time, "Time per call vs sequence length", "sequence length T (tokens)", "time per call (ms)")
    plots.loglog(ax_mem, "Peak tensor memory vs T (inputs included)", "sequence length T (tokens)",
                 "peak memory (MiB)")
    plots.loglog(ax_fit, f"Fitted memory, extrapolated to {format_bytes(memory)}", "sequence length T (tokens)",
                 "predicted peak memory (GiB)")
    lengths = sorted({r["T"] for r in rows})
    for i, fit in enumerate(fits):
        mine = [r for r in rows if r["impl"] == fit["impl"]]
        xs = [r["T"] for r in mine]
        plots.series(ax_time, xs, [r["ms"] for r in mine], f"{fit['impl']} (T^{fit['time_exponent']:.2f})", i)
        plots.series(ax_mem, xs, [r["peak_MiB"] for r in mine], f"{fit['impl']} (T^{fit['memory_exponent']:.2f})", i)
        limit = fit["fits_until_T"]
        if math.isfinite(limit):
            span = [min(lengths), max(limit * 2, max(lengths))]
            law = [fit["memory_coefficient"] * x ** fit["memory_exponent"] / 2**30 for x in span]
            ax_fit.plot(span, law, marker=None, label=f"{fit['impl']}: fits until T = {limit:,.0f}")
            ax_fit.plot([limit], [memory / 2**30], marker=plots.MARKERS[i % len(plots.MARKERS)], color="black")
    for ax, key in ((ax_time, "ms"), (ax_mem, "peak_MiB")):
        top = max(rows, key=lambda r: r[key])
        plots.power_guide(ax, lengths, (top["T"], top[key]), 2.0, "slope 2 (T^2)", "--")
        plots.power_guide(ax, lengths, (top["T"], top[key] / 8), 1.0, "slope 1 (T)", ":")
        ax.legend(fontsize=7)
    ax_fit.axhline(memory / 2**30, color="red", linestyle=":", label=f"memory = {format_bytes(memory)}")
    ax_fit.legend(fontsize=7)
    plots.save(fig, path)


def _quick(args: argparse.Namespace) -> None:
    args.min_t, args.max_t, args.heads, args.head_dim = 64, 128, 1, 32  # two points (Flex compiles each shape)
    args.repeats, args.fit_from, args.max_seconds = 1, 64, min(args.max_seconds, 2.0)


def main(args: argparse.Namespace) -> int:
    if args.quick:
        _quick(args)
    apply_threads(args)
    try:
        lengths = sequence_lengths(args.min_t, args.max_t)
        impls = implementations.select(args.impl)
    except ValueError as error:
        print(f"error: {error}")
        return 2
    memory = args.memory or machine_memory_bytes()
    ram_budget = args.ram_budget or max(available_memory_bytes() // 4, 2**28)
    print(f"causal prefill, B={args.batch}, H={args.heads}, D={args.head_dim}, {args.dtype}; T = {lengths[0]}.."
          f"{lengths[-1]}; implementations: {', '.join(impls)}; budget {args.max_seconds:g} s and "
          f"{format_bytes(ram_budget)} per call; torch threads: {torch.get_num_threads()}")
    rows = run_points(args, impls, lengths, ram_budget)
    if not rows:
        print("error: no point fitted the time and memory budgets")
        return 1
    fits = fit_rows(rows, impls, args.fit_from, memory)
    print("\npeak_MiB = q, k, v + the peak the call allocates (alloc_MiB, output included)\n")
    print(format_table(rows, ["impl", "T", "ms", "x_peer_time", "alloc_MiB", "peak_MiB"]))
    shown = [{**f, "fits_until_T": f"{f['fits_until_T']:,.0f}"} for f in fits]
    print(f"\nlog-log fits over T >= {args.fit_from}; 'fits until T': one call at B={args.batch}, H={args.heads} "
          f"outgrows {format_bytes(memory)}\n")
    print(format_table(shown, ["impl", "points", "fit_T", "time_exponent", "memory_exponent", "fits_until_T"]))
    meta = {"command": "bench scaling", "args": vars(args), "memory_bytes": memory, "machine": machine_info()}
    paths = save_results(args.out, "scaling", rows, meta) + save_results(args.out, "scaling_fits", fits, meta)
    plot(rows, fits, memory, f"{args.out}/scaling.png")
    print("\nwrote " + ", ".join(str(p) for p in paths) + f", {args.out}/scaling.png")
    return 0
