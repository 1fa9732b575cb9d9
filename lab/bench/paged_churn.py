"""``run.py bench paged --groups churn``: a decode over the page tables a serving-like churn of requests leaves.

The placement group times fixed placements. Here the pages lie where an allocator put them: requests arrive (prompts
of 200-3000 tokens, 100-1000 tokens to generate, seeded), are admitted while the pages in use stay under a fill (90%
and 98% of the pool; ``--quick``: 90%; the running requests' growth fills it further), decode a token per step, and
leave when done; a step that finds no free page preempts the longest request, as a server would. After the steps
(2000; ``--quick``: 300) the running requests' tables are decoded (B ~170 sequences of up to ~4k keys, Hq 32 / Hkv 8,
D 128, pages of 16, fp32 / bf16 / int8) two ways each:

- where pages come from: ``follows on`` (engine.paged.pool's ``PagePool.take``, as PagedKVCache gives them: a
  sequence's next page the one after its last) or ``first free`` (a free list of the lowest ids, freed pages on top:
  PagedKVCache's before issue 29's round 18, here as ``FirstFree``);
- how the pool is stored: ``heads outer`` (each KV head's pages one region, PagedKVCache's default) or ``heads side by
  side`` (``heads_outer=False``, each page's heads together; the kernel reads a page's two heads' runs as one);

and ``one run each``: the same sequences with every sequence's pages in order (the best any allocator can do). Both
allocators see the same requests and the same page counts, so the same sequences and lengths. Every call is timed
cold (lab.measure.evict_caches first), in rounds whose order rotates; ``time/before`` is each row's time over ``first
free, heads side by side`` (the median of the rounds' ratios); ``pages per run`` the mean length of the tables' runs
of consecutive pages; ``bitwise as side by side`` whether a heads-outer row's output equals its table's other row's.
"""

from __future__ import annotations

import itertools
import random
import statistics
from typing import Any

import torch

from engine import plan_paged
from engine.paged.pool import PagePool
from lab import plots
from lab.bench.paged_pools import on_huge_pages, quantized_pool
from lab.measure import evict_caches, interleaved_rounds, paired_ratio, progress

HQ, HKV, D, PAGE = 32, 8, 128, 16
PROMPT, GENERATE = (200, 3000), (100, 1000)  # tokens, each drawn uniformly per request
DTYPES = (torch.float32, torch.bfloat16, torch.int8)


class FirstFree:
    """A free list handing out the lowest free id first, freed pages on top (the allocator PagePool replaced)."""

    def __init__(self, num_pages: int) -> None:
        self.free = list(range(num_pages - 1, -1, -1))

    def take(self, before=(), count: int = 1, claimed=None) -> list[int]:
        return [self.free.pop() for _ in range(count)]

    def drop(self, page: int) -> None:
        self.free.append(page)


def served_tables(allocator, num_pages: int, steps: int, fill: float, seed: int):
    """``(page_table [B, max pages], kv_lens [B])`` of the requests running after ``steps`` decode steps of a
    seeded churn, pages taken from ``allocator`` (``take(before, count, claimed)`` / ``drop(page)``; ``claimed``
    the running requests' followers, as PagedKVCache passes them)."""
    draw = random.Random(seed)
    pages: dict[int, list[int]] = {}  # running request -> its pages
    length: dict[int, int] = {}  # running request -> its tokens
    left: dict[int, int] = {}  # running request -> tokens still to generate
    arrivals = itertools.count()

    def leave(request: int) -> None:
        for page in pages.pop(request):
            allocator.drop(page)
        del length[request], left[request]

    for _ in range(steps):
        while True:  # admit while the pool stays under `fill` (a page of room per running request kept)
            prompt, new = draw.randint(*PROMPT), draw.randint(*GENERATE)
            need = -(-prompt // PAGE)
            if sum(map(len, pages.values())) + need + len(pages) + 1 > fill * num_pages:
                break
            request = next(arrivals)
            claimed = {held[-1] + 1 for held in pages.values()}
            pages[request], length[request], left[request] = allocator.take((), need, claimed), prompt, new
        growing = [r for r in pages if length[r] % PAGE == 0]  # each needs a page for its next token
        while growing and sum(map(len, pages.values())) + len(growing) > num_pages:  # preempt the longest
            leave(max(pages, key=length.get))
            growing = [r for r in pages if length[r] % PAGE == 0]
        claimed = {held[-1] + 1 for held in pages.values()}
        for request in growing:
            pages[request] += allocator.take(pages[request], 1, claimed)
        for request in list(pages):
            length[request], left[request] = length[request] + 1, left[request] - 1
            if left[request] == 0:
                leave(request)
    requests = sorted(pages)
    table = torch.zeros(len(requests), max(len(pages[r]) for r in requests), dtype=torch.long)
    for row, request in enumerate(requests):
        table[row, :len(pages[request])] = torch.tensor(pages[request])
    return table, torch.tensor([length[r] for r in requests])


def pages_per_run(table: torch.Tensor, lens: torch.Tensor) -> float:
    """The mean length of the tables' runs of consecutive page ids (each sequence's pages, in its order)."""
    runs = used = 0
    for row, n in zip(table.tolist(), lens.tolist()):
        ids = row[:-(-n // PAGE)]
        runs += 1 + sum(b != a + 1 for a, b in zip(ids, ids[1:]))
        used += len(ids)
    return used / runs


def churn_rows(args) -> list[dict[str, Any]]:
    num_pages, steps, fills = (1024, 300, (0.9,)) if args.quick else (16384, 2000, (0.9, 0.98))
    rounds = 3 if args.quick else 9
    g = torch.Generator().manual_seed(args.seed)
    rows = []
    for fill, dtype in progress([(f, d) for f in fills for d in DTYPES], "bench paged: churn", quiet=args.quiet):
        rows += _churn_case(num_pages, steps, fill, dtype, g, args.seed, rounds)
    return rows


def _churn_case(num_pages: int, steps: int, fill: float, dtype: torch.dtype, g: torch.Generator, seed: int,
                rounds: int) -> list[dict[str, Any]]:
    tables = {"first free": served_tables(FirstFree(num_pages), num_pages, steps, fill, seed),
              "follows on": served_tables(PagePool(num_pages, PAGE, 1, 1, 1, torch.float32, None), num_pages, steps,
                                          fill, seed)}
    (table, lens), (other, other_lens) = tables.values()
    assert torch.equal(lens, other_lens)  # the same requests either way
    in_order = torch.zeros_like(table)  # every sequence's pages in order, one sequence after another
    for row, start in enumerate((-(-lens // PAGE)).cumsum(0) - (-(-lens // PAGE))):
        in_order[row] = torch.arange(int(start), int(start) + table.shape[1]).clamp(max=num_pages - 1)
    tables["one run each"] = (in_order, lens)
    quantized = dtype == torch.int8
    float_dtype = torch.float32 if quantized else dtype
    k, v = (torch.randn(num_pages, HKV, PAGE, D, generator=g).to(float_dtype).permute(0, 2, 1, 3)
            for _ in "kv")  # [num_pages, P, Hkv, D] views of [num_pages, Hkv, P, D]: each page's heads side by side
    if quantized:
        k, v = quantized_pool(k), quantized_pool(v)
    q = torch.randn(lens.shape[0], HQ, D, generator=g).to(float_dtype)  # [B, Hq, D]
    indptr = torch.arange(lens.shape[0] + 1)
    impls, outputs = {}, {}
    for layout, heads_outer in (("heads side by side", False), ("heads outer", True)):
        kp, vp = on_huge_pages(k, heads_outer), on_huge_pages(v, heads_outer)
        for placement, (table_, lens_) in tables.items():
            if placement == "one run each" and not heads_outer:
                continue
            step = plan_paged(q, kp, vp, table_, lens_, indptr)
            name = f"{placement}, {layout}"
            impls[name] = lambda step=step, kp=kp, vp=vp: step.run(q, kp, vp)
            outputs[name] = impls[name]()
    del k, v
    same = {name: torch.equal(outputs[name], outputs[f"{name.split(',')[0]}, heads side by side"])
            for name in outputs if name in ("first free, heads outer", "follows on, heads outer")}
    times = interleaved_rounds(impls, rounds, 1, warmup=0, before=evict_caches)
    base = times["first free, heads side by side"]
    keys = int(lens.sum())
    return [{"group": "churn", "case": f"{num_pages} pages of {PAGE}, admitted under {fill:.0%}, {str(dtype)[6:]}",
             "impl": name, "ms": statistics.median(times[name]) / 1e3, "time/before": paired_ratio(times[name], base),
             "pages per run": pages_per_run(*tables[name.split(",")[0]]), "B": int(lens.shape[0]), "keys": keys,
             "bitwise as side by side": same.get(name), "fill": fill, "dtype": str(dtype)} for name in impls]


def plot_churn(rows: list[dict[str, Any]], path) -> None:
    fig, (axes,) = plots.figure(width=7.0)
    cases = list(dict.fromkeys(r["case"] for r in rows))
    ratio = {(r["case"], r["impl"]): r["time/before"] for r in rows}
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    plots.grouped_bars(axes, cases, {impl: [ratio[c, impl] for c in cases] for impl in impls})
    axes.set_ylabel("time / first free, heads side by side")
    axes.set_title("paged decode after a serving-like churn (native kernel, cold)")
    plots.save(fig, path)
