"""``run.py bench sparse``: top-k sparse attention (``key_indices``) beside SDPA with the dense top-k mask that
transformers builds for eager / sdpa, measured interleaved in one run.

Each query of a causal prefill lists K keys drawn among those at or before it (as DeepSeek V3.2's indexer picks
them), one list shared by every head. Rows:

- ``engine sparse``: ``engine.plan(..., key_indices=...)`` forced to the ``sparse`` kernel (only the listed keys
  gathered, a chunk of queries at a time); ``engine native listed``: forced to ``decode_native``, which reads the
  listed keys in place (every query its own sequence of a page table of one-key pages,
  engine.kernels.decode.native_listed), timed run alone (``ms``) and with its plan made each time (``plan + run
  ms``: the tables built, as a model's layer does per call), which carries the target; ``engine auto``: what auto
  picks (and why not, in ``kernel``);
- ``sdpa dense mask``: ``F.scaled_dot_product_attention`` with the bool ``[1, 1, T, S]`` mask of the indices and the
  rule (the peer; its mask costs T x S bytes, in ``mask MiB``);
- a decode step (T = 1) against S keys beside a dense decode over K keys (``engine plan.run`` on K contiguous
  keys): ``engine native listed`` is decode_native reading only the listed keys in place (a page table of one-key
  pages, engine.kernels.decode.native_listed; auto's choice for a decode step), ``engine paged listed`` the same
  keys in a pool of shuffled pages of 16, each page's heads side by side (``PagedKVCache(heads_outer=False)``'s
  layout; on huge pages, as the engine's caches are) read in place by ``engine.plan_paged(..., key_indices=)``
  (engine.kernels.decode.native_paged_listed); the target, on both, is a decode time set by K, not S.

    python run.py bench sparse --quick      # S = 2k, T = 256, K = 128: seconds
    python run.py bench sparse              # S = 8k / 32k / 128k, T = 1k / 4k, K = 512 / 2048: minutes, ~6 GiB

Targets: a prefill >= 8x faster than the dense mask, a decode <= 1.5x a dense decode over K keys.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.nn.functional as F

import engine
from engine import huge_pages
from lab import plots
from lab.measure import format_table, machine_info, progress, save_results
from lab.options import add_common, apply_threads

PREFILL_TARGET, DECODE_TARGET = 8.0, 1.5
D = 64
PAGE = 16  # the paged decode row's page size
LONG = 131072  # S = 128k: a prefill of Hq 16 / Hkv 1 (its dense mask 512 MiB) and the decodes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "bench_sparse", impl_help="ignored (every row runs)", threads=2)


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def prefill_rows(args, g) -> list[dict[str, Any]]:
    sizes = [(2048, 256, 128)] if args.quick else [(8192, 1024, 512), (32768, 4096, 2048), (LONG, 4096, 2048)]
    cases = [(z, h) for z in sizes for h in [(16, 1), (8, 8)] if z[0] < LONG or h == (16, 1)]
    rows = []
    for (s, t, k), (hq, hkv) in progress(cases, "bench sparse: prefill", quiet=args.quiet):
        rows += _prefill_case(s, t, k, hq, hkv, g, args)
    return rows


def _prefill_case(s: int, t: int, k: int, hq: int, hkv: int, g, args) -> list[dict[str, Any]]:
    rows = []
    q = torch.randn(1, hq, t, D, generator=g)
    keys, values = (cache_buffer(torch.randn(1, hkv, s, D, generator=g)) for _ in range(2))  # as a KVCache's
    qpos, kpos = torch.arange(s - t, s), torch.arange(s)
    listed = (torch.rand(1, 1, t, k, generator=g) * (qpos[None, None, :, None] + 1)).long()  # at or before
    forced = engine.plan(q, keys, values, qpos, kpos, key_indices=listed, kernel="sparse")
    auto = engine.plan(q, keys, values, qpos, kpos, key_indices=listed)
    native = engine.plan(q, keys, values, qpos, kpos, key_indices=listed, kernel="decode_native")
    mask = torch.zeros(1, 1, t, s, dtype=torch.bool).scatter_(3, listed, True)  # [1, 1, T, S]: the peer's
    mask &= kpos[None, None, None, :] <= qpos[None, None, :, None]
    group = hq // hkv
    peer = (lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=group > 1))
    repeats = 1 if args.quick or s > 8192 else args.repeats
    planned = {"engine native listed": lambda: engine.plan(q, keys, values, qpos, kpos, key_indices=listed,
                                                           kernel="decode_native").run(q, keys, values)}
    slow = hkv > 1 and s > 8192  # the sparse kernel gathers one query at a time there: minutes (see S = 8k)
    ms = {"engine native listed": _median_ms(lambda: native.run(q, keys, values), repeats),
          "engine auto": _median_ms(lambda: auto.run(q, keys, values), repeats),
          "sdpa dense mask": _median_ms(peer, repeats)}
    if not slow:
        ms["engine sparse"] = _median_ms(lambda: forced.run(q, keys, values), repeats)
    with_plan = {name: _median_ms(fn, repeats) for name, fn in planned.items()}
    want = peer()
    diff = {name: (plan.run(q, keys, values) - want).abs().max().item()
            for name, plan in (("engine sparse", forced), ("engine native listed", native), ("engine auto", auto))
            if name in ms}
    case = f"prefill T={t} S={s} K={k} Hq {hq} / Hkv {hkv}"
    for name, kernel in (("engine sparse", "sparse"), ("engine native listed", native.kernel),
                         ("engine auto", auto.kernel), ("sdpa dense mask", "-")):
        if name not in ms:
            continue
        target = name == "engine native listed"  # carries the target, timed with its plan (the tables) made
        speedup = ms["sdpa dense mask"] / with_plan.get(name, ms[name])
        rows.append({"group": "prefill", "case": case, "impl": name, "kernel": kernel, "ms": ms[name],
                     "plan + run ms": with_plan.get(name), "speedup vs dense mask": speedup,
                     "mask MiB": mask.numel() / 2**20 if name.startswith("sdpa") else 0.0,
                     "target": f">= {PREFILL_TARGET}x" if target else None,
                     "met": ("yes" if speedup >= PREFILL_TARGET else "no") if target else None,
                     "max |diff|": diff.get(name, 0.0)})
    return rows


def cache_buffer(x: torch.Tensor) -> torch.Tensor:
    """``x`` copied into a buffer on huge pages, as the engine's caches hold their keys (engine.huge_pages)."""
    return huge_pages.zeros(*x.shape, dtype=x.dtype, device=x.device).copy_(x)


def decode_rows(args, g) -> list[dict[str, Any]]:
    sizes = [(2048, 128)] if args.quick else [(8192, 512), (32768, 2048), (LONG, 2048)]
    rows = []
    for (s, k), (hq, hkv) in progress([(z, h) for z in sizes for h in [(16, 1), (8, 8)]], "bench sparse: decode",
                                      quiet=args.quiet):
        rows += _decode_case(s, k, hq, hkv, g, args)
    return rows


def _decode_case(s: int, k: int, hq: int, hkv: int, g, args) -> list[dict[str, Any]]:
    rows = []
    q = torch.randn(1, hq, 1, D, generator=g)
    keys, values = (cache_buffer(torch.randn(1, hkv, s, D, generator=g)) for _ in range(2))  # as a KVCache's
    listed = torch.randint(0, s, (1, 1, 1, k), generator=g)
    forced = engine.plan(q, keys, values, key_indices=listed, kernel="sparse")
    native = engine.plan(q, keys, values, key_indices=listed, kernel="decode_native")
    auto = engine.plan(q, keys, values, key_indices=listed)
    few_k, few_v = keys[:, :, :k].contiguous(), values[:, :, :k].contiguous()
    dense = engine.plan(q, few_k, few_v)
    pages = s // PAGE
    order = torch.randperm(pages, generator=g)  # the sequence's pages shuffled in the pool
    k_pool, v_pool = (huge_pages.zeros(pages, hkv, PAGE, D, dtype=torch.float32, device="cpu").permute(0, 2, 1, 3)
                      .index_copy_(0, order, x[0].transpose(0, 1).reshape(pages, PAGE, hkv, D))
                      for x in (keys, values))  # each page's heads side by side, on huge pages
    paged_args = (q[0].transpose(0, 1), k_pool, v_pool, order[None], torch.tensor([s]), torch.tensor([0, 1]))
    paged = engine.plan_paged(*paged_args, key_indices=listed[0].transpose(0, 1))  # [Nq = 1, 1, K]
    repeats = 5 if args.quick else 21
    ms = {"engine sparse": _median_ms(lambda: forced.run(q, keys, values), repeats),
          "engine native listed": _median_ms(lambda: native.run(q, keys, values), repeats),
          "engine paged listed": _median_ms(lambda: paged.run(*paged_args[:3]), repeats),
          "engine auto": _median_ms(lambda: auto.run(q, keys, values), repeats),
          "dense decode over K keys": _median_ms(lambda: dense.run(q, few_k, few_v), repeats)}
    case = f"decode S={s} K={k} Hq {hq} / Hkv {hkv}"
    paged_diff = (paged.run(*paged_args[:3])[0] - native.run(q, keys, values)[0, :, 0]).abs().max().item()
    for name, kernel in (("engine sparse", "sparse"), ("engine native listed", native.kernel),
                         ("engine paged listed", f"{paged.path} (max |diff| {paged_diff:.1e})"),
                         ("engine auto", auto.kernel), ("dense decode over K keys", dense.kernel)):
        ratio = ms[name] / ms["dense decode over K keys"]
        target = name in ("engine native listed", "engine paged listed")
        rows.append({"group": "decode", "case": case, "impl": name, "kernel": kernel, "ms": ms[name],
                     "time / dense over K": ratio, "target": f"<= {DECODE_TARGET}x" if target else None,
                     "met": ("yes" if ratio <= DECODE_TARGET else "no") if target else None})
    return rows


def plot(rows: list[dict[str, Any]], path) -> None:
    fig, axes = plots.figure(ncols=2, width=6.0)
    panels = ((axes[0], "prefill", "speedup vs dense mask"), (axes[1], "decode", "time / dense over K"))
    for ax, group, column in panels:
        mine = [r for r in rows if r["group"] == group and r["target"]]
        ax.bar(range(len(mine)), [r[column] for r in mine])
        ax.axhline(PREFILL_TARGET if group == "prefill" else DECODE_TARGET, color="gray", linestyle="--",
                   label="target")
        ax.set_xticks(range(len(mine)), [r["case"].removeprefix(group + " ") for r in mine], rotation=25, ha="right",
                      fontsize=7)
        ax.set_ylabel(column)
        ax.set_title(f"sparse {group} ({mine[0]['impl'] if mine else ''})")
        ax.legend()
    plots.save(fig, path)


def main(args: argparse.Namespace) -> int:
    apply_threads(args)
    g = torch.Generator().manual_seed(args.seed)
    rows = prefill_rows(args, g) + decode_rows(args, g)
    print(format_table([r for r in rows if r["group"] == "prefill"],
                       ["case", "impl", "kernel", "ms", "plan + run ms", "speedup vs dense mask", "mask MiB", "target",
                        "met", "max |diff|"]))
    print("\n" + format_table([r for r in rows if r["group"] == "decode"],
                              ["case", "impl", "kernel", "ms", "time / dense over K", "target", "met"]))
    paths = save_results(args.out, "sparse", rows, {**machine_info(), "command": "bench sparse", "args": vars(args)})
    plot(rows, f"{args.out}/sparse.png")
    print("\nwrote " + ", ".join(str(p) for p in paths) + f", {args.out}/sparse.png")
    return 0
