"""``run.py bench serving --groups prefix``: requests that share a long prefix (a system prompt, an earlier turn of a
chat), each arriving when the one before has finished, served by transformers' continuous batching on the engine
with block sharing on (the default: a request reuses the full pages of KV an earlier one wrote for the same tokens)
and off (every request prefills its whole prompt).

The request set: ``--requests`` prompts, each the same ``--prefix`` tokens (default 1024; 512 with ``--quick``)
followed by 16..64 tokens of its own, ``--new`` tokens each (the low end of its range), ids drawn from ``--seed``.
One manager serves a way's requests one after another; a request's TTFT is timed from its own submission. The
first request finds nothing to share, so it is reported apart; the later ones' TTFT p50 / p99 are the figure, and
the speed-up is the no-sharing way's later p50 over this way's. Greedy tokens must not change: ``differing`` counts
the requests whose tokens differ from the no-sharing way's. With ``--repeats`` R the ways alternate R rounds and each
reports its round of median wall time.

    python run.py bench serving --groups prefix --dtype auto --requests 8 --new 16,16     # about 1 min
    python run.py bench serving --groups prefix --dtype auto --repeats 2                  # 32 x 64 tokens: 10 min
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lab import plots
from lab.bench.serving_ways import STALL_S, Request, ResidentPeak, batching_config, greedy
from lab.measure import format_table, machine_info, progress, save_results

WAYS = {"engine, prefix shared": True, "engine, no sharing": False}  # way -> allow_block_sharing
COLUMNS = ["case", "way", "requests", "prefix", "first TTFT ms", "later TTFT p50 ms", "later TTFT p99 ms",
           "speed-up", "wall s", "peak MiB", "differing"]


def prefix_requests(count: int, prefix: int, new: int, vocabulary, seed: int) -> list[Request]:
    """``count`` requests: the same ``prefix`` tokens, then 16..64 of each request's own; ``new`` tokens each."""
    g, words = torch.Generator().manual_seed(seed), torch.tensor(list(vocabulary))
    shared = words[torch.randint(len(words), (prefix,), generator=g)].tolist()
    own = [int(torch.randint(16, 65, (), generator=g)) for _ in range(count)]
    return [Request(shared + words[torch.randint(len(words), (n,), generator=g)].tolist(), new) for n in own]


def serve_in_turn(model, requests: list[Request], share: bool, page_size: int, batch_tokens: int,
                  ticks: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """One manager on the engine serves ``requests`` one after another: per request its tokens and its TTFT (s,
    from its submission); the wall time and the resident-memory peak."""
    from engine.integrations.transformers import continuous_batching

    config = batching_config(requests, page_size, batch_tokens, allow_block_sharing=share)
    generation = greedy(requests)
    model.set_attn_implementation("engine")
    tokens, ttft = [], []
    with ResidentPeak() as peak, continuous_batching(model), torch.inference_mode():
        manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
        manager.start()
        try:
            start = time.perf_counter()
            for r in requests:
                submitted = time.perf_counter()
                rid = manager.add_request(r.prompt, max_new_tokens=r.new_tokens, record_timestamps=True)
                waited = time.monotonic()
                while True:
                    result = manager.get_result(request_id=rid, timeout=1.0)
                    if result is not None and result.is_finished():
                        break
                    if not manager.is_running() or time.monotonic() - waited > STALL_S:
                        raise RuntimeError(f"the continuous-batching loop stopped or stalled on request {rid}")
                if result.error is not None:
                    raise RuntimeError(f"request {rid} failed: {result.error}")
                tokens.append(result.generated_tokens)
                ttft.append(result.timestamps[0] - submitted)
                ticks()
            wall = time.perf_counter() - start
        finally:
            manager.stop(block=True, timeout=60)
    return {"tokens": tokens, "ttft": ttft, "wall": wall, "peak": peak.extra_bytes}


def prefix_rows(model, case: str, vocabulary, args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict]:
    """One row per way (its round of median wall time) and the chosen runs, for the plot."""
    requests = prefix_requests(args.requests, args.prefix, args.new[0], vocabulary, args.seed)
    serve_in_turn(model, [Request(r.prompt[:8], 2) for r in requests[:2]], True, args.page_size, args.batch_tokens)
    names, runs = list(WAYS), {name: [] for name in WAYS}
    for round_index in range(args.repeats or 1):
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            bar = iter(progress(range(len(requests)), f"bench serving: prefix, {name}", quiet=args.quiet))
            runs[name].append(serve_in_turn(model, requests, WAYS[name], args.page_size, args.batch_tokens,
                                            lambda bar=bar: next(bar, None)))
            for _ in bar:  # close the bar
                pass
    chosen = {name: sorted(served, key=lambda s: s["wall"])[(len(served) - 1) // 2] for name, served in runs.items()}
    base = chosen["engine, no sharing"]
    later = {name: 1e3 * np.array(served["ttft"][1:] or served["ttft"]) for name, served in chosen.items()}
    rows = []
    for name, served in chosen.items():
        rows.append({"group": "prefix", "case": case, "way": name, "requests": len(requests), "prefix": args.prefix,
                     "first TTFT ms": 1e3 * served["ttft"][0],
                     "later TTFT p50 ms": float(np.percentile(later[name], 50)),
                     "later TTFT p99 ms": float(np.percentile(later[name], 99)),
                     "speed-up": float(np.percentile(later["engine, no sharing"], 50) / np.percentile(later[name], 50)),
                     "wall s": served["wall"], "peak MiB": None if served["peak"] is None else served["peak"] / 2**20,
                     "differing": sum(a != b for a, b in zip(served["tokens"], base["tokens"])),
                     "round walls s": [round(s["wall"], 2) for s in runs[name]], "ttft ms": later[name].tolist()})
    return rows, chosen


def plot(rows: list[dict[str, Any]], chosen: dict, path) -> None:
    """Each request's TTFT in submission order, one line per way (log axis)."""
    fig, (ax,) = plots.figure()
    for index, (name, served) in enumerate(chosen.items()):
        plots.series(ax, range(len(served["ttft"])), [1e3 * t for t in served["ttft"]], name, index)
    ax.set_yscale("log")
    ax.set_xlabel("request, in submission order (request 0 has nothing to share)")
    ax.set_ylabel("time to first token, ms")
    ax.set_title(f"{rows[0]['case']}: a {rows[0]['prefix']}-token prefix shared", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    plots.save(fig, path)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The group: load the model, serve both ways, print the table, save the rows and the plot."""
    from engine.serving.model import load_model, resolve_dtype

    args.prefix = args.prefix or (512 if args.quick else 1024)
    start = time.perf_counter()
    model, tokenizer, name = load_model(args.model, dtype=resolve_dtype(args.dtype)[0])
    print(f"loaded {name} ({model.dtype}) in {time.perf_counter() - start:.1f} s; {args.requests} requests in turn, "
          f"a {args.prefix}-token prefix shared, pages of {args.page_size}")
    special = set(tokenizer.all_special_ids)
    rows, chosen = prefix_rows(model, name, [i for i in range(len(tokenizer)) if i not in special], args)
    print("\n" + format_table(rows, COLUMNS))
    if any(r["differing"] for r in rows):
        print("note: prefix sharing changed some requests' greedy tokens")
    paths = save_results(args.out, "serving_prefix", rows, {**machine_info(), "command": "bench serving --groups "
                                                           "prefix", "args": vars(args)})
    plot(rows, chosen, f"{args.out}/serving_prefix.png")
    print("\nwrote " + ", ".join(str(p) for p in paths) + f", {args.out}/serving_prefix.png")
    return rows
