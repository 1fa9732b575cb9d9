"""``run.py bench builds``: builds of the native decode kernel (``decode_native.cpp``) timed against each other behind
the engine's own calls, alternated round by round in one process: how a kernel change is measured.

Each build is a library of its own (compiled from a source, or an ``.so`` given as is). For every case the bench makes
one plan per build while that build stands in for ``load_native`` (``engine.plan`` for K/V as the caches hold them,
``engine.plan_paged`` for pages shuffled, or placed as ``--placement`` says), so each plan's runner holds its own
library; then every round times each build's plan once, in an order that rotates, after clearing the caches
(``lab.measure.evict_caches``; ``--warm``: no clearing). Every timed call must have gone through its build's
library (a count of its kernel calls): a comparison that timed one build twice, as a plan reused across builds
would, stops with an error instead of a ratio of 1.

Rows: each case and build, ``ms`` (median over rounds), ``vs first`` (the median of the per-round ratios to the first
build: ``lab.measure.paired_ratio``), ``of copy`` (the K/V bytes read per second over a copy's bytes read and written
per second, the copy of as many bytes timed in the same rounds, cold too, on torch's ``--threads``: the issue's "of
copy") and ``bitwise same`` (its output against the first build's); then the copy's own row.

    python run.py bench builds --against HEAD                    # the working tree's source vs HEAD's: 1 min + builds
    python run.py bench builds --source a.cpp --source b.cpp --pages 16 --batch 8 --keys 8k
    python run.py bench builds --against HEAD --group 8         # Hq 64 / Hkv 8: 8 query rows a KV head
    python run.py bench builds --library x.so --library y.so --quick
    python run.py bench builds --path native --path avx2 --path plain  # this source on each vector path this CPU runs
    python run.py bench builds --against HEAD~3 --path plain    # that revision's source and this one's, both for plain
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import engine
from engine.kernels.decode import decode_native, native_build, native_paged, native_paged_listed
from engine.quantized import quantize
from lab import plots
from lab.bench.paged_pools import PLACEMENTS, on_huge_pages, pools, quantized_pool
from lab.measure import (
    evict_caches,
    format_table,
    interleaved_rounds,
    machine_info,
    paired_ratio,
    progress,
    save_results,
)
from lab.options import add_common, apply_threads, parse_count, parse_counts, positive_int
from lab.revisions import source_at

SWITCHED = (decode_native, native_paged, native_paged_listed)  # the modules whose load_native a build stands in for
KINDS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
if hasattr(torch, "float8_e4m3fn"):
    KINDS["fp8"] = torch.float8_e4m3fn
HQ, HKV, D = 32, 8, 128


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "bench_builds", impl_help="not used by this bench")
    parser.add_argument("--against", metavar="REV", help="time the working tree's decode_native.cpp against the one "
                        "at git revision REV (e.g. HEAD); with --path, each built for every path asked for")
    parser.add_argument("--source", action="append", default=[], metavar="CPP",
                        help="a decode_native.cpp to build and time (repeat: two or more builds)")
    parser.add_argument("--library", action="append", default=[], metavar="SO",
                        help="a built library to time as it is (repeat; with --source too)")
    parser.add_argument("--path", action="append", default=[], choices=("native", *native_build.VECTOR_PATHS),
                        help="the working tree's source built for a vector path (repeat): native (-march=native, "
                        "the library the engine builds), or avx512 / avx2 / plain (the portable C++) as a CPU "
                        "without the wider ones builds it; one this CPU lacks is refused")
    parser.add_argument("--kinds", default="bf16,int8,fp8", help=f"K/V kinds, comma-separated: {', '.join(KINDS)}")
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences (default 1)")
    parser.add_argument("--group", type=positive_int, default=HQ // HKV, help=f"query heads per KV head (default "
                        f"{HQ // HKV}: Hq {HQ} / Hkv {HKV}; 8 is Llama 3 70B's 64 / 8); Hkv stays {HKV}")
    parser.add_argument("--keys", type=parse_count, default=32768, help="keys per sequence (default 32k; 2k with "
                        "--quick)")
    parser.add_argument("--pages", type=parse_counts, default=[], help="page sizes to time paged too, e.g. 16,256 "
                        "(fp32 / bf16 / fp16 / int8; default none: the caches' contiguous buffers only)")
    parser.add_argument("--placement", choices=PLACEMENTS, default="shuffled",
                        help="where the pool's pages lie for --pages (lab.bench.paged_pools; default shuffled)")
    parser.add_argument("--rounds", type=positive_int, default=9, help="timed rounds (default 9; 3 with --quick)")
    parser.add_argument("--warm", action="store_true", help="do not clear the caches before each call")


@dataclass
class Build:
    """One library and the count of kernel calls that went through it."""
    label: str
    library: native_build.NativeLibrary
    calls: int = 0


def load_build(label: str, path: Path) -> Build:
    """The library at ``path`` (a file no other build shares: the loader would hand back the same one), its kernel
    entry counted."""
    build = Build(label, native_build.NativeLibrary(path, 0.0))
    decode = build.library.decode

    def counted(call):
        build.calls += 1
        return decode(call)

    build.library.decode = counted
    return build


def builds_from(args: argparse.Namespace, folder: Path) -> list[Build]:
    """Each build asked for, compiled or copied into ``folder`` under a name of its own."""
    wanted: list[tuple[str, str, Path | None]] = []  # (label, what, a source or a library)
    if args.against:
        old = folder / "against.cpp"
        old.write_text(source_at(args.against))
        if not args.path:
            wanted += [(args.against, "source", old), ("working tree", "source", native_build.SOURCE)]
        for path in args.path:  # (the revision's and the working tree's side by side, path by path)
            wanted += [(f"{args.against}, {path} path", path, old), (f"working tree, {path} path", path,
                                                                      native_build.SOURCE)]
    wanted += [(Path(s).name, "source", Path(s)) for s in args.source]
    wanted += [(Path(s).name, "library", Path(s)) for s in args.library]
    if not args.against:
        wanted += [(f"{path} path", path, native_build.SOURCE) for path in args.path]
    if len(wanted) < 2:
        raise SystemExit("bench builds: give two or more builds (--against REV, or --source / --library / --path "
                         "twice)")
    for _, _, path in wanted:
        if not path.is_file():
            raise SystemExit(f"bench builds: {path} is not a file")
    for path in args.path:
        missing = native_build.path_missing(path) if path != "native" else []
        if missing:
            raise SystemExit(f"bench builds: --path {path} needs {', '.join(missing)}, which this CPU lacks")
    cxx = native_build.compiler()
    builds = []
    for index, (label, what, path) in enumerate(wanted):
        target = folder / f"build-{index}.so"
        if what == "library":
            shutil.copyfile(path, target)
        elif cxx is None:
            raise SystemExit("bench builds: no C++ compiler to build the sources with")
        else:
            start = time.perf_counter()
            flags = native_build.FLAGS if what in ("source", "native") else native_build.path_flags(what)
            native_build._build(cxx, target, flags, source=path)
            if not args.quiet:
                print(f"built {label} in {time.perf_counter() - start:.0f} s")
        try:
            builds.append(load_build(label if label not in [b.label for b in builds] else f"{label} ({index})",
                                     target))
        except (AttributeError, RuntimeError, OSError) as error:  # (an older source: symbols or DecodeCall differ)
            raise SystemExit(f"bench builds: {label} does not fit this engine's NativeLibrary: {error}") from error
    return builds


@contextmanager
def using(build: Build) -> Iterator[None]:
    """``build``'s library in place of ``load_native`` for the plans made inside."""
    saved = [(module, module.load_native) for module in SWITCHED]
    for module, _ in saved:
        module.load_native = lambda: build.library
    try:
        yield
    finally:
        for module, load in saved:
            module.load_native = load


def cases(args: argparse.Namespace) -> list[tuple[str, Callable[[], Callable[[], torch.Tensor]], int]]:
    """``(name, make, kv_bytes)`` per case: ``make()`` plans the call (under a build) and returns its run; the K/V
    bytes a call reads (a quantized cache's scales included)."""
    keys, generator = args.keys, torch.Generator().manual_seed(args.seed)
    q = torch.randn(args.batch, HKV * args.group, 1, D, generator=generator)  # [B, Hq, 1, D]
    k, v = (torch.randn(args.batch, HKV, keys, D, generator=generator) for _ in range(2))  # [B, Hkv, S, D]
    out = []
    for name in [n.strip() for n in args.kinds.split(",") if n.strip()]:
        if name not in KINDS:
            raise SystemExit(f"bench builds: unknown kind {name!r}; expected some of {', '.join(KINDS)}")
        kind = KINDS[name]
        q_kind = kind if kind.is_floating_point and kind.itemsize > 1 else torch.bfloat16  # (quantized: a bf16 q)
        qc = q.to(q_kind)
        held = [on_huge_pages(quantize(x, kind) if kind in (torch.int8, KINDS.get("fp8")) else x.to(kind))
                for x in (k, v)]
        kv_bytes = sum(x.data.nbytes + x.scale.nbytes if hasattr(x, "scale") else x.nbytes for x in held)
        out.append((f"{name} contiguous", functools.partial(_contiguous, qc, *held), kv_bytes))
        for page in args.pages if kind != KINDS.get("fp8") else []:
            if keys % page:
                raise SystemExit(f"bench builds: --keys {keys} is not a multiple of the page size {page}")
            kp, vp, table = pools(k, v, page, generator, True, args.placement)
            kp, vp = (on_huge_pages(quantized_pool(x) if kind == torch.int8 else x.to(kind)) for x in (kp, vp))
            lengths, starts = torch.full((args.batch,), keys), torch.arange(args.batch + 1)
            placed = "" if args.placement == "shuffled" else f", {args.placement}"
            out.append((f"{name} pages of {page}{placed}",
                        functools.partial(_paged, qc[:, :, 0], kp, vp, table, lengths, starts), kv_bytes))
    return out


def _contiguous(q, k, v) -> Callable[[], torch.Tensor]:
    plan = engine.plan(q, k, v)
    return lambda: plan.run(q, k, v)


def _paged(q, k_pages, v_pages, table, lengths, starts) -> Callable[[], torch.Tensor]:
    plan = engine.plan_paged(q, k_pages, v_pages, table, lengths, starts)
    return lambda: plan.run(q, k_pages, v_pages)


def case_rows(name: str, make, kv_bytes: int, builds: list[Build], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each build's row for one case, its plan made under it and every timed call checked to have run it; then the
    row of a copy of ``kv_bytes`` timed in the same rounds."""
    runs, outputs = [], []
    for build in builds:
        with using(build):
            run = make()
            outputs.append(_through(build, run, name))  # (the plan's runner is decided on its first run)
        runs.append(run)
    timed: dict[Any, Callable[[], Any]] = {i: functools.partial(_through, build, runs[i], name)
                                           for i, build in enumerate(builds)}
    source = torch.ones(kv_bytes // 4)
    target = torch.empty_like(source)
    timed["copy"] = lambda: target.copy_(source)
    per_round = interleaved_rounds(timed, args.rounds, 1, warmup=0, before=None if args.warm else evict_caches)
    times = [[us / 1e3 for us in per_round[i]] for i in range(len(builds))]  # ms
    copy = [us / 1e3 for us in per_round["copy"]]
    rows = [{"case": name, "build": build.label, "ms": statistics.median(times[i]),
             "vs first": paired_ratio(times[i], times[0]), "of copy": paired_ratio(copy, times[i]) / 2,
             "bitwise same": bool(torch.equal(outputs[i], outputs[0])), "round ms": times[i]}
            for i, build in enumerate(builds)]
    return rows + [{"case": name, "build": f"copy of the K/V bytes ({kv_bytes / 2**20:.0f} MiB)",
                    "ms": statistics.median(copy), "vs first": None, "of copy": 1.0, "bitwise same": None,
                    "round ms": copy}]


def _through(build: Build, run: Callable[[], torch.Tensor], name: str) -> torch.Tensor:
    before = build.calls
    result = run()
    if build.calls == before:
        raise RuntimeError(f"bench builds: {name}: a call of build {build.label!r} did not run its library (a plan "
                           f"made under another build, or a kernel other than decode_native); no ratio is reported")
    return result


def plot(rows: list[dict[str, Any]], path: str) -> None:
    rows = [r for r in rows if r["vs first"] is not None]  # (the builds; not the copies)
    fig, (ax,) = plots.figure(width=7.0, height=0.5 + 0.45 * len(rows))
    labels = [f"{r['case']}: {r['build']}" for r in rows]
    ax.barh(range(len(rows)), [r["vs first"] for r in rows], color="tab:blue")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("time / first build's (median of per-round ratios)")
    ax.set_title("decode_native builds behind engine calls")
    plots.save(fig, path)


def main(args: argparse.Namespace) -> int:
    apply_threads(args)
    if args.quick:
        args.keys, args.rounds = min(args.keys, 2048), min(args.rounds, 3)
    if args.placement != "shuffled" and not args.pages:
        raise SystemExit(f"bench builds: --placement {args.placement!r} lays out paged pools: give --pages too")
    try:
        native_build.dot_mode_asked()
    except RuntimeError as refused:  # (else every build would seem not to fit)
        raise SystemExit(f"bench builds: {refused}") from None
    planned = cases(args)  # (bad kinds or page sizes are named before anything is compiled)
    with tempfile.TemporaryDirectory(prefix="bench-builds-") as folder:
        builds = builds_from(args, Path(folder))
        rows = []
        with torch.no_grad():
            for name, make, kv_bytes in progress(planned, "bench builds", quiet=args.quiet):
                rows += case_rows(name, make, kv_bytes, builds, args)
    print(format_table(rows, ["case", "build", "ms", "vs first", "of copy", "bitwise same"]))
    meta = {**machine_info(), "command": "bench builds", "args": vars(args), "cold": not args.warm,
            "B": args.batch, "S": args.keys, "Hq": HKV * args.group, "Hkv": HKV, "D": D}
    paths = save_results(args.out, "builds", rows, meta)
    plot(rows, f"{args.out}/builds.png")
    print("\nwrote " + ", ".join(str(p) for p in paths) + f", {args.out}/builds.png")
    return 0
