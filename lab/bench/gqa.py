"""``run.py bench gqa``: bytes read and FLOPs of one decode step for Hq = 32 and Hkv in {1, 8, 32}: exercise F
("Intensity of GQA") of the attention-from-first-principles notes.

The notes' claim: a decode step does ``4 * B * Hq * S * D`` FLOPs and reads ``2 * B * Hkv * S * D * bytes`` of
KV cache, so its arithmetic intensity is ``Hq / Hkv`` FLOP/B in fp16/bf16: GQA shrinks the cache *and* makes
decode less memory-bound.

What is measured, per implementation and Hkv (see ``lab.traffic``):
- FLOPs and bytes are *counted from the aten ops that actually run* (a dispatch mode sees every op with its
  real tensors): ``kv_read`` is what the ops read from q, k and v; ``other_read`` what they read from tensors
  made on the way (casts, copies, scores). These are bytes requested by ops, not DRAM bytes: a fused op
  (torch-sdpa) shows only its arguments, and repeated reads that hit the caches still count.
- Time is a median wall time; ``kv GB/s`` divides the counted KV bytes by it (timing-derived bandwidth).
- The formula columns are the notes' formulas, for comparison.

``grouped`` is the lab's decode probe: each KV head is read once by one matmul serving its G query heads.
"""

from __future__ import annotations

import argparse

import torch

from engine.planning import explain
from lab import implementations, plots
from lab.fitting import fit_power_law
from lab.implementations import grouped_decode
from lab.measure import format_table, machine_info, median_ms, progress, save_results
from lab.options import add_common, apply_threads, parse_counts, positive_float, positive_int
from lab.traffic import TrafficCounter

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Compiled kernels run as one higher-order op whose inside the dispatch mode cannot see (and must not try to:
# a compile interrupted by the mode leaves torch.compile unable to trace that op again in this process).
# Kernels whose work happens outside aten ops, so the traffic counter cannot see their FLOPs and bytes.
UNCOUNTABLE = {"engine:flex": "a compiled FlexAttention kernel: no aten ops to count inside it",
               "engine:decode_native": "a C++ kernel called through ctypes: no aten ops to count inside it"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "gqa", impl_help="comma-separated implementations, or 'all' (default): grouped (the lab's "
               "decode probe), every engine kernel of engine.kernels.dispatch.KERNELS, and torch-sdpa")
    parser.add_argument("--q-heads", type=positive_int, default=32, help="query heads Hq (default 32)")
    parser.add_argument("--kv-heads", type=parse_counts, default=[1, 8, 32],
                        help="comma-separated KV head counts, each dividing Hq (default 1,8,32)")
    parser.add_argument("--context", type=positive_int, default=32768, help="cached keys S (default 32768)")
    parser.add_argument("--head-dim", type=positive_int, default=128, help="head dim D (default 128)")
    parser.add_argument("--batch", type=positive_int, default=1, help="batch size B (default 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                        help="KV cache dtype (default bf16: 2 bytes, which makes the formula's intensity Hq / Hkv)")
    parser.add_argument("--max-seconds", type=positive_float, default=3.0,
                        help="stop repeating a timing after this many seconds (default 3)")


def _kernel_of(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The implementation that does the work: ``engine:auto`` is the kernel dispatch picks for these inputs."""
    return f"engine:{explain(q, k, v).kernel}" if name == "engine:auto" else name


def decode_row(name: str, fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args) -> dict:
    """Count one call's traffic and FLOPs, time it, and compare with the notes' formulas."""
    with TrafficCounter(inputs=(q, k, v)) as traffic:
        fn(q, k, v)
    ms = median_ms(lambda: fn(q, k, v), repeats=args.repeats, warmup=1, max_seconds=args.max_seconds)
    batch, q_heads, _, d = q.shape
    kv_heads, s, element = k.shape[1], k.shape[2], k.element_size()
    formula_flops = 4 * batch * q_heads * s * d
    formula_bytes = 2 * batch * kv_heads * s * d * element
    return {"Hkv": kv_heads, "G": q_heads // kv_heads, "impl": name,
            "MFLOP": traffic.flops / 1e6, "formula_MFLOP": formula_flops / 1e6,
            "kv_read_MB": traffic.input_bytes_read / 1e6, "formula_MB": formula_bytes / 1e6,
            "other_read_MB": traffic.other_bytes_read / 1e6, "written_MB": traffic.bytes_written / 1e6,
            "intensity": traffic.flops / traffic.input_bytes_read,
            "intensity_all_traffic": traffic.flops / (traffic.bytes_read + traffic.bytes_written),
            "formula_intensity": formula_flops / formula_bytes,
            "ms": ms, "kv_GB/s": traffic.input_bytes_read / ms / 1e6, "GFLOP/s": traffic.flops / ms / 1e6}


def run_rows(args: argparse.Namespace, impls: dict) -> list[dict]:
    """One row per (Hkv, implementation)."""
    dtype = DTYPES[args.dtype]
    generator = torch.Generator().manual_seed(args.seed)
    rows = []
    jobs = [(kv_heads, name) for kv_heads in args.kv_heads for name in impls]
    for kv_heads, name in progress(jobs, "bench gqa", quiet=args.quiet):
        shape_kv = (args.batch, kv_heads, args.context, args.head_dim)
        q = torch.randn(args.batch, args.q_heads, 1, args.head_dim, generator=generator).to(dtype)  # [B, Hq, 1, D]
        k = torch.randn(shape_kv, generator=generator).to(dtype)  # [B, Hkv, S, D]
        v = torch.randn(shape_kv, generator=generator).to(dtype)  # [B, Hkv, S, D]
        uncountable = UNCOUNTABLE.get(_kernel_of(name, q, k, v))
        if uncountable is not None:
            print(f"{name}: Hkv={kv_heads} not measured ({uncountable})")
            continue
        why_not = implementations.why_not_fast(name, q, k, v)
        if why_not is not None:
            print(f"{name}: Hkv={kv_heads} not measured, its fast path does not apply ({why_not})")
            continue
        rows.append(decode_row(name, impls[name], q, k, v, args))
    return rows


def plot(rows: list[dict], path, title: str) -> None:
    """Left: counted intensity vs G with the formula's line. Right: time per step vs KV cache size. Legend apart."""
    fig, (ax_i, ax_t, ax_legend) = plots.plt.subplots(1, 3, figsize=(15, 4.8), width_ratios=[1, 1, 0.5])
    plots.loglog(ax_i, f"Decode intensity vs group size\n{title}", "G = Hq / Hkv (query heads per KV head)",
                 "arithmetic intensity (FLOP per byte)")
    plots.loglog(ax_t, f"Time per decode step vs KV cache size\n{title}", "KV cache size, 2 Hkv S D bytes (MB)",
                 "time per decode step (ms)", base=10)
    groups = sorted({r["G"] for r in rows})
    seed = {r["G"]: r["formula_intensity"] for r in rows}
    handles = ax_i.plot(groups, [seed[g] for g in groups], color="black", linewidth=4, alpha=0.25,
                        label="formula: 4 Hq S D / (2 Hkv S D bytes)")
    names = list(dict.fromkeys(r["impl"] for r in rows))
    for i, name in enumerate(names):
        mine = sorted((r for r in rows if r["impl"] == name), key=lambda r: r["G"])
        xs = [r["G"] for r in mine]
        plots.series(ax_i, xs, [r["intensity"] for r in mine], name, i, color=f"C{i}")
        plots.series(ax_i, xs, [r["intensity_all_traffic"] for r in mine], name, i, color=f"C{i}",
                     linestyle="--", markerfacecolor="white")
        plots.series(ax_t, [r["formula_MB"] for r in mine], [r["ms"] for r in mine], name, i, color=f"C{i}")
    sizes = sorted({r["formula_MB"] for r in rows})
    largest = max((r for r in rows if r["formula_MB"] == sizes[-1]), key=lambda r: -r["ms"])
    plots.power_guide(ax_t, sizes, (largest["formula_MB"], largest["ms"]), 1.0, "time ~ bytes (memory-bound)")
    for r in rows:
        if r["impl"] == names[0]:
            ax_t.annotate(f"Hkv={r['Hkv']}", (r["formula_MB"], r["ms"]), textcoords="offset points",
                          xytext=(4, -12), fontsize=8)
    styles = [plots.plt.Line2D([], [], color="grey", marker="o", label="solid: FLOPs / KV bytes read (q, k, v)"),
              plots.plt.Line2D([], [], color="grey", marker="o", linestyle="--", markerfacecolor="white",
                               label="dashed: FLOPs / all op traffic")]
    colours = [plots.plt.Line2D([], [], color=f"C{i}", marker=plots.MARKERS[i % len(plots.MARKERS)], label=name)
               for i, name in enumerate(names)]
    guide = ax_t.get_lines()[-1]
    ax_legend.axis("off")
    ax_legend.legend(handles=handles + styles + colours + [guide], loc="center left", fontsize=8,
                     title="left: intensity; right: time", title_fontsize=8)
    plots.save(fig, path)


def _quick(args: argparse.Namespace) -> None:
    args.q_heads, args.kv_heads, args.context, args.head_dim = 8, [1, 2, 8], 512, 32
    args.repeats, args.max_seconds = 1, 1.0


def main(args: argparse.Namespace) -> int:
    if args.quick:
        _quick(args)
    apply_threads(args)
    bad = [h for h in args.kv_heads if args.q_heads % h]
    if bad:
        print(f"error: every --kv-heads must divide --q-heads ({args.q_heads}), got {bad}")
        return 2
    try:
        impls = implementations.select(args.impl, extra={"grouped": grouped_decode})
    except ValueError as error:
        print(f"error: {error}")
        return 2
    impls = {"grouped": impls.pop("grouped"), **impls} if "grouped" in impls else impls
    print(f"decode: B={args.batch}, Hq={args.q_heads}, Hkv in {args.kv_heads}, S={args.context}, "
          f"D={args.head_dim}, {args.dtype}; torch threads {torch.get_num_threads()}")
    rows = run_rows(args, impls)
    print("\n" + format_table(rows, ["Hkv", "G", "impl", "MFLOP", "kv_read_MB", "formula_MB", "other_read_MB",
                                     "intensity", "formula_intensity", "intensity_all_traffic", "ms", "kv_GB/s"]))
    print("\nintensity = counted FLOPs / counted bytes read from q, k, v; fitted against G = Hq / Hkv:")
    for name in impls:
        mine = [r for r in rows if r["impl"] == name]
        if len({r["G"] for r in mine}) >= 2:
            slope, _ = fit_power_law([r["G"] for r in mine], [r["intensity"] for r in mine])
            values = ", ".join(f"G={r['G']}: {r['intensity']:.2f}" for r in mine)
            print(f"  {name}: intensity ~ G^{slope:.3f} ({values} FLOP/B)")
    meta = {"command": "bench gqa", "args": vars(args), "machine": machine_info()}
    paths = save_results(args.out, "gqa", rows, meta)
    plot(rows, f"{args.out}/gqa.png", f"Hq={args.q_heads}, S={args.context}, D={args.head_dim}, {args.dtype}")
    print("\nwrote " + ", ".join(str(p) for p in paths) + f", {args.out}/gqa.png")
    return 0
