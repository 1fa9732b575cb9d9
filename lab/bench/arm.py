"""``run.py bench arm``: the native decode kernel's aarch64 build, its NEON path against its portable C++ path, counted
in instructions under qemu: how a change to the Arm code is measured on a machine with no Arm CPU.

Both paths are built from the working tree's ``decode_native.cpp`` with Debian's cross compiler (``-O3 -march=armv8-a``;
the portable one with ``-DDN_PORTABLE``) into ``arm/decode_driver.cpp``, a decode step of B 1, Hq 32 / Hkv 8, D 128 and
S keys on one thread, contiguous or in shuffled pages. qemu-user runs each with ``arm/qemu_icount.c``, a plugin that
counts the instructions the guest executes; a case's count is that of ``--calls`` + 1 calls less that of 1 call (the
data made, the first call's allocations), per call, per key and KV head. An instruction count is not a time: it
leaves out how many an Arm core issues a cycle, its memory and the latency of each chain; it shows the work each path
asks of the CPU, and what a change adds or saves.

    python run.py bench arm                     # fp32, bf16, fp16, int8, fp8; contiguous and pages of 16: ~2 min
    python run.py bench arm --against HEAD      # the NEON path of HEAD's source too: what a change adds or saves
    python run.py bench arm --kinds bf16 --quick
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lab import plots
from lab.measure import format_table, machine_info, progress, save_results
from lab.options import add_common, parse_count, parse_counts, positive_int
from lab.revisions import source_at

HERE = Path(__file__).with_name("arm")
CXX, QEMU, SYSROOT = "aarch64-linux-gnu-g++", "qemu-aarch64", "/usr/aarch64-linux-gnu"
KINDS = {"fp32": 0, "bf16": 1, "fp16": 2, "int8": 3, "fp8": 4}  # (decode_native.cpp's Kind)
PATHS = {"portable": ("-DDN_PORTABLE",), "neon": ()}
TIMEOUT_S = 600


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "bench_arm", impl_help="not used by this bench")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"K/V kinds, comma-separated: {', '.join(KINDS)}")
    parser.add_argument("--keys", type=parse_count, default=4096, help="keys per sequence (default 4k; 1k with "
                        "--quick)")
    parser.add_argument("--pages", type=parse_counts, default=[16], help="page sizes to count paged too, e.g. "
                        "16,256 (default 16; '' for none)")
    parser.add_argument("--calls", type=positive_int, default=4, help="calls counted past the first (default 4; 1 "
                        "with --quick)")
    parser.add_argument("--against", metavar="REV", help="also count the NEON path of decode_native.cpp at git "
                        "revision REV (e.g. HEAD)")


def missing_tools() -> list[str]:
    """What this bench needs that is not installed (Debian: g++-aarch64-linux-gnu, qemu-user; a host C compiler)."""
    return [tool for tool in (CXX, QEMU, "cc") if shutil.which(tool) is None]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise SystemExit(f"bench arm: {' '.join(command[:3])} ... failed:\n{(done.stdout + done.stderr)[-2000:]}")
    return done


def build(folder: Path, against: str | None) -> tuple[Path, dict[str, Path]]:
    """The plugin (host cc) and a driver for each build (cross g++): the working tree's source on the portable and the
    NEON path, and with ``against``, that revision's on the NEON path; built side by side."""
    plugin = folder / "libqemu_icount.so"
    builds = dict(PATHS)
    if against:
        old = folder / "against.cpp"
        old.write_text(source_at(against))
        builds[f"neon at {against}"] = (f'-DKERNEL_SOURCE="{old}"',)
    drivers = {name: folder / f"decode_driver_{index}" for index, name in enumerate(builds)}
    commands = [["cc", "-shared", "-fPIC", "-O2", str(HERE / "qemu_icount.c"), "-o", str(plugin)]]
    commands += [[CXX, "-O3", "-std=c++17", "-pthread", "-march=armv8-a", "-fopenmp", "-Wno-psabi", *flags,
                  str(HERE / "decode_driver.cpp"), "-o", str(drivers[name])] for name, flags in builds.items()]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(_run, commands))
    return plugin, drivers


def instructions(plugin: Path, driver: Path, kind: int, keys: int, page: int, calls: int) -> int:
    """The guest instructions of one run of the driver: ``calls`` decode calls and what precedes them."""
    done = _run([QEMU, "-L", SYSROOT, "-plugin", str(plugin), str(driver), str(kind), str(keys), str(page), str(calls)])
    counts = [line.split()[1] for line in done.stderr.splitlines() if line.startswith("instructions ")]
    if len(counts) != 1:
        raise SystemExit(f"bench arm: qemu printed no instruction count (its plugin API may differ from 7.2-8.x's): "
                         f"{done.stderr[-500:]}")
    return int(counts[0])


def per_key_head(plugin: Path, driver: Path, kind: int, keys: int, page: int, calls: int) -> float:
    """Instructions per call, per key and KV head: (calls + 1 calls) - (1 call), over calls * keys * 8 heads."""
    counts = [instructions(plugin, driver, kind, keys, page, n) for n in (calls + 1, 1)]
    return (counts[0] - counts[1]) / (calls * keys * 8)


def main(args: argparse.Namespace) -> int:
    missing = missing_tools()
    if missing:
        print(f"bench arm: needs {', '.join(missing)} (Debian: g++-aarch64-linux-gnu, qemu-user)")
        return 1
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise SystemExit(f"bench arm: --kinds takes {', '.join(KINDS)}; got {args.kinds!r}")
    keys = 1024 if args.quick else args.keys
    calls = 1 if args.quick else args.calls
    pages = args.pages
    if any(keys % p for p in pages):
        raise SystemExit(f"bench arm: --keys {keys} is not a multiple of every page size {pages}")
    layouts = [("contiguous", 0)] + [(f"pages of {p}, shuffled", p) for p in pages]
    cases = [(kind, layout, page) for kind in kinds for layout, page in layouts]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-arm-") as folder:
        print("building the plugin and the aarch64 drivers (the NEON and portable paths): ~30 s a build")
        plugin, drivers = build(Path(folder), args.against)
        with ThreadPoolExecutor(2) as pool:
            for kind, layout, page in progress(cases, "bench arm", quiet=args.quiet):
                runs = {name: pool.submit(per_key_head, plugin, driver, KINDS[kind], keys, page, calls)
                        for name, driver in drivers.items()}
                counted = {name: run.result() for name, run in runs.items()}
                row = {"kind": kind, "layout": layout, **counted, "neon / portable": counted["neon"] /
                       counted["portable"]}
                if args.against:
                    row[f"neon / at {args.against}"] = counted["neon"] / counted[f"neon at {args.against}"]
                rows.append(row)
    print("\nInstructions per key and KV head (aarch64 under qemu; B 1, Hq 32 / Hkv 8, D 128, "
          f"{keys} keys, one thread):")
    print(format_table(rows))
    meta = {**machine_info(), "keys": keys, "calls": calls, "against": args.against, "compiler": _version(CXX),
            "qemu": _version(QEMU), "flags": "-O3 -std=c++17 -march=armv8-a -fopenmp"}
    paths = save_results(args.out, "arm", rows, meta)
    fig, (ax,) = plots.figure(width=7.0)
    labels = [f"{r['kind']}, {r['layout']}" for r in rows]
    plots.grouped_bars(ax, labels, {name: [r[name] for r in rows] for name in drivers})
    ax.set_ylim(bottom=0)
    ax.set_ylabel("instructions per key and KV head")
    ax.set_title("decode_native on aarch64 (qemu): NEON vs portable C++", fontsize=9)
    paths.append(plots.save(fig, Path(args.out) / "arm.png"))
    print("\nsaved: " + ", ".join(str(p) for p in paths))
    return 0


def _version(tool: str) -> str:
    done = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60)
    return done.stdout.splitlines()[0] if done.stdout else "?"
