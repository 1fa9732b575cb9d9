"""``run.py bench serving --peer URL`` (or ``--peer-command CMD``): ``run.py serve`` against any OpenAI-compatible
server of the same model (llama.cpp's llama-server, vLLM, ...), the same requests over HTTP in the same run.

    python run.py bench serving --peer-command "llama-server -m model.gguf --port {port} -t 2 ..." --quick
    python run.py bench serving --peer http://127.0.0.1:8080          # a peer already running

How each server is started, timed to ready, stopped, and sent a request set: lab.bench.serving_http. Per
concurrency C (``--concurrency``, default 4 and 16): ``--requests`` requests (default 32; prompts 16..1,024 tokens,
64..128 new tokens: issue 28's set; ``--quick`` 8, 16..256 and 16..32, C = 4), their lengths drawn by the bench's
``draw_requests`` from ``--seed``, their prompt ids new in every round of the run (from the served model's
vocabulary less its special ids: both servers must serve the same vocabulary; a server that caches prompts, as
llama-server does, never sees one twice). Each round's set is sent to both servers in turn, ``--repeats`` rounds
(default 2), the order alternating; each server reports its round of median wall time. Rows: output tokens/s, TTFT
and TPOT p50/p99, the server process's resident peak so far (VmHWM), start to ready (first start: ``run.py serve``
converting a GGUF into an empty weights cache; second start: the median of the later ones), the CPU others used
during its chosen round (the machine's busy time, steal included, less both servers' and the bench's, in % of one
core; every round's in ``round others CPU %``), the requests whose texts differ from the other server's in the same
rounds (greedy both: equal weights and numerics give equal texts) and the requests that made fewer or more tokens
than asked.

Targets (issue 28): output tokens/s >= 1.0x the peer's, TPOT p50 <= 1.5x, TTFT p50 <= 1.0x (per C), and a second
start ready in <= 10 s (measured with ``--starts`` >= 2).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from lab import plots
from lab.bench.serving_http import (
    Reply,
    ServerProcess,
    base_url,
    cpu_sample,
    free_ports,
    peer_command,
    run_load,
    serve_command,
    wait_ready,
)
from lab.measure import format_table, machine_info, progress, save_results
from lab.options import parse_counts, positive_float, positive_int

COLUMNS = ["case", "way", "requests", "tokens", "wall s", "tok/s", "vs peer", "TTFT p50 ms", "TTFT p99 ms",
           "TPOT p50 ms", "TPOT p99 ms", "peak MiB", "first start s", "start to ready s", "others CPU %",
           "differing", "short"]
TARGET_COLUMNS = ["case", "target", "engine", "peer", "value", "met"]
READY_S = 10.0  # a second start, at most
RATIO_TARGETS = [("output tokens/s", "tok/s", ">=", 1.0), ("TPOT p50", "TPOT p50 ms", "<=", 1.5),
                 ("TTFT p50", "TTFT p50 ms", "<=", 1.0)]


class Round(NamedTuple):
    replies: list[Reply]
    wall_s: float
    others_cpu: float  # % of one core, used by neither server nor the bench


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peer", default=None, metavar="URL",
                        help="measure run.py serve against this OpenAI-compatible server of the same model ({port}: "
                             "the free port --peer-command was given; default with --peer-command: "
                             "http://127.0.0.1:{port})")
    parser.add_argument("--peer-command", default=None, metavar="CMD",
                        help="start the peer with this command ({port}: a free port), time it to ready, stop its "
                             "process group after")
    parser.add_argument("--concurrency", type=parse_counts, default=None,
                        help="--peer: requests in flight, comma-separated (default 4,16; 4 with --quick)")
    parser.add_argument("--starts", type=positive_int, default=None,
                        help="--peer: starts of each server timed to ready, the first run.py serve's into an empty "
                             "weights cache (default 3; 2 with --quick)")
    parser.add_argument("--ready-timeout", type=positive_float, default=300.0,
                        help="--peer: seconds a server may take to be ready (default 300)")
    parser.add_argument("--request-timeout", type=positive_float, default=900.0,
                        help="--peer: seconds one request may take (default 900)")


def apply_defaults(args: argparse.Namespace) -> None:
    """Issue 28's request set, or ``--quick``'s, where the flags leave it open."""
    args.requests = args.requests or (8 if args.quick else 32)
    args.prompts = args.prompts or ((16, 256) if args.quick else (16, 1024))
    args.new = args.new or ((16, 32) if args.quick else (64, 128))
    args.concurrency = args.concurrency or ([4] if args.quick else [4, 16])
    args.starts = args.starts or (2 if args.quick else 3)
    args.repeats = args.repeats or 2


def vocabulary(model: str | None, weights_cache: Path, dtype: str) -> list[int]:
    """The served model's token ids less its special ones, from the tokenizer ``run.py serve`` loaded (a GGUF's:
    the one converted into ``weights_cache``)."""
    from transformers import AutoTokenizer

    from engine.serving.converted import cache_key, entry_folder
    from engine.serving.model import default_model_path, resolve_dtype

    path = Path(model or default_model_path())
    folder = entry_folder(weights_cache, cache_key(path, resolve_dtype(dtype)[0])) if path.is_file() else path
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def fresh_requests(draw: Callable, args: argparse.Namespace, words: list[int], round_index: int) -> list:
    """``draw``'s request set of ``args.seed`` (its lengths), with prompt ids of their own for ``round_index`` (a
    count over the whole run: no two rounds, of any concurrency, share a prompt)."""
    lengths = draw(args.requests, args.prompts, args.new, words, args.seed)
    ids, table = torch.Generator().manual_seed(args.seed + 7919 * (round_index + 1)), torch.tensor(words)
    return [r._replace(prompt=table[torch.randint(len(table), (len(r.prompt),), generator=ids)].tolist())
            for r in lengths]


def _starts(server: ServerProcess, name: str, count: int) -> list[float]:
    """Start ``server`` ``count`` times, each timed to ready; the last one keeps running."""
    times = []
    for index in range(count):
        times.append(server.start())
        print(f"  {name}: start {index + 1} ready in {times[-1]:.2f} s", flush=True)
        if index < count - 1:
            server.stop()
    return times


def _percentiles(values: list[float]) -> tuple[float, float]:
    return float(np.percentile(values, 50)), float(np.percentile(values, 99))


def output_rate(served: Round) -> float:
    return sum(r.tokens for r in served.replies) / served.wall_s


def way_row(case: str, way: str, chosen: Round, peer: Round, rounds: list[Round], starts: list[float],
            peak: int | None, differing: int, requests: list) -> dict[str, Any]:
    """One server's row from its round of median wall time ``chosen`` (``peer``: the peer's), ``requests`` that
    round's set (what each request asked for)."""
    ttft50, ttft99 = _percentiles([1e3 * (r.first_s - r.sent_s) for r in chosen.replies])
    tpot50, tpot99 = _percentiles([1e3 * (r.finish_s - r.first_s) / (r.tokens - 1) for r in chosen.replies
                                   if r.tokens > 1] or [0.0])
    return {"group": "peer", "case": case, "way": way, "requests": len(chosen.replies),
            "tokens": sum(r.tokens for r in chosen.replies), "asked": sum(q.new_tokens for q in requests),
            "prompt tokens": sum(len(q.prompt) for q in requests), "wall s": chosen.wall_s,
            "tok/s": output_rate(chosen), "vs peer": output_rate(chosen) / output_rate(peer),
            "TTFT p50 ms": ttft50, "TTFT p99 ms": ttft99, "TPOT p50 ms": tpot50, "TPOT p99 ms": tpot99,
            "peak MiB": None if peak is None else peak / 2**20,
            "first start s": starts[0] if starts else None,
            "start to ready s": statistics.median(starts[1:]) if len(starts) > 1 else None,
            "others CPU %": chosen.others_cpu, "differing": differing,
            "short": sum(x.tokens != q.new_tokens for x, q in zip(chosen.replies, requests)),
            "round walls s": [round(r.wall_s, 2) for r in rounds],
            "round others CPU %": [round(r.others_cpu, 1) for r in rounds]}


def _met(value: float | None, sense: str, bound: float) -> str:
    if value is None:
        return "not measured"
    return "yes" if (value >= bound if sense == ">=" else value <= bound) else "no"


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 28's targets: per case the engine's row over the peer's, and the engine's second start."""
    checks = []
    for case in dict.fromkeys(r["case"] for r in rows):
        ours, peer = (next(r for r in rows if r["case"] == case and r["way"] == w) for w in ("engine", "peer"))
        for name, column, sense, bound in RATIO_TARGETS:
            ratio = ours[column] / peer[column] if peer[column] else None
            checks.append({"case": case, "target": f"{name} {sense} {bound}x the peer's", "engine": ours[column],
                           "peer": peer[column], "value": ratio, "met": _met(ratio, sense, bound)})
    second = {r["way"]: r["start to ready s"] for r in rows}
    checks.append({"case": "start", "target": f"second start to ready <= {READY_S:.0f} s", "engine": second["engine"],
                   "peer": second["peer"], "value": second["engine"], "met": _met(second["engine"], "<=", READY_S)})
    return checks


def _measure(url: str, requests: list, concurrency: int, args: argparse.Namespace, pids: list, label: str) -> Round:
    bar = iter(progress(range(len(requests)), label, quiet=args.quiet))
    before = cpu_sample(pids)
    replies, wall = run_load(url, requests, concurrency, args.request_timeout, lambda: next(bar, None))
    after = cpu_sample(pids)
    for _ in bar:  # close the bar
        pass
    others = max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall * 100
    return Round(replies, wall, others)


def _case_rows(case: str, rounds: dict[str, list[Round]], sets: list[list], starts: dict[str, list[float]],
               peaks: dict[str, int | None]) -> list[dict[str, Any]]:
    """Both servers' rows of one concurrency: each from its round of median wall time."""
    median = {w: sorted(range(len(rs)), key=lambda i, rs=rs: rs[i].wall_s)[(len(rs) - 1) // 2]
              for w, rs in rounds.items()}
    differing = sum(a.text != b.text for e, p in zip(rounds["engine"], rounds["peer"])
                    for a, b in zip(e.replies, p.replies))
    return [way_row(case, way, rounds[way][median[way]], rounds["peer"][median["peer"]], rounds[way], starts[way],
                    peaks[way], differing, sets[median[way]]) for way in ("engine", "peer")]


def peer_rows(args: argparse.Namespace, draw: Callable) -> list[dict[str, Any]]:
    """Both servers started (``args.starts`` times each, timed), measured per concurrency, stopped."""
    out, weights = Path(args.out), Path(tempfile.mkdtemp(prefix="bench-serving-weights-"))
    port, peer_port = free_ports(2)
    ours = ServerProcess(serve_command(args.model, port, args.dtype, weights), f"http://127.0.0.1:{port}",
                         out / "serve.log", args.ready_timeout)
    peer_url = base_url((args.peer or "http://127.0.0.1:{port}").replace("{port}", str(peer_port)))
    peer = (ServerProcess(peer_command(args.peer_command, peer_port), peer_url, out / "peer.log", args.ready_timeout)
            if args.peer_command else None)
    rows: list[dict[str, Any]] = []
    try:
        if peer is None:  # a peer already running: asked first, before run.py serve's starts
            wait_ready(peer_url, args.ready_timeout)
        print(f"starting run.py serve {args.starts} times (the first into an empty weights cache) ...", flush=True)
        starts = {"engine": _starts(ours, "run.py serve", args.starts), "peer": []}
        if peer is not None:
            starts["peer"] = _starts(peer, "peer", args.starts)
        words = vocabulary(args.model, weights, args.dtype)
        urls, pids = {"engine": ours.url, "peer": peer_url}, [ours.pid, peer.pid if peer else None]
        warmup = [r._replace(prompt=r.prompt[:8], new_tokens=2) for r in fresh_requests(draw, args, words, -1)[:2]]
        round_index = 0
        for concurrency in args.concurrency:
            case = f"C={concurrency}, {args.requests} requests"
            for url in urls.values():
                run_load(url, warmup, 2, args.request_timeout)
            rounds: dict[str, list[Round]] = {"engine": [], "peer": []}
            sets = []
            for index in range(args.repeats):
                sets.append(fresh_requests(draw, args, words, round_index))
                round_index += 1
                for way in (["engine", "peer"] if index % 2 == 0 else ["peer", "engine"]):
                    rounds[way].append(_measure(urls[way], sets[-1], concurrency, args, pids,
                                                f"bench serving: {case}, {way}, round {index + 1}"))
            peaks = {"engine": ours.peak_bytes(), "peer": peer.peak_bytes() if peer else None}
            rows += _case_rows(case, rounds, sets, starts, peaks)
    finally:
        ours.stop()
        if peer is not None:
            peer.stop()
        shutil.rmtree(weights, ignore_errors=True)
    return rows


def plot(rows: list[dict[str, Any]], path) -> None:
    """Per case: output tokens/s, TTFT and TPOT (bar p50, black tick p99), and each server's start to ready."""
    cases, ways = list(dict.fromkeys(r["case"] for r in rows)), ["engine", "peer"]
    fig, axes = plots.figure(ncols=4, width=4.4)
    panels = (("tok/s", None, "output tokens / s (higher is better)"), ("TTFT p50 ms", "TTFT p99 ms",
              "time to first token, ms"), ("TPOT p50 ms", "TPOT p99 ms", "time per output token, ms"))
    for ax, (column, tail, ylabel) in zip(axes, panels):
        for index, way in enumerate(ways):
            mine = [next(r for r in rows if r["case"] == c and r["way"] == way) for c in cases]
            xs = [position + (index - 0.5) * 0.4 for position in range(len(cases))]
            ax.bar(xs, [r[column] for r in mine], 0.4, color=f"C{index}", label=way)
            if tail:
                ax.hlines([r[tail] for r in mine], [x - 0.2 for x in xs], [x + 0.2 for x in xs], color="black",
                          linewidth=2, label="p99" if index == 0 else None)
        ax.set_xticks(range(len(cases)), cases, fontsize=8, rotation=15)
        ax.set_ylabel(ylabel)
        ax.set_title(ylabel.split(" (")[0] + (" (bar p50, tick p99)" if tail else ""), fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    starts = axes[-1]
    for index, way in enumerate(ways):
        row = next(r for r in rows if r["way"] == way)
        values = [row["first start s"] or 0.0, row["start to ready s"] or 0.0]
        starts.bar([x + (index - 0.5) * 0.4 for x in (0, 1)], values, 0.4, color=f"C{index}", label=way)
    starts.axhline(READY_S, color="gray", linestyle="--", linewidth=1, label=f"target {READY_S:.0f} s (second)")
    starts.set_xticks([0, 1], ["first start", "second start"], fontsize=8)
    starts.set_ylabel("start to ready, s")
    starts.set_title("start to ready (0: not measured)", fontsize=10)
    starts.grid(True, axis="y", alpha=0.3)
    starts.legend(fontsize=7)
    plots.save(fig, path)


def main(args: argparse.Namespace, draw: Callable) -> int:
    """The peer comparison: rows, targets, tables, ``serving_peer.json`` / ``.csv``, its targets' and a plot."""
    apply_defaults(args)
    print(f"run.py serve ({args.dtype}) vs {args.peer_command or args.peer}: {args.requests} requests, prompts "
          f"{args.prompts[0]}..{args.prompts[1]} tokens, {args.new[0]}..{args.new[1]} new tokens, C = "
          f"{', '.join(map(str, args.concurrency))}, {args.repeats} rounds alternating, seed {args.seed}", flush=True)
    rows = peer_rows(args, draw)
    checks = targets(rows)
    print("\n" + format_table(rows, COLUMNS))
    print("\n" + format_table(checks, TARGET_COLUMNS))
    if any(r["differing"] for r in rows):
        print("note: some requests' greedy texts differ between the servers (fp32 near-ties, or other numerics)")
    meta = {**machine_info(), "command": "bench serving --peer", "args": vars(args), "arrivals": "at most C in "
            "flight, each sent as one ends", "engine": "run.py serve", "peer": args.peer_command or args.peer}
    paths = save_results(args.out, "serving_peer", rows, meta)
    paths += save_results(args.out, "serving_peer_targets", checks, meta)[1:]
    plot(rows, f"{args.out}/serving_peer.png")
    print("\nwrote " + ", ".join(str(p) for p in paths) + f", {args.out}/serving_peer.png")
    return 0
