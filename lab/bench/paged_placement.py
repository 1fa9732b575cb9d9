"""``run.py bench paged --groups placement``: what the place of a pool's pages costs a paged decode.

The decode group's pools are shuffled, each page anywhere in the pool: the worst case. This group reads the same keys
(B 8, Hq 32 / Hkv 8, D 128, pages of 16, fp32 / bf16 / int8, S 8k and 32k; ``--quick``: 8k) from pools on 2 MiB
pages, as PagedKVCache holds them, in three placements (``lab.bench.paged_pools.placement_table``): ``shuffled``,
``in order`` (each sequence's pages following on, as a PagedKVCache with room gives them) and ``interleaved`` (what
a free list handing out the lowest id first gives sequences growing a token at a time in lock step), each planned
once (``engine.plan_paged``), beside the same keys contiguous (``engine.plan``, also on 2 MiB pages). ``paged`` rows
hold them with each page's heads side by side, ``[num_pages, Hkv, page_size, D]`` in memory
(``PagedKVCache(heads_outer=False)``); ``heads outer`` rows as PagedKVCache does by default, each KV head's pages one
region (``[Hkv, num_pages, page_size, D]``, ``lab.bench.paged_pools.on_huge_pages``): a head's keys over pages in
order are then one run of memory, as contiguous keys are, and over pages apart a run of one page, where the other
layout reads two heads' runs of a page as one (the kernel's heads_in_turn). The kernel and the keys' order are the
same in every row; only the addresses differ. Every call is timed cold (``lab.measure.evict_caches`` first), in
rounds whose order rotates (``lab.measure.interleaved_rounds``); ``time/contiguous`` is the median of the rounds'
ratios.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

import engine
from engine import plan_paged
from engine.quantized import quantize
from lab import plots
from lab.bench.paged_pools import PLACEMENTS, on_huge_pages, pools, quantized_pool
from lab.measure import evict_caches, interleaved_rounds, paired_ratio, progress

B, HQ, HKV, D, PAGE = 8, 32, 8, 128, 16
DTYPES = (torch.float32, torch.bfloat16, torch.int8)
KEYS = {"quick": (8192,), "full": (8192, 32768)}  # S, each sequence's cached keys


def placement_rows(args) -> list[dict[str, Any]]:
    keys = KEYS["quick" if args.quick else "full"]
    rounds = 3 if args.quick else 7
    g = torch.Generator().manual_seed(args.seed)
    rows = []
    for s, dtype in progress([(s, d) for s in keys for d in DTYPES], "bench paged: placement", quiet=args.quiet):
        rows += _placement_case(s, dtype, g, rounds)
    return rows


def _placement_case(s: int, dtype: torch.dtype, g: torch.Generator, rounds: int) -> list[dict[str, Any]]:
    quantized = dtype == torch.int8
    float_dtype = torch.float32 if quantized else dtype
    k = torch.randn(B, HKV, s, D, generator=g).to(float_dtype)  # [B, Hkv, S, D]
    v = torch.randn(B, HKV, s, D, generator=g).to(float_dtype)
    q = torch.randn(B, HQ, 1, D, generator=g).to(float_dtype)  # [B, Hq, 1, D]
    lens, indptr, packed = torch.full((B,), s), torch.arange(B + 1), q[:, :, 0]  # [B], [B+1], [Nq = B, Hq, D]
    kc, vc = (quantize(k), quantize(v)) if quantized else (k, v)
    kc, vc = on_huge_pages(kc), on_huge_pages(vc)
    contiguous = engine.plan(q, kc, vc)
    impls = {"contiguous": lambda: contiguous.run(q, kc, vc)}
    for placement in PLACEMENTS:
        kp, vp, table = pools(k, v, PAGE, g, True, placement)
        if quantized:  # per token and head, as the contiguous int8 keys: the same numbers
            kp, vp = quantized_pool(kp), quantized_pool(vp)
        for name, heads_outer in (f"paged, {placement}", False), (f"heads outer, {placement}", True):
            held_k, held_v = on_huge_pages(kp, heads_outer), on_huge_pages(vp, heads_outer)
            step = plan_paged(packed, held_k, held_v, table, lens, indptr)
            impls[name] = lambda step=step, k=held_k, v=held_v: step.run(packed, k, v)
    del k, v
    want = impls["contiguous"]()[:, :, 0]
    diff = {name: 0.0 if name == "contiguous" else (impls[name]() - want).abs().max().item() for name in impls}
    names = list(impls)  # (each run once above: no warm-up)
    times = {name: [us / 1e6 for us in per_round] for name, per_round in
             interleaved_rounds(impls, rounds, 1, warmup=0, before=evict_caches).items()}  # seconds
    kv_bytes = sum(x.data.nbytes + x.scale.nbytes if quantized else x.nbytes for x in (kc, vc))
    return [{"group": "placement", "case": f"B={B} S={s} page {PAGE} {str(dtype)[6:]}", "impl": name,
             "ms": statistics.median(times[name]) * 1e3,
             "time/contiguous": paired_ratio(times[name], times["contiguous"]),
             "K/V GB/s": kv_bytes / statistics.median(times[name]) / 1e9, "max |diff|": diff[name], "S": s,
             "page": PAGE, "dtype": str(dtype)} for name in names]


def plot_placement(rows: list[dict[str, Any]], path, target: float) -> None:
    fig, (axes,) = plots.figure(width=7.0)
    cases = list(dict.fromkeys(r["case"] for r in rows))
    ratio = {(r["case"], r["impl"]): r["time/contiguous"] for r in rows}
    bars = {f"{p}{layout}": [ratio[c, f"{impl}, {p}"] for c in cases] for impl, layout in
            (("paged", ""), ("heads outer", ", heads outer")) for p in PLACEMENTS}
    plots.grouped_bars(axes, cases, bars, target)
    axes.set_ylabel("time / contiguous decode (2 MiB pages both)")
    axes.set_title("paged decode by where the pool's pages lie (native kernel, cold)")
    plots.save(fig, path)
