"""``run.py bench paged``: a decode step over a paged KV cache beside the same keys held contiguously.

- ``decode``: B sequences of S keys each, one new query per sequence (Hq 32 / Hkv 8 / D 128, fp32 and bf16), their
  pages shuffled in the pool. Rows: ``contiguous`` (``engine.plan(...).run`` on ``[B, Hkv, S, D]``: the native
  decode kernel), ``paged`` (the step planned once, ``engine.plan_paged(...).run``, as serving runs it, on pools
  laid out as ``PagedKVCache(heads_outer=False)`` keeps them, each page's heads side by side: over shuffled pages
  the faster of its two layouts; the placement and churn groups time both),
  ``paged NHD`` (the same pages in FlashInfer's ``[num_pages, page_size, Hkv, D]`` storage order) and ``copy`` (the
  machine's copy bandwidth on as many bytes). Timed interleaved; K/V GB/s and the ratio to contiguous (the median
  of each round's ratio). Both
  ``held`` rows hold the same keys on 2 MiB pages, as KVCache and PagedKVCache do (``engine.huge_pages``):
  ``contiguous held`` and ``paged held``, the latter's ratio taken over the former (the others' 4 KiB pages make
  each page of a pool a page walk).
  int8 rows: the same keys quantized per token and head (``QuantizedKV``), contiguous and in int8 pages.
  ``copy, page runs``: the held pool's K bytes copied a run at a time (one head's rows of one page) in the order the
  kernel's work items read them (``page_runs``); its ``time/contiguous`` is its time over ``copy, runs in order``'s
  (the same runs, the same copy, in address order; whose own is over ``copy``'s): what the memory makes of runs
  that short (a bf16 page of 16 keys is a 4 KiB run) before any attention's arithmetic.
- ``placement``: the decode's keys in pools whose pages lie shuffled, in order (each sequence's following on, as a
  PagedKVCache gives them) or interleaved (a first-free list's sequences growing in lock step), each page's heads side
  by side and each head's pages one region (heads outer: PagedKVCache's default), on 2 MiB pages, each call cold
  (lab.bench.paged_placement).
- ``step``: SmolLM2-135M's attention shape (Hq 9 / Hkv 3 / D 64), B = 8 and 32 ragged sequences of 256-768 keys,
  pages of 16 and 256, fp32 / bf16 / int8, 1 and 2 threads: the planned paged step, the unplanned
  ``paged_attention`` call and the same keys contiguous (lab.bench.paged_step).
- ``mixed``: a mixed step (two prefill chunks of 64 queries and decodes, SmolLM2's shape, pages of 16): the calls
  planned once per step (each sequence's own call), beside the same calls on contiguous keys and the unplanned
  ``paged_attention`` (a layer's cost before the step was planned); target <= 1.2x contiguous.
- ``invariant``: what batch-invariant mode costs: a causal prefill of S = 512 / 2048 queries and a decode step
  against S keys (SmolLM2's shape, fp32 / bf16), planned in the default mode and in batch-invariant mode
  (``time/contiguous`` is then the time over the default mode's).
- ``continuous``: one layer of a continuous-batching decode step of 32 requests (transformers' packed keys through
  the engine's adapter, its step planned by the first layer) beside the same keys contiguous; target <= 1.2x.
- ``cascade``: 32 sequences sharing an 8k-token prefix (forked from one prompt: the same pages) plus 64 tokens of
  their own, one decode step. Rows: ``cascade`` (the prefix read once for all 32 queries, engine.paged.cascade),
  ``per sequence`` (``cascade=False``: the shared pages read once per sequence), for Hkv 8 (GQA, G = 4) and
  Hkv 32 (MHA). Target: cascade >= 4x faster than per sequence.
- ``tree``: speculative decoding's verify (issue 27): a draft tree of 16 or 64 nodes (a binary tree, heap order)
  over S = 4k / 32k cached keys of one sequence (Hq 32 / Hkv 8 / D 128, fp32, pages of 16), all nodes in ONE paged
  call (the ancestor mask as ``allowed``, planned once, as a model's step runs it), beside one single-token decode
  step over the same keys; ``time/decode`` and the path each takes. Target: the 16-node tree within 1.5x of the
  decode step.
- ``memory``: 64 requests of ragged lengths (1..2047 tokens, fixed seed): the slots a paged cache holds against a
  contiguous cache's reservation at the longest length.

    python run.py bench paged --quick          # S = 8k, a minute
    python run.py bench paged                  # S = 8k, 16k, 32k (about 4 GiB at 32k)
    python run.py bench paged --groups tree    # tree verification, S = 4k and 32k (--quick: 4k only)

Target: paged decode within 1.1x of contiguous decode's time.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

import engine
from engine import PagedKVCache, causal_attention, paged_attention, plan_paged
from engine.kernels.decode.native_listed import data_of
from engine.masks.tree import tree_attention_inputs
from engine.quantized import quantize
from lab import plots
from lab.bench.paged_churn import churn_rows, plot_churn
from lab.bench.paged_placement import placement_rows, plot_placement
from lab.bench.paged_pools import on_huge_pages, pools, quantized_pool
from lab.bench.paged_step import continuous_rows, invariant_rows, mixed_rows, step_rows
from lab.measure import (
    format_table,
    interleaved_rounds,
    interleaved_us,
    machine_info,
    paired_ratio,
    progress,
    save_results,
)
from lab.options import add_common, apply_threads

B, HQ, HKV, D = 8, 32, 8, 128
TARGET = 1.1
CASCADE_TARGET = 4.0
TREE_TARGET = 1.5  # a 16-node tree's verify over a one-token decode step
TREE_DTYPES = (torch.float32, torch.bfloat16)  # (bf16: where the CPU has AMX-BF16, a tree's rows run on its tiles)
TREE_KEYS = {"quick": (4096,), "full": (4096, 32768)}  # S, the sequence's cached keys
GROUPS = ("decode", "placement", "churn", "step", "mixed", "continuous", "invariant", "cascade", "tree", "memory")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "bench_paged", impl_help="ignored (every row runs)", threads=2)
    parser.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated groups: {', '.join(GROUPS)}")


def decode_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    keys = (8192,) if args.quick else (8192, 16384, 32768)
    cases = [(s, p, dtype) for s in keys for p in (16, 256) for dtype in (torch.float32, torch.bfloat16, torch.int8)]
    rounds, calls = (3, 2) if args.quick else (7, 3)
    g = torch.Generator().manual_seed(args.seed)
    rows = []
    for s, page_size, dtype in progress(cases, "bench paged: decode", quiet=args.quiet):
        rows += _decode_case(s, page_size, dtype, g, rounds, calls)
    return rows


def _decode_case(s: int, page_size: int, dtype: torch.dtype, g: torch.Generator, rounds: int,
                 calls: int) -> list[dict[str, Any]]:
    quantized = dtype == torch.int8
    float_dtype = torch.float32 if quantized else dtype
    k = torch.randn(B, HKV, s, D, generator=g).to(float_dtype)  # [B, Hkv, S, D]
    v = torch.randn(B, HKV, s, D, generator=g).to(float_dtype)
    q = torch.randn(B, HQ, 1, D, generator=g).to(float_dtype)  # [B, Hq, 1, D]
    head_major, nhd = pools(k, v, page_size, g, True), pools(k, v, page_size, g, False)
    if quantized:  # per token and head, so the contiguous and the paged int8 keys are the same numbers
        k, v = quantize(k), quantize(v)
        head_major, nhd = [(quantized_pool(kp), quantized_pool(vp), table) for kp, vp, table in (head_major, nhd)]
    step = engine.plan(q, k, v)
    lens, indptr, packed = torch.full((B,), s), torch.arange(B + 1), q[:, :, 0]  # [B], [B+1], [Nq = B, Hq, D]
    paged = {name: plan_paged(packed, pool[0], pool[1], pool[2], lens, indptr)  # the step planned once
             for name, pool in (("paged", head_major), ("paged NHD", nhd))}
    kh, vh, held = on_huge_pages(k), on_huge_pages(v), [on_huge_pages(x) for x in head_major[:2]]
    held_step = plan_paged(packed, held[0], held[1], head_major[2], lens, indptr)
    src = (k.data if quantized else k).reshape(-1)
    dst = torch.zeros_like(src)
    runs, order = page_runs(held[0], head_major[2])
    run_dst, in_order = torch.zeros_like(runs), torch.arange(runs.shape[0])
    impls = {"contiguous": lambda: step.run(q, k, v),
             "paged": lambda: paged["paged"].run(packed, head_major[0], head_major[1]),
             "paged NHD": lambda: paged["paged NHD"].run(packed, nhd[0], nhd[1]),
             "contiguous held": lambda: step.run(q, kh, vh),
             "paged held": lambda: held_step.run(packed, held[0], held[1]),
             "copy": lambda: dst.copy_(src),
             "copy, runs in order": lambda: torch.index_select(runs, 0, in_order, out=run_dst),
             "copy, page runs": lambda: torch.index_select(runs, 0, order, out=run_dst)}
    want = step.run(q, k, v)[:, :, 0]
    diff = max((impls[name]() - want).abs().max().item() for name in ("paged", "paged NHD", "paged held"))
    diff = max(diff, (impls["contiguous held"]()[:, :, 0] - want).abs().max().item())
    times = interleaved_rounds(impls, rounds, calls, warmup=1)
    ms = {name: statistics.median(us) / 1000 for name, us in times.items()}
    kv_bytes = 2 * (k.nbytes if quantized else k.numel() * k.element_size())
    copy_bytes = 2 * src.numel() * src.element_size()  # read + written
    rows = []
    base = {"paged held": "contiguous held", "copy, runs in order": "copy", "copy, page runs": "copy, runs in order"}
    for name in ("contiguous", "paged", "paged NHD", "contiguous held", "paged held", "copy, runs in order",
                 "copy, page runs"):
        # ratios within each round (paired_ratio): steadier than a ratio of medians when the machine drifts
        ratio = paired_ratio(times[name], times[base.get(name, "contiguous")])
        if name.startswith("copy, "):  # (K's bytes read and written, as copy's)
            gbs, of_copy = copy_bytes / ms[name] / 1e6, 1 / paired_ratio(times[name], times["copy"])
        else:
            gbs = kv_bytes / ms[name] / 1e6
            of_copy = kv_bytes / copy_bytes / paired_ratio(times[name], times["copy"])
        rows.append({"group": "decode", "case": f"B={B} S={s} page {page_size} {str(dtype)[6:]}", "impl": name,
                     "ms": ms[name], "time/contiguous": ratio, "K/V GB/s": gbs, "of copy": of_copy,
                     "target": f"<= {TARGET}x" if name in ("paged", "paged held") else None,
                     "met": ("yes" if ratio <= TARGET else "no") if name in ("paged", "paged held") else None,
                     "max |diff|": diff, "S": s, "page": page_size, "dtype": str(dtype)})
    return rows


def page_runs(pool, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A head-major pool's K bytes as runs ``[num_pages * Hkv, page_size * D]`` (a head's rows of one page, one run
    in memory) and the order the paged kernel's work items read them: each sequence's heads in turn, each head's
    pages in page-table order. Copied in that order (``copy, page runs``, its time over ``copy, runs in order``'s:
    the same runs in address order), they show what the memory itself makes of runs this short, with no attention's
    arithmetic."""
    stored = data_of(pool).permute(0, 2, 1, 3)  # [num_pages, Hkv, page_size, D], contiguous (a QuantizedKV's entries)
    heads = stored.shape[1]
    order = (table[:, None, :] * heads + torch.arange(heads)[None, :, None]).reshape(-1)  # [B * Hkv * pages]
    return stored.reshape(stored.shape[0] * heads, -1), order


def memory_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """64 ragged requests in a paged cache (page 16) against a contiguous cache's reservation at the longest."""
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(1, 2048, (64,), generator=g).tolist()
    page_size = 16
    cache = PagedKVCache(sum(-(-n // page_size) for n in lengths), page_size, HKV, D)
    seqs = [cache.add() for _ in lengths]
    zeros = torch.zeros(sum(lengths), HKV, D)
    cache.append(seqs, zeros, zeros, torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist()))
    slot_bytes = 2 * HKV * D * 4  # one token's K and V, fp32
    paged = cache.pages_in_use * page_size
    contiguous = len(lengths) * max(lengths)
    return [{"group": "memory", "case": "64 ragged requests, 1..2047 tokens", "impl": name, "token slots": slots,
             "MiB": slots * slot_bytes / 2**20, "tokens": sum(lengths), "waste": (slots - sum(lengths)) / slots}
            for name, slots in (("paged (page 16)", paged), ("contiguous reservation", contiguous))]


def cascade_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """32 sequences forked from one 8k-token prompt, 64 tokens each of their own, one decode step (page 16, fp32)."""
    batch, prefix, suffix, page_size = 32, 2048 if args.quick else 8192, 64, 16
    rounds, calls = (3, 2) if args.quick else (7, 3)
    g = torch.Generator().manual_seed(args.seed)
    rows = []
    for kv_heads in progress((HKV, HQ), "bench paged: cascade", quiet=args.quiet):
        cache = PagedKVCache(prefix // page_size + batch * (suffix // page_size + 1), page_size, kv_heads, D)
        root = cache.add()
        cache.append([root], *(torch.randn(prefix, kv_heads, D, generator=g) for _ in "kv"), torch.tensor([0, prefix]))
        seqs = [cache.fork(root) for _ in range(batch)]
        own = torch.randn(batch * suffix, kv_heads, D, generator=g)
        cache.append(seqs, own, own.flip(0), torch.arange(batch + 1) * suffix)
        table, lens = cache.tables(seqs)
        q, indptr = torch.randn(batch, HQ, D, generator=g), torch.arange(batch + 1)
        call = (q, cache.keys, cache.values, table, lens, indptr)
        impls = {"cascade": lambda call=call: paged_attention(*call, cascade=True),
                 "per sequence": lambda call=call: paged_attention(*call, cascade=False)}
        diff = (impls["cascade"]() - impls["per sequence"]()).abs().max().item()
        ms = {name: us / 1000 for name, us in interleaved_us(impls, rounds, calls, warmup=1).items()}
        speedup = ms["per sequence"] / ms["cascade"]
        for name in impls:
            rows.append({"group": "cascade", "case": f"{batch} seqs, {prefix} shared + {suffix} own, Hq {HQ} / Hkv "
                         f"{kv_heads}", "impl": name, "ms": ms[name], "speedup": ms["per sequence"] / ms[name],
                         "target": f">= {CASCADE_TARGET}x" if name == "cascade" else None,
                         "met": ("yes" if speedup >= CASCADE_TARGET else "no") if name == "cascade" else None,
                         "max |diff|": diff, "kv_heads": kv_heads})
    return rows


def tree_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One sequence of S keys (page 16, fp32 and bf16): a tree of 16 / 64 draft nodes verified in one planned paged
    call vs a one-token decode step over the same S keys; each planned once, its run timed interleaved."""
    rounds, calls = (3, 2) if args.quick else (7, 3)
    g = torch.Generator().manual_seed(args.seed)
    rows = []
    cases = [(s, dtype) for s in TREE_KEYS["quick" if args.quick else "full"] for dtype in TREE_DTYPES]
    for s, dtype in progress(cases, "bench paged: tree", quiet=args.quiet):
        rows += _tree_case(s, 16, dtype, g, rounds, calls)
    return rows


def _tree_case(s: int, page_size: int, dtype: torch.dtype, g: torch.Generator, rounds: int,
               calls: int) -> list[dict[str, Any]]:
    k, v = (torch.randn(1, HKV, s + 64, D, generator=g).to(dtype) for _ in "kv")  # [1, Hkv, S + 64, D]: 64 nodes
    k_pages, v_pages, table = pools(k, v, page_size, g, True)
    q = torch.randn(64, HQ, D, generator=g).to(dtype)  # [64, Hq, D]: the largest tree's queries
    plans = {1: plan_paged(q[:1], k_pages, v_pages, table, torch.tensor([s + 1]), torch.tensor([0, 1]))}
    diffs = {}
    for n in (16, 64):
        parents = [-1] + [(i - 1) // 2 for i in range(1, n)]  # a binary tree in heap order
        positions, _, allowed = tree_attention_inputs(parents, s, paged=True)
        plans[n] = plan_paged(q[:n], k_pages, v_pages, table, torch.tensor([s + n]), torch.tensor([0, n]), positions,
                              allowed=allowed)
        qpos, kpos, mask = tree_attention_inputs(parents, s)  # the contiguous call: positions past + depth
        want = causal_attention(q[:n].transpose(0, 1)[None], k[:, :, :s + n], v[:, :, :s + n], qpos, kpos, mask)
        diffs[n] = (plans[n].run(q[:n], k_pages, v_pages) - want[0].transpose(0, 1)).abs().max().item()
    names = {1: "decode (1 query)", 16: "tree 16", 64: "tree 64"}
    impls = {names[n]: (lambda n=n: plans[n].run(q[:n], k_pages, v_pages)) for n in names}
    ms = {name: us / 1000 for name, us in interleaved_us(impls, rounds, calls, warmup=1).items()}
    rows = []
    for n, name in names.items():
        ratio = ms[name] / ms[names[1]]
        case = f"S={s} Hq {HQ}/Hkv {HKV}/D {D} {str(dtype).removeprefix('torch.')} page {page_size}"
        rows.append({"group": "tree", "case": case, "impl": name,
                     "nodes": n, "ms": ms[name], "time/decode": ratio, "per node": ms[name] / n,
                     "path": plans[n].path, "target": f"<= {TREE_TARGET}x" if n == 16 else None,
                     "met": ("yes" if ratio <= TREE_TARGET else "no") if n == 16 else None,
                     "max |diff|": diffs.get(n), "S": s, "dtype": str(dtype).removeprefix("torch.")})
    return rows


def plot(rows: list[dict[str, Any]], path) -> None:
    paged = [r for r in rows if r["group"] == "decode" and r["impl"] != "contiguous"]
    fig, (axes,) = plots.figure(width=8.0)
    cases = sorted({r["case"] for r in paged}, key=lambda c: [r["case"] for r in paged].index(c))
    ratio = {(r["case"], r["impl"]): r["time/contiguous"] for r in paged}
    labels = {"paged": "paged", "paged NHD": "paged NHD",
              "paged held": "paged held (over contiguous held; 2 MiB pages)"}
    plots.grouped_bars(axes, cases, {label: [ratio[c, name] for c in cases] for name, label in labels.items()}, TARGET)
    axes.set_ylabel("time / contiguous decode")
    axes.set_title("paged decode vs the same keys contiguous (native kernel)")
    plots.save(fig, path)


def plot_tree(rows: list[dict[str, Any]], path) -> None:
    fig, (axes,) = plots.figure(width=6.0)
    cases = list(dict.fromkeys((r["S"], r["dtype"]) for r in rows))
    for offset, name in enumerate(("tree 16", "tree 64")):
        values = [next(r["time/decode"] for r in rows if (r["S"], r["dtype"]) == c and r["impl"] == name)
                  for c in cases]
        axes.bar([i + 0.4 * offset for i in range(len(cases))], values, width=0.4, label=name)
    axes.axhline(TREE_TARGET, color="gray", linestyle="--", label=f"target {TREE_TARGET}x (16 nodes)")
    axes.set_xticks([i + 0.2 for i in range(len(cases))], [f"S = {s}, {dt}" for s, dt in cases])
    axes.set_ylabel("time / one-token decode step")
    axes.set_title("a draft tree verified in one paged call")
    axes.legend()
    plots.save(fig, path)


def main(args: argparse.Namespace) -> int:
    apply_threads(args)
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        print(f"unknown --groups {unknown}: choose from {', '.join(GROUPS)}")
        return 2
    rows = ((decode_rows(args) if "decode" in groups else [])
            + (placement_rows(args) if "placement" in groups else []) + (churn_rows(args) if "churn" in groups else [])
            + (step_rows(args) if "step" in groups else [])
            + (mixed_rows(args) if "mixed" in groups else []) + (invariant_rows(args) if "invariant" in groups else [])
            + (continuous_rows(args) if "continuous" in groups else [])
            + (cascade_rows(args) if "cascade" in groups else []) + (tree_rows(args) if "tree" in groups else [])
            + (memory_rows(args) if "memory" in groups else []))
    decode = [r for r in rows if r["group"] == "decode"]
    if decode:
        print(format_table(decode, ["case", "impl", "ms", "time/contiguous", "K/V GB/s", "of copy", "target", "met",
                                    "max |diff|"]))
    placement = [r for r in rows if r["group"] == "placement"]
    if placement:
        print("\n" + format_table(placement, ["case", "impl", "ms", "time/contiguous", "K/V GB/s", "max |diff|"]))
    churn = [r for r in rows if r["group"] == "churn"]
    if churn:
        print("\n" + format_table(churn, ["case", "impl", "ms", "time/before", "pages per run", "B", "keys",
                                          "bitwise as side by side"]))
    step = [r for r in rows if r["group"] in ("step", "mixed", "continuous", "invariant")]
    if step:
        print("\n" + format_table(step, ["case", "impl", "kernel", "us", "time/contiguous", "target", "met",
                                         "max |diff|"]))
    cascade = [r for r in rows if r["group"] == "cascade"]
    if cascade:
        print("\n" + format_table(cascade, ["case", "impl", "ms", "speedup", "target", "met", "max |diff|"]))
    tree = [r for r in rows if r["group"] == "tree"]
    if tree:
        print("\n" + format_table(tree, ["case", "impl", "nodes", "ms", "time/decode", "per node", "path", "target",
                                         "met", "max |diff|"]))
    memory = [r for r in rows if r["group"] == "memory"]
    if memory:
        print("\n" + format_table(memory, ["case", "impl", "tokens", "token slots", "MiB", "waste"]))
    paths = save_results(args.out, "paged", rows, {**machine_info(), "command": "bench paged", "args": vars(args)})
    if decode:
        plot(rows, f"{args.out}/paged.png")
        paths.append(f"{args.out}/paged.png")
    if placement:
        plot_placement(placement, f"{args.out}/paged_placement.png", TARGET)
        paths.append(f"{args.out}/paged_placement.png")
    if churn:
        plot_churn(churn, f"{args.out}/paged_churn.png")
        paths.append(f"{args.out}/paged_churn.png")
    if tree:
        plot_tree(tree, f"{args.out}/paged_tree.png")
        paths.append(f"{args.out}/paged_tree.png")
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0
