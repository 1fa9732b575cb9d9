"""``run.py bench roofline``: prefill vs decode attention on this machine's measured roofline: exercise E
("Decode vs prefill") of the attention-from-first-principles notes.

1. Peak compute: the best GFLOP/s of square GEMMs (``a @ b``, 2 n^3 FLOPs) in the bench dtype.
2. Peak bandwidth: the best GB/s of three streaming kernels over arrays far larger than the caches:
   read (``x.sum()``, N bytes), copy (``y.copy_(x)``, 2N) and triad (``a = b + 2 c``, 3N), STREAM's counting.
3. Attention: prefill (T = S, causal) and decode (T = 1 against S cached keys) for every implementation
   (and, for decode, ``grouped``: the plain-torch decode probe of ``bench gqa``).
   FLOPs are the causal work, ``4 * B * H * D * (visible query-key pairs)``; bytes are the compulsory traffic,
   reading q, k, v once and writing the output once. Intensity = FLOPs / bytes, a property of the shape.

Roof: ``attainable = min(peak FLOP/s, bandwidth * intensity)``; the ridge is ``peak / bandwidth``. Prefill's
intensity grows with T (about T/4 FLOP/B in fp32), decode's is about 0.5 FLOP/B in fp32 whatever S is.
"""

from __future__ import annotations

import argparse

import torch

from lab import implementations, plots
from lab.implementations import grouped_decode
from lab.measure import format_table, machine_info, median_ms, progress, save_results
from lab.options import add_common, apply_threads, positive_int

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "roofline", impl_help="comma-separated implementations, or 'all' (default): every engine "
               "kernel of engine.kernels.dispatch.KERNELS, torch-sdpa, and grouped (the decode probe of bench gqa)")
    parser.add_argument("--heads", type=positive_int, default=8, help="heads H = Hq = Hkv (default 8)")
    parser.add_argument("--head-dim", type=positive_int, default=128, help="head dim D (default 128)")
    parser.add_argument("--batch", type=positive_int, default=1, help="batch size B (default 1)")
    parser.add_argument("--prefill-t", type=positive_int, default=2048, help="prefill length T = S (default 2048)")
    parser.add_argument("--decode-s", type=positive_int, default=32768,
                        help="cached keys S for decode (default 32768: a 256 MiB fp32 KV cache, beyond the caches)")
    parser.add_argument("--gemm-n", type=positive_int, default=2048, help="largest square GEMM size n (default 2048)")
    parser.add_argument("--stream-mib", type=positive_int, default=256,
                        help="array size for the bandwidth kernels in MiB (default 256; keep it >> L3)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of GEMM and attention")


def peak_gemm(max_n: int, dtype: torch.dtype, repeats: int) -> list[dict]:
    """GFLOP/s of ``a @ b`` for n = max_n/4, max_n/2, max_n."""
    rows = []
    for n in sorted({max(16, max_n // 4), max(16, max_n // 2), max_n}):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)  # [n, n]
        ms = median_ms(lambda a=a, b=b: a @ b, repeats=repeats, warmup=1)
        rows.append({"kernel": f"gemm n={n}", "ms": ms, "GFLOP/s": 2 * n**3 / ms / 1e6, "GB/s": float("nan")})
    return rows


def peak_bandwidth(mib: int, repeats: int) -> list[dict]:
    """GB/s of read, copy and triad over fp32 arrays of ``mib`` MiB each."""
    n = mib * 2**20 // 4
    x, y, z = torch.randn(n), torch.randn(n), torch.empty(n)  # [n] fp32
    kernels = [("read x.sum()", lambda: x.sum(), 4 * n),
               ("copy y <- x", lambda: y.copy_(x), 8 * n),
               ("triad z = x + 2y", lambda: torch.add(x, y, alpha=2.0, out=z), 12 * n)]
    rows = []
    for name, fn, moved in kernels:
        ms = median_ms(fn, repeats=repeats, warmup=1)
        rows.append({"kernel": name, "ms": ms, "GFLOP/s": float("nan"), "GB/s": moved / ms / 1e6})
    return rows


def attention_cost(batch: int, heads: int, t: int, s: int, d: int, element: int) -> tuple[int, int]:
    """``(FLOPs, bytes)`` of causal attention, queries at the last t of s positions.

    Query i (0-based) sees ``s - t + i + 1`` keys; each visible pair costs ``2 D`` FLOPs for q.k and ``2 D``
    for the weighted sum of values. Bytes: q and out ``[B, H, T, D]``, k and v ``[B, H, S, D]``, once each.
    """
    pairs = t * (s - t) + t * (t + 1) // 2  # visible (query, key) pairs of one head
    flops = 4 * batch * heads * d * pairs
    moved = batch * heads * d * (2 * t + 2 * s) * element
    return flops, moved


def attention_rows(args: argparse.Namespace, impls: dict, ridge: float) -> list[dict]:
    """Time prefill and decode for each implementation; GFLOP/s, GB/s and intensity from ``attention_cost``."""
    dtype = DTYPES[args.dtype]
    element = torch.finfo(dtype).bits // 8
    generator = torch.Generator().manual_seed(args.seed)
    shapes = {"prefill": (args.prefill_t, args.prefill_t), "decode": (1, args.decode_s)}
    rows = []
    jobs = [(phase, name) for phase in shapes for name in impls]
    for phase, name in progress(jobs, "bench roofline", quiet=args.quiet):
        t, s = shapes[phase]
        q = torch.randn(args.batch, args.heads, t, args.head_dim, generator=generator).to(dtype)  # [B, H, T, D]
        k = torch.randn(args.batch, args.heads, s, args.head_dim, generator=generator).to(dtype)  # [B, H, S, D]
        v = torch.randn(args.batch, args.heads, s, args.head_dim, generator=generator).to(dtype)  # [B, H, S, D]
        why_not = implementations.why_not_fast(name, q, k, v)
        if name == "grouped" and t != 1:
            why_not = "the lab's decode probe runs one query per head"
        if why_not is not None:
            print(f"{name}: {phase} not measured, its fast path does not apply ({why_not})")
            continue
        fn = impls[name]
        ms = median_ms(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v), repeats=args.repeats, warmup=1)
        flops, moved = attention_cost(args.batch, args.heads, t, s, args.head_dim, element)
        intensity = flops / moved
        rows.append({"phase": phase, "impl": name, "T": t, "S": s, "ms": ms, "GFLOP/s": flops / ms / 1e6,
                     "GB/s": moved / ms / 1e6, "FLOP/B": intensity,
                     "bound": "compute" if intensity > ridge else "memory"})
    return rows


def plot(rows: list[dict], peak: float, bandwidth: float, path, title_extra: str) -> None:
    """The roofline (log-log) with one marker per (phase, implementation)."""
    import numpy as np

    fig, (ax,) = plots.figure(width=9.0, height=5.0)
    plots.loglog(ax, f"Roofline of this machine: prefill vs decode attention\n{title_extra}",
                 "arithmetic intensity (FLOP per byte moved)", "achieved GFLOP/s", base=10)
    ridge = peak / bandwidth
    lo = min(min(r["FLOP/B"] for r in rows), ridge) / 4
    hi = max(max(r["FLOP/B"] for r in rows), ridge) * 4
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    ax.plot(x, np.minimum(peak, bandwidth * x), color="black", linewidth=2,
            label=f"roof: min({peak:.1f} GFLOP/s, {bandwidth:.1f} GB/s x intensity)")
    ax.axvline(ridge, color="grey", linestyle=":", label=f"ridge: {ridge:.1f} FLOP/B")
    names = list(dict.fromkeys(r["impl"] for r in rows))
    for r in rows:
        color = f"C{names.index(r['impl']) % 10}"
        filled = r["phase"] == "prefill"
        ax.plot([r["FLOP/B"]], [r["GFLOP/s"]], marker="o" if filled else "s", markersize=9, linestyle="none",
                color=color, markerfacecolor=color if filled else "white", markeredgewidth=2)
    for i, name in enumerate(names):  # legend: one colour per implementation, one marker per phase
        ax.plot([], [], marker="D", linestyle="none", color=f"C{i % 10}", label=name)
    shapes = {r["phase"]: (r["T"], r["S"]) for r in rows}
    for phase, marker, face in (("prefill", "o", "black"), ("decode", "s", "white")):
        if phase in shapes:
            t, s = shapes[phase]
            ax.plot([], [], marker=marker, linestyle="none", color="black", markerfacecolor=face,
                    markeredgewidth=2, label=f"{phase}: T={t}, S={s}")
    ax.text(0.02, 0.97, "memory-bound (left of the ridge)", transform=ax.transAxes, va="top", fontsize=8)
    ax.text(0.98, 0.03, "compute-bound (right)", transform=ax.transAxes, ha="right", fontsize=8)
    ax.set_ylim(min(min(r["GFLOP/s"] for r in rows), bandwidth * lo) / 2, peak * 3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    plots.save(fig, path)


def _quick(args: argparse.Namespace) -> None:
    # the prefill is one of scaling --quick's points (Flex compiles each shape once per process, seconds on a CPU)
    args.heads, args.head_dim, args.prefill_t, args.decode_s = 1, 32, 128, 1024
    args.gemm_n, args.stream_mib, args.repeats = 256, 16, 1


def main(args: argparse.Namespace) -> int:
    if args.quick:
        _quick(args)
    apply_threads(args)
    try:
        impls = implementations.select(args.impl, extra={"grouped": grouped_decode})
    except ValueError as error:
        print(f"error: {error}")
        return 2
    print(f"{args.dtype}, torch threads {torch.get_num_threads()}; measuring peak GEMM and bandwidth ...")
    machine = peak_gemm(args.gemm_n, DTYPES[args.dtype], args.repeats) + peak_bandwidth(args.stream_mib, args.repeats)
    peak = max(r["GFLOP/s"] for r in machine if r["GFLOP/s"] == r["GFLOP/s"])
    bandwidth = max(r["GB/s"] for r in machine if r["GB/s"] == r["GB/s"])
    ridge = peak / bandwidth
    print(format_table(machine, ["kernel", "ms", "GFLOP/s", "GB/s"]))
    print(f"\npeak {peak:.1f} GFLOP/s, bandwidth {bandwidth:.1f} GB/s, ridge {ridge:.2f} FLOP/B\n")
    rows = attention_rows(args, impls, ridge)
    for r in rows:
        r["pct_of_roof"] = 100 * r["GFLOP/s"] / min(peak, bandwidth * r["FLOP/B"])
    print(format_table(rows, ["phase", "impl", "T", "S", "ms", "GFLOP/s", "GB/s", "FLOP/B", "bound", "pct_of_roof"]))
    for phase in ("prefill", "decode"):
        mine = [r for r in rows if r["phase"] == phase]
        print(f"{phase}: intensity {mine[0]['FLOP/B']:.2f} FLOP/B is {mine[0]['bound']}-bound "
              f"(ridge {ridge:.2f}); best {max(r['GFLOP/s'] for r in mine):.1f} GFLOP/s, "
              f"{max(r['GB/s'] for r in mine):.1f} GB/s")
    meta = {"command": "bench roofline", "args": vars(args), "peak_GFLOPs": peak, "bandwidth_GBs": bandwidth,
            "ridge_FLOP_per_B": ridge, "machine": machine_info()}
    paths = save_results(args.out, "roofline_machine", machine, meta) + save_results(args.out, "roofline", rows, meta)
    title = f"B={args.batch}, H={args.heads}, D={args.head_dim}, {args.dtype}, {torch.get_num_threads()} thread(s)"
    plot(rows, peak, bandwidth, f"{args.out}/roofline.png", title)
    print("\nwrote " + ", ".join(str(p) for p in paths) + f", {args.out}/roofline.png")
    return 0
