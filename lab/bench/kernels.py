"""``run.py bench kernels``: the engine's kernels against PyTorch SDPA and FlexAttention, in one run.

For each case (see lab.bench.kernel_cases) every implementation runs on the same inputs; timings
interleave the implementations repeat by repeat (so drift on a shared machine hits them alike) and the
median is reported, with GFLOP/s of useful work, decode GB/s, peak extra memory (first call) and the
engine's speed-up over each peer. FlexAttention's block mask and compile time are reported apart. The
closing table checks issue 4's seven targets and issue 13's decode targets. Results: ``kernels.json`` /
``kernels.csv`` and PNG plots.

    python run.py bench kernels --quick            # seconds: small sizes, no FlexAttention
    python run.py bench kernels --threads 2        # the full run of docs/BENCHMARKS.md
    python run.py bench kernels --device cuda      # the GPU cases (lab.bench.kernel_cases_cuda)
    python run.py bench kernels --groups modifiers # sinks, ALiBi, relative bias (lab.bench.modifier_cases)
    python run.py bench kernels --groups scores    # decode steps with Gemma 2's softcap, ALiBi, a bias
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from engine.kernels.decode.native_build import load_native
from lab.bench import kernel_cases as cases_mod
from lab.bench import kernel_cases_cuda
from lab.bench.kernel_suite import all_cases
from lab.bench.kernel_targets import SDPA_CUDA_BACKENDS, check_cuda_targets, check_targets, find_rows
from lab.bench.modifier_cases import modifier_cases, plot_modifiers
from lab.measure import CudaPeakMemory, PeakMemory, evict_caches, format_table, machine_info, progress, save_results
from lab.options import add_common, apply_threads

SLOW_SECONDS = 4.0  # an implementation slower than this per call is timed once (its first call)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "bench_kernels", impl_help="comma-separated labels to run (e.g. 'engine,sdpa'), matched as "
               "prefixes of the table's labels, or 'all' (default)")
    parser.add_argument("--flex", action=argparse.BooleanOptionalAction, default=None,
                        help="measure FlexAttention compiled for CPU (default: on, off with --quick; each "
                        "compile takes tens of seconds)")
    parser.add_argument("--groups", default="all",
                        help="comma-separated case groups: prefill, chunked, window, documents, decode, bandwidth "
                        "(decode's K/V bytes per second: cache buffers, 2 threads, int8/fp8), memory, "
                        "bf16, cache, scores (a decode with Gemma 2's softcap, ALiBi, a bias), training, modifiers "
                        "(default all; bf16, cache, scores and modifiers are outside the targets); on CUDA: prefill, "
                        "chunked, window, documents, ragged, decode, training")
    parser.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                        help="start no new case after this many seconds; the cases run so far are saved (for a "
                        "device lease of fixed length)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu (default): the CPU cases; cuda: the GPU cases against SDPA's backends, "
                        "FlexAttention called directly and flash-attn if installed (bf16, D=128)")


def main(args: argparse.Namespace) -> int:
    apply_threads(args)
    torch.manual_seed(args.seed)
    flex = (not args.quick) if args.flex is None else args.flex
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch.cuda.is_available() is False (no CUDA device or a CPU build of torch)")
        return 2
    if args.device == "cuda":
        cases = kernel_cases_cuda.cuda_cases(args.quick)
    else:
        cases = all_cases(args.quick, flex) + modifier_cases(args.quick, 16, 64, flex)
    if args.groups != "all":
        wanted = {g.strip() for g in args.groups.split(",")}
        cases = [c for c in cases if c.group in wanted]
    wanted_impls = None if args.impl in ("all", "") else [p.strip() for p in args.impl.split(",")]
    # The native decode kernel is built here, before any timing: its first call would otherwise compile it (seconds)
    # inside the first case's first call, which then counts as that row's only run (SLOW_SECONDS)
    native_build_s = _build_native() if args.device == "cpu" else None
    load_before = _load()
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    # Each case compiles FlexAttention for its shapes (the engine's flex and Flex called directly share one
    # function's compile cache): past torch.compile's default limit of 8, Flex would run unfused.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    skipped = []
    for case in progress(cases, "bench kernels", quiet=args.quiet):
        if args.stop_after is not None and time.perf_counter() - started > args.stop_after:
            skipped.append(case.name)
            continue
        rows += run_case(case, 1 if args.quick else args.repeats, wanted_impls, args.device)
    meta = {**machine_info(), "command": "python run.py bench kernels " + _flags(args), "not_run": skipped,
            "native_build_s": native_build_s,
            "load_before": load_before, "load_after": _load(), "seconds": round(time.perf_counter() - started, 1)}
    targets = check_cuda_targets(rows) if args.device == "cuda" else check_targets(rows)
    print(format_table(rows, ["group", "case", "impl", "ms", "GFLOP/s", "GB/s", "peak MiB", "vs sdpa", "vs dense",
                              "vs flex", "setup s", "note"]))
    print()
    print(format_table(targets, ["target", "measured", "threshold", "met", "how"]))
    if args.quick:
        print("\nnote: --quick runs small sizes once each; the targets are meant for the full sizes")
    if skipped:
        print(f"\nnote: --stop-after {args.stop_after:g} s: {len(skipped)} case(s) not run: {', '.join(skipped)}")
    if max(load_before) > 1.5:
        print(f"\nnote: the load average was {load_before} at the start: other work shared the CPUs")
    out = Path(args.out)
    paths = save_results(out, "kernels", rows, {**meta, "targets": targets})
    paths += plot(rows, out, args.device) + (plot_modifiers(rows, out) if args.device == "cpu" else [])
    print("\nsaved " + ", ".join(str(p) for p in paths))
    return 0


def _flags(args: argparse.Namespace) -> str:
    flags = ["--quick"] if args.quick else []
    flags += ["--device cuda"] if args.device == "cuda" else []
    flags += [f"--stop-after {args.stop_after:g}"] if args.stop_after is not None else []
    flags += [f"--threads {args.threads}", f"--repeats {args.repeats}"]
    if args.flex is not None:
        flags.append("--flex" if args.flex else "--no-flex")
    if args.groups != "all":
        flags.append(f"--groups {args.groups}")
    return " ".join(flags)


def _build_native() -> float | None:
    """Build (or load from the cache) the native decode kernel; the seconds a build took, None when unavailable."""
    library = load_native()
    return None if isinstance(library, str) else round(library.build_s, 1)


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return [0.0, 0.0, 0.0]


def run_case(case: cases_mod.Case, repeats: int, wanted: list[str] | None, device: str = "cpu") -> list[dict[str, Any]]:
    """Time every implementation of one case; returns one row per implementation (peak memory: the C heap on
    CPU, the CUDA allocator's peak on CUDA)."""
    impls = [i for i in case.build() if wanted is None or i.role != "engine" or any(i.label.startswith(w)
                                                                                     for w in wanted)]
    setup_s: dict[str, float] = {}
    for impl in impls:
        if impl.setup is not None:
            start = time.perf_counter()
            try:
                impl.setup()
                setup_s[impl.label] = time.perf_counter() - start
            except Exception as error:  # noqa: BLE001  (a peer that cannot compile here is reported, not fatal)
                setup_s[impl.label] = float("nan")
                impl.note = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:80]}"
    runnable = [i for i in impls if not i.note.startswith("failed")]
    first, peak, times = {}, {}, {i.label: [] for i in runnable}
    before = evict_caches if case.cold else lambda: None  # (untimed)
    for impl in runnable:  # first call: peak memory, and the only timing of very slow peers
        gc.collect()
        before()
        with (CudaPeakMemory() if device == "cuda" else PeakMemory()) as memory:
            start = time.perf_counter()
            impl.run()
            first[impl.label] = time.perf_counter() - start
        peak[impl.label] = memory.extra_bytes
    for _ in range(repeats):
        for impl in runnable:
            if first[impl.label] > SLOW_SECONDS:
                continue
            before()
            start = time.perf_counter()
            impl.run()
            times[impl.label].append(time.perf_counter() - start)
    rows = []
    for impl in impls:
        row = {"group": case.group, "case": case.name, "impl": impl.label, "role": impl.role, **case.params}
        if impl.label in first:
            seconds = statistics.median(times[impl.label]) if times[impl.label] else first[impl.label]
            row["ms"] = seconds * 1e3
            row["runs"] = max(1, len(times[impl.label]))
            if times[impl.label]:  # each repeat's time: ratios of two rows are taken repeat by repeat (targets)
                row["round ms"] = [round(t * 1e3, 4) for t in times[impl.label]]
            row["peak MiB"] = peak[impl.label] / 2 ** 20
            if impl.role == "overhead":  # a step of a call (the block-mask build), not attention: time only
                pass
            elif impl.role == "bandwidth":
                row["GB/s"] = 2 * min(case.kv_bytes / 2, cases_mod.COPY_BYTES) / seconds / 1e9  # read + written
            elif impl.role == "read":  # the case's K/V bytes read, no arithmetic
                row["GB/s"] = case.kv_bytes / seconds / 1e9
            else:
                row["GFLOP/s"] = case.flops / seconds / 1e9
                kv_bytes = impl.kv_bytes or case.kv_bytes
                row["GB/s"] = kv_bytes / seconds / 1e9 if kv_bytes else None
        row["setup s"] = setup_s.get(impl.label)
        row["note"] = "; ".join(x for x in (impl.note, *(case.notes if impl.role == "engine" else [])) if x) or None
        rows.append(row)
    _add_ratios(rows)
    del impls, runnable
    gc.collect()
    return rows


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each peer's time over this row's time (above 1: this row is faster): ``vs sdpa`` against SDPA
    without a mask (is_causal / enable_gqa), ``vs dense`` against SDPA with the dense bool mask."""
    def peer_ms(*prefixes: str) -> float | None:  # the fastest peer row of these labels
        return min((r["ms"] for r in rows if r["impl"].startswith(prefixes) and "ms" in r), default=None)

    peers = {"vs sdpa": peer_ms("sdpa is_causal", "sdpa enable_gqa", *SDPA_CUDA_BACKENDS),
             "vs dense": peer_ms("sdpa dense"), "vs flex": peer_ms("flex")}
    for r in rows:
        if r["role"] == "engine" and "ms" in r:
            r.update({column: ms / r["ms"] if ms else None for column, ms in peers.items()})


def _role(impl: str) -> str:
    """A scores case's implementation, named alike across modifiers (``engine:tiled`` / ``engine:decode``: the
    kernel such decodes ran on before; ``eager softcap`` / ``eager alibi``: eager)."""
    for prefix, role in (("engine:", "engine, the kernel before"), ("engine, no", "engine, unmodified"),
                         ("engine paged, no", "engine paged, unmodified"), ("engine paged", "engine paged"),
                         ("eager", "eager"), ("engine (", "engine")):
        if impl.startswith(prefix):
            return role
    return impl


def plot(rows: list[dict[str, Any]], out: Path, device: str = "cpu") -> list[Path]:
    from lab import plots

    paths = []
    fig, axes = plots.figure(ncols=2)
    widths = sorted({r["window"] for r in rows if r["group"] == "window" and "window" in r})
    window = f"sliding window {', '.join(map(str, widths))}"
    shape = "bf16, Hq=32, Hkv=8, D=128, CUDA" if device == "cuda" else "fp32, Hq=16, D=64"
    for ax, group, title in ((axes[0], "prefill", f"causal prefill ({shape})"),
                             (axes[1], "window", f"{window} ({shape})")):
        labels = sorted({r["impl"] for r in find_rows(rows, group, "")}, key=lambda s: (not s.startswith("engine"), s))
        for index, label in enumerate(labels):
            points = sorted((r["T"], r["ms"]) for r in find_rows(rows, group, label) if r["impl"] == label)
            plots.series(ax, [t for t, _ in points], [ms for _, ms in points], label, index)
        plots.loglog(ax, title, "sequence length T", "median ms per call")
        if labels:
            ax.legend(fontsize=7)
    paths.append(plots.save(fig, out / "kernels_scaling.png"))
    decode_rows = [r for r in rows if r["group"] == "decode" and r.get("GB/s")]
    if decode_rows:
        fig, axes = plots.figure(width=7.5, height=4.5)
        ax = axes[0]
        cases = list(dict.fromkeys(r["case"] for r in decode_rows))
        labels = list(dict.fromkeys(r["impl"] for r in decode_rows))
        width = 0.8 / len(labels)
        for index, label in enumerate(labels):
            values = [next((r["GB/s"] for r in decode_rows if r["case"] == c and r["impl"] == label), 0) for c in cases]
            ax.bar([i + index * width for i in range(len(cases))], values, width, label=label)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))],
                      [f"{c.split()[0]} {c.split(' D=128 ')[-1]}" for c in cases], fontsize=6, rotation=60)
        ax.set_ylabel("GB/s (K/V bytes read; copy: read + written)")
        ax.set_title("decode, Hq=32 Hkv=8 D=128: bytes per second")
        ax.legend(fontsize=7)
        paths.append(plots.save(fig, out / "kernels_decode.png"))
    capped = [r for r in rows if r["group"] == "scores" and "ms" in r]
    if capped:  # ms per call of each implementation, case by case (log scale: the paths before were 3-40x)
        fig, axes = plots.figure(width=7.5, height=4.5)
        ax = axes[0]
        cases = list(dict.fromkeys(r["case"] for r in capped))
        labels = list(dict.fromkeys(_role(r["impl"]) for r in capped))
        width = 0.8 / len(labels)
        for index, label in enumerate(labels):
            values = [next((r["ms"] for r in capped if r["case"] == c and _role(r["impl"]) == label), 0)
                      for c in cases]
            ax.bar([i + index * width for i in range(len(cases))], values, width, label=label)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))],
                      [c.replace(" Hq=8 Hkv=4 D=256", "").replace(" Hq=32 Hkv=32 D=128", "") for c in cases],
                      fontsize=6, rotation=30, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("median ms per call")
        ax.set_title("decode with a softcap (Hq=8 Hkv=4 D=256), ALiBi or a bias (Hq=Hkv=32 D=128)", fontsize=9)
        ax.legend(fontsize=6)
        paths.append(plots.save(fig, out / "kernels_scores.png"))
    targets = check_targets(rows)
    if targets:
        fig, axes = plots.figure(width=7.5, height=4.5)
        ax = axes[0]
        shown = [t for t in targets if not t["target"].startswith(("3 window time", "6 memory"))]
        ratios = [t["measured"] / t["threshold"] for t in shown]
        ax.barh([t["target"] for t in shown], ratios, color=["tab:green" if r >= 1 else "tab:red" for r in ratios])
        ax.axvline(1.0, color="grey", linestyle="--")
        ax.set_xscale("log")
        ax.set_xlabel("measured / target (>= 1 meets the target)")
        ax.set_title("issue 4 and 13 targets, measured side by side in one run")
        ax.tick_params(axis="y", labelsize=7)
        paths.append(plots.save(fig, out / "kernels_targets.png"))
    return paths
