"""``run.py bench latent``: absorbed-MLA decode over a latent cache (one row of R + r = 512 + 64 numbers per key,
its values the first 512: engine.shared_rows) beside what the same step costs otherwise, measured in one run.

One decode step (B = 1, one new query per head) of a DeepSeek V2 / V3 attention layer, ``H`` heads:

- ``latent, shared rows``: ``engine.plan(q' [1, H, 1, 576], rows [1, 1, S, 576], rows[..., :512])`` (the absorbed
  form's attention: each row read once for every head);
- ``latent, rows apart``: the same with V a copy of the rows' first 512 columns (each key's bytes read twice);
- ``latent, shared rows, vector path`` (bf16, where the library runs bf16 K/V of many rows on AMX-BF16 tiles): the
  shared-rows call with the tiles turned off, in the same run;
- ``expanded cache``: the non-absorbed form's attention, per-head keys ``[1, H, S, 192]`` and values ``[1, H, S,
  128]`` (what a non-absorbed cache holds: H (192 + 128) numbers per token; skipped past ``--max-gib``);
- ``contiguous decode``: the project's usual decode shape, Hq 32 / Hkv 8 / D 128 over S keys (the target's yardstick:
  its K/V bytes read per second);
- ``copy``: a copy of the rows' buffer, (bytes read + written) / s.

GB/s counts the bytes a call must read (latent: 576 numbers per key, once); ``ms / expanded`` is the latent step's
time over the expanded cache's; ``equal to rows apart``: shared rows give bitwise the rows-apart result. Target: the
shared-rows latent decode reads at least the contiguous decode's GB/s.

    python run.py bench latent --quick      # S = 1k: seconds
    python run.py bench latent              # H 16 / 128, S 4k / 32k, fp32 / bf16
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import engine
from engine.kernels.decode.native_build import load_native
from lab import plots
from lab.measure import format_table, machine_info, median_ms, progress, save_results
from lab.options import add_common, apply_threads, positive_float

LATENT, ROPE, NOPE, V = 512, 64, 128, 128  # DeepSeek V2 / V3: kv_lora_rank, rope, nope and v head dims
ROW = LATENT + ROPE
SCALE = (NOPE + ROPE) ** -0.5
VECTOR = "latent, shared rows, vector path"  # (bf16 where the library has AMX-BF16 tiles: the same call without them)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "bench_latent", impl_help="ignored (every row runs)", threads=2)
    parser.add_argument("--max-gib", type=positive_float, default=4.0,
                        help="skip an expanded-cache row whose K/V would pass this many GiB (default 4)")


def _randn(shape, dtype, g) -> torch.Tensor:
    return torch.empty(shape).normal_(generator=g).to(dtype)


def case_rows(heads: int, s: int, dtype: torch.dtype, args, g) -> list[dict[str, Any]]:
    size = torch.tensor([], dtype=dtype).element_size()
    repeats = 3 if args.quick else max(5, args.repeats)
    rows_kv = _randn((1, 1, s, ROW), dtype, g)  # the latent cache's rows
    q = _randn((1, heads, 1, ROW), dtype, g)  # absorbed queries [q_nope W_UK | q_pe]
    apart = rows_kv[..., :LATENT].clone()
    calls = {"latent, shared rows": (q, rows_kv, rows_kv[..., :LATENT], ROW),
             "latent, rows apart": (q, rows_kv, apart, ROW + LATENT)}
    expanded_bytes = heads * s * (NOPE + ROPE + V) * size
    if expanded_bytes <= args.max_gib * 2**30:
        calls["expanded cache"] = (_randn((1, heads, 1, NOPE + ROPE), dtype, g),
                                   _randn((1, heads, s, NOPE + ROPE), dtype, g), _randn((1, heads, s, V), dtype, g),
                                   heads * (NOPE + ROPE + V))
    calls["contiguous decode"] = (_randn((1, 32, 1, 128), dtype, g), _randn((1, 8, s, 128), dtype, g),
                                  _randn((1, 8, s, 128), dtype, g), 2 * 8 * 128)
    library = load_native()
    if dtype == torch.bfloat16 and not isinstance(library, str) and library.bf16_tiles:  # the tiles' yardstick
        calls[VECTOR] = calls["latent, shared rows"]
    out, results = [], {}
    for name, (qq, k, v, numbers) in calls.items():
        step = engine.plan(qq, k, v, scale=SCALE if name != "contiguous decode" else None)
        if name == VECTOR:
            library.use_bf16_tiles(False)
        try:
            ms = median_ms(lambda step=step, qq=qq, k=k, v=v: step.run(qq, k, v), repeats=repeats)
        finally:
            if name == VECTOR:
                library.use_bf16_tiles(True)
        results[name] = step.run(qq, k, v)
        out.append({"case": f"H {heads} S {s} {str(dtype).removeprefix('torch.')}", "impl": name,
                    "kernel": step.kernel, "ms": ms, "GB/s": numbers * s * size / ms / 1e6,
                    "cache bytes / token": numbers * size if name != "contiguous decode" else None})
    same = torch.equal(results["latent, shared rows"], results["latent, rows apart"])
    target = torch.empty_like(rows_kv)
    copy_ms = median_ms(lambda: target.copy_(rows_kv), repeats=repeats)
    out.append({"case": out[0]["case"], "impl": "copy", "kernel": "-", "ms": copy_ms,
                "GB/s": 2 * rows_kv.nbytes / copy_ms / 1e6, "cache bytes / token": None})
    shared = out[0]["GB/s"]
    contiguous = next(r["GB/s"] for r in out if r["impl"] == "contiguous decode")
    expanded = next((r["ms"] for r in out if r["impl"] == "expanded cache"), None)
    for row in out:
        row["vs contiguous GB/s"] = row["GB/s"] / contiguous
        latent = row["impl"].startswith("latent")
        row["ms / expanded"] = row["ms"] / expanded if latent and expanded else None
        row["equal to rows apart"] = same if latent and row["impl"] != VECTOR else None
        row["target"] = ">= 1.0x contiguous" if row["impl"] == "latent, shared rows" else None
        row["met"] = ("yes" if shared >= contiguous else "no") if row["target"] else None
    return out


def plot(rows: list[dict[str, Any]], path) -> None:
    fig, axes = plots.figure(ncols=1, width=7.0)
    ax = axes[0]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    impls = [i for i in dict.fromkeys(r["impl"] for r in rows) if i != "copy"]
    width = 0.8 / len(impls)
    for n, impl in enumerate(impls):
        values = [next((r["GB/s"] for r in rows if r["case"] == c and r["impl"] == impl), 0.0) for c in cases]
        ax.bar([i + n * width for i in range(len(cases))], values, width, label=impl)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], cases, rotation=25, ha="right", fontsize=7)
    ax.set_ylabel("GB/s of the bytes each call must read")
    ax.set_title("latent (absorbed MLA) decode vs rows apart, an expanded cache and the usual decode")
    ax.legend(fontsize=7)
    plots.save(fig, path)


def main(args: argparse.Namespace) -> int:
    apply_threads(args)
    g = torch.Generator().manual_seed(args.seed)
    sizes = [1024] if args.quick else [4096, 32768]
    cases = [(h, s, dt) for h in (16, 128) for s in sizes for dt in (torch.float32, torch.bfloat16)]
    rows = []
    with torch.no_grad():
        for heads, s, dtype in progress(cases, "bench latent", quiet=args.quiet):
            rows += case_rows(heads, s, dtype, args, g)
    print(format_table(rows, ["case", "impl", "kernel", "ms", "GB/s", "vs contiguous GB/s", "ms / expanded",
                              "cache bytes / token", "equal to rows apart", "target", "met"]))
    paths = save_results(args.out, "latent", rows, {**machine_info(), "command": "bench latent", "args": vars(args)})
    plot(rows, f"{args.out}/latent.png")
    print("\nwrote " + ", ".join(str(p) for p in paths) + f", {args.out}/latent.png")
    return 0
