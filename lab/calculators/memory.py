"""``run.py memory``: score-matrix and KV-cache memory, with model presets and the seeds' figures.

Two formulas carry the whole calculator (bytes = elements x bytes per element):

    score matrix (materialised, one layer):  B * Hq * T * S * bytes          one FP32 head: 8192^2 * 4 B = 256 MiB
    KV cache (every layer):                  2 * L * Hkv * D * S * B * bytes  (the 2 is K and V)

    weights:                                 params * bytes

Units are exact and say which family they belong to: GB = 1e9 bytes, GiB = 2**30 bytes (see units.py).
``--check-seeds`` prints every figure the seeds state beside the computed value, in the seed's own unit and
precision, and exits 1 on any mismatch. The seeds are the three source texts, named in its ``seed`` column by
number: 000 the attention chapter (one FP32 head's 256 MiB above), 002 the attention-from-scratch lesson,
003 the attention-from-first-principles notes (Llama-3-8B's 17.2 GB KV cache at 128k tokens).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

from engine.kv_cache import kv_cache_bytes
from lab.measure import format_table, save_results
from lab.options import parse_count, parse_counts
from lab.units import DTYPE_BYTES, UNITS, dtype_bytes, format_bytes


@dataclass(frozen=True)
class ModelShape:
    """The sizes that set attention memory, as published in each model's config.json.

    ``hidden``, ``intermediate`` and ``vocab`` give the parameter count of a dense decoder with a SwiGLU MLP,
    RMSNorm and no biases (Llama 3, Qwen3); ``params`` overrides it for free-form models.
    """

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int = 0
    intermediate: int = 0
    vocab: int = 0
    tied_embeddings: bool = False
    qk_norm: bool = False
    params: int = 0

    def parameter_count(self) -> int:
        """``params`` if given, else the count implied by the config (0 when it is unknown)."""
        if self.params or not self.hidden:
            return self.params
        attention = self.hidden * self.head_dim * (2 * self.q_heads + 2 * self.kv_heads)  # Wq, Wk, Wv, Wo
        mlp = 3 * self.hidden * self.intermediate  # gate, up, down
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)  # input (and output) table
        return self.layers * (attention + mlp + norms) + self.hidden + embeddings  # + the final norm


# Published configs (Hugging Face config.json of each model).
PRESETS: dict[str, ModelShape] = {
    "llama-3-8b": ModelShape("Llama-3-8B", layers=32, q_heads=32, kv_heads=8, head_dim=128,
                             hidden=4096, intermediate=14336, vocab=128256),
    "llama-3-70b": ModelShape("Llama-3-70B", layers=80, q_heads=64, kv_heads=8, head_dim=128,
                              hidden=8192, intermediate=28672, vocab=128256),
    "qwen3-0.6b": ModelShape("Qwen3-0.6B", layers=28, q_heads=16, kv_heads=8, head_dim=128,
                             hidden=1024, intermediate=3072, vocab=151936, tied_embeddings=True, qk_norm=True),
}


def score_matrix_bytes(heads: int, q_len: int, k_len: int | None = None, batch: int = 1,
                       bytes_per_element: int = 4) -> int:
    """Bytes of one layer's materialised scores ``[B, H, T, S]`` (``S`` defaults to ``T``)."""
    k_len = q_len if k_len is None else k_len
    return batch * heads * q_len * k_len * bytes_per_element


def model_kv_bytes(model: ModelShape, context: int, batch: int = 1, bytes_per_element: int = 2,
                   kv_heads: int | None = None, scale_bytes: int = 0) -> int:
    """KV-cache bytes of a model; ``kv_heads`` overrides the model's (``q_heads`` gives the MHA baseline);
    ``scale_bytes`` = 4 for the engine's quantized cache (a fp32 scale per token, head, K and V)."""
    heads = model.kv_heads if kv_heads is None else kv_heads
    return kv_cache_bytes(model.layers, batch, heads, context, model.head_dim, bytes_per_element, scale_bytes)


QUANTIZED_KV = ("int8", "fp8")  # --kv-dtype values stored as the engine's quantized cache (engine.quantized)


def crossover_context(model: ModelShape, bytes_per_element: int = 2, batch: int = 1) -> int:
    """Smallest context whose KV cache is larger than the weights (same dtype for both)."""
    weights = model.parameter_count() * bytes_per_element
    if weights <= 0:
        raise ValueError(f"{model.name}: the parameter count is unknown, so no crossover can be computed")
    per_token = model_kv_bytes(model, 1, batch, bytes_per_element)
    return weights // per_token + 1


def decode_intensity(q_heads: int, kv_heads: int, bytes_per_element: int = 2) -> float:
    """FLOPs per byte of one decode step: ``4 * Hq * S * D`` FLOPs over ``2 * Hkv * S * D * bytes`` read."""
    return (4 * q_heads) / (2 * kv_heads * bytes_per_element)


@dataclass(frozen=True)
class SeedFigure:
    """One number a seed states, with the value this calculator computes for it.

    ``unit`` is the seed's own: a byte unit of ``UNITS`` (``"GB"`` and ``"GiB"`` are different units), ``"x"``
    for a ratio, ``"FLOP/B"`` or ``"tokens"``. ``relation`` ``"="`` means equal at the seed's printed precision
    (``decimals``); ``"<"`` means the computed value must lie below the stated one.
    """

    seed: str
    claim: str
    stated: float
    unit: str
    decimals: int
    computed: float
    formula: str
    relation: str = "="

    @property
    def value(self) -> float:
        """The computed value in the seed's unit."""
        return self.computed / UNITS.get(self.unit, 1)

    @property
    def ok(self) -> bool:
        if self.relation == "<":
            return self.value < self.stated
        return round(self.value, self.decimals) == self.stated


def seed_figures() -> list[SeedFigure]:
    """Every memory figure of the seeds, computed from the formulas above (and the presets)."""
    llama8, llama70 = PRESETS["llama-3-8b"], PRESETS["llama-3-70b"]
    fp32, half = DTYPE_BYTES["fp32"], DTYPE_BYTES["bf16"]
    k128 = 128 * 1024  # the seeds' "128k" and "32k" are powers of two: 131,072 and 32,768 tokens
    crossover = crossover_context(llama8, half)
    return [
        SeedFigure("000", "one head's score matrix, T = 8,192, FP32", 256, "MiB", 0,
                   score_matrix_bytes(1, 8192, bytes_per_element=fp32), "1 * 8192^2 * 4 B"),
        SeedFigure("002", "scores, 32 heads, 8,192 tokens, BF16, one sequence, one layer", 4, "GiB", 0,
                   score_matrix_bytes(32, 8192, bytes_per_element=half), "32 * 8192^2 * 2 B"),
        SeedFigure("003", "scores, B = 8, 32 heads, S = 8,192, FP16, one layer", 34.4, "GB", 1,
                   score_matrix_bytes(32, 8192, batch=8, bytes_per_element=half), "8 * 32 * 8192^2 * 2 B"),
        SeedFigure("002", "scores, 32 heads, 32k tokens, BF16, one sequence, one layer", 64, "GiB", 0,
                   score_matrix_bytes(32, 32 * 1024, bytes_per_element=half), "32 * 32768^2 * 2 B"),
        SeedFigure("003", "Llama-3-8B KV cache, 128k context, GQA(8), FP16, one sequence", 17.2, "GB", 1,
                   model_kv_bytes(llama8, k128, bytes_per_element=half), "2 * 32 * 8 * 128 * 2 B * 131072"),
        SeedFigure("003", "Llama-3-8B weights, FP16", 16, "GB", 0,
                   llama8.parameter_count() * half, f"{llama8.parameter_count():,} params * 2 B"),
        SeedFigure("003", "Llama-3-70B: KV cache of MHA (64 KV heads) / GQA(8)", 8, "x", 0,
                   model_kv_bytes(llama70, k128, kv_heads=llama70.q_heads) / model_kv_bytes(llama70, k128),
                   "kv_cache(Hkv=64) / kv_cache(Hkv=8)"),
        SeedFigure("003", "decode intensity, MHA, FP16", 1, "FLOP/B", 0, decode_intensity(32, 32, half),
                   "4 Hq S D / (2 Hkv S D * 2 B)"),
        SeedFigure("003", "decode intensity, GQA 8:1, FP16", 8, "FLOP/B", 0, decode_intensity(32, 4, half),
                   "4 Hq S D / (2 Hkv S D * 2 B)"),
        SeedFigure("003", "context where an 8B GQA model's FP16 cache exceeds its weights (below 128k)",
                   k128, "tokens", 0, crossover,
                   f"{llama8.parameter_count() * half:,} B / {model_kv_bytes(llama8, 1):,} B per token", "<"),
    ]


def check_seeds() -> int:
    """Print each seed figure beside the computed value; return 0 when all match, 1 otherwise."""
    rows = []
    for fig in seed_figures():
        stated = f"{fig.relation if fig.relation != '=' else ''}{fig.stated:,.{fig.decimals}f} {fig.unit}"
        shown = 0 if fig.unit == "tokens" else fig.decimals + 2  # two more decimals than the seed prints
        rows.append({"seed": fig.seed, "figure": fig.claim, "stated": stated,
                     "computed": f"{fig.value:,.{shown}f} {fig.unit}",
                     "formula": fig.formula, "ok": "ok" if fig.ok else "MISMATCH"})
    print(format_table(rows, ["seed", "stated", "computed", "ok", "figure", "formula"]))
    bad = [r for r in rows if r["ok"] != "ok"]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} seed figures reproduced"
          + ("" if not bad else f"; MISMATCH: {', '.join(r['figure'] for r in bad)}"))
    return 1 if bad else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(PRESETS),
                        help="a preset with published head counts, head dim and layers")
    parser.add_argument("--layers", type=parse_count, help="free-form: number of layers (overrides the preset)")
    parser.add_argument("--heads", type=parse_count, help="free-form: query heads Hq (overrides the preset)")
    parser.add_argument("--kv-heads", type=parse_count, help="free-form: key/value heads Hkv (default: Hq)")
    parser.add_argument("--head-dim", type=parse_count, help="free-form: head dim D (default 128)")
    parser.add_argument("--params", type=parse_count, help="free-form: parameter count, e.g. 8e9 or 70.6B")
    parser.add_argument("--context", type=parse_counts, default=parse_counts("8192,32k,128k"),
                        help="comma-separated context lengths; k = 1024 (default: 8192,32k,128k)")
    parser.add_argument("--batch", type=parse_count, default=1, help="sequences in the batch (default 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16",
                        help="element type of scores, cache and weights (default bf16)")
    parser.add_argument("--kv-dtype", choices=sorted({*DTYPE_BYTES, *QUANTIZED_KV}), default=None,
                        help="KV cache dtype (default --dtype); int8 / fp8: the engine's quantized cache, 1 B per "
                        "entry + a 4 B scale per token and head for K and for V")
    parser.add_argument("--check-seeds", action="store_true",
                        help="print every figure the seeds (the source texts) state beside the computed value; "
                        "exit 1 on a mismatch")
    parser.add_argument("--list-models", action="store_true", help="print the presets and exit")
    parser.add_argument("--out", help="folder for memory.json / memory.csv (optional)")


def build_model(args: argparse.Namespace) -> ModelShape:
    """The preset named by ``--model`` with any free-form flag overriding it, or a free-form model."""
    base = PRESETS[args.model] if args.model else None
    heads = args.heads or (base.q_heads if base else None)
    if heads is None:
        raise ValueError("give --model (one of " + ", ".join(sorted(PRESETS)) + ") or at least --heads")
    kv_heads = args.kv_heads or (base.kv_heads if base and not args.heads else heads)
    if heads % kv_heads:
        raise ValueError(f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads})")
    if base is not None and not any((args.layers, args.heads, args.kv_heads, args.head_dim, args.params)):
        return base
    return ModelShape(
        name=(base.name + " (modified)") if base else "free-form",
        layers=args.layers or (base.layers if base else 1),
        q_heads=heads, kv_heads=kv_heads,
        head_dim=args.head_dim or (base.head_dim if base else 128),
        params=args.params or (base.parameter_count() if base else 0),
    )


def memory_rows(model: ModelShape, contexts: list[int], batch: int, element: int, kv_dtype: str | None = None
                ) -> list[dict]:
    """One row per context: materialised scores of one layer, the KV cache (in ``kv_dtype``, default the
    weights' dtype; int8 / fp8 quantized with their scales), and the cache over the weights."""
    weights = model.parameter_count() * element
    kv_element, scale = _kv_element(kv_dtype, element)
    rows = []
    for context in contexts:
        scores = score_matrix_bytes(model.q_heads, context, batch=batch, bytes_per_element=element)
        kv = model_kv_bytes(model, context, batch, kv_element, scale_bytes=scale)
        rows.append({"context": context, "scores_1_layer_bytes": scores, "kv_cache_bytes": kv,
                     "scores_1_layer": f"{format_bytes(scores, 'GiB', 2)} = {format_bytes(scores, 'GB', 2)}",
                     "kv_cache": f"{format_bytes(kv, 'GiB', 2)} = {format_bytes(kv, 'GB', 2)}",
                     "kv_over_weights": kv / weights if weights else float("nan")})
    return rows


def _kv_element(kv_dtype: str | None, element: int) -> tuple[int, int]:
    """(bytes per K/V entry, scale bytes per token and head) in ``kv_dtype`` (None: ``element``, no scales)."""
    if kv_dtype is None:
        return element, 0
    return (1, 4) if kv_dtype in QUANTIZED_KV else (dtype_bytes(kv_dtype), 0)


def describe(model: ModelShape, batch: int, dtype: str) -> list[str]:
    """Header lines: the shape, the weights, KV bytes per token, GQA saving and the crossover context."""
    element = dtype_bytes(dtype)
    per_token = model_kv_bytes(model, 1, batch, element)
    lines = [f"{model.name}: {model.layers} layers, Hq = {model.q_heads}, Hkv = {model.kv_heads}, "
             f"D = {model.head_dim}, batch {batch}, {dtype} ({element} B per element)",
             f"KV cache per token: {format_bytes(per_token, 'KiB')} = 2 * {model.layers} * {model.kv_heads}"
             f" * {model.head_dim} * {batch} * {element} B",
             f"G = Hq / Hkv = {model.q_heads // model.kv_heads}: the cache is {model.q_heads / model.kv_heads:g}x "
             f"smaller than with {model.q_heads} KV heads (MHA); decode intensity "
             f"{decode_intensity(model.q_heads, model.kv_heads, element):g} FLOP/B"]
    params = model.parameter_count()
    if params:
        weights = params * element
        lines.append(f"weights: {params:,} params = {format_bytes(weights, 'GB', 2)} "
                     f"({format_bytes(weights, 'GiB', 2)}); the cache exceeds them from "
                     f"{crossover_context(model, element, batch):,} tokens of context")
    return lines


def main(args: argparse.Namespace) -> int:
    if args.check_seeds:
        return check_seeds()
    if args.list_models:
        print(format_table([{"preset": key, **asdict(m), "params": m.parameter_count()} for key, m in PRESETS.items()],
                           ["preset", "name", "layers", "q_heads", "kv_heads", "head_dim", "params"]))
        return 0
    try:
        model = build_model(args)
    except ValueError as error:
        print(f"error: {error}")
        return 2
    element = dtype_bytes(args.dtype)
    print("\n".join(describe(model, args.batch, args.dtype)) + "\n")
    rows = memory_rows(model, args.context, args.batch, element, args.kv_dtype)
    if args.kv_dtype:
        kv_element, scale = _kv_element(args.kv_dtype, element)
        print(f"KV cache in {args.kv_dtype}: {kv_element} B per entry" + (f" + a {scale} B scale per token and head "
              "(K and V each)" if scale else "") + "\n")
    print(format_table(rows, ["context", "scores_1_layer", "kv_cache", "kv_over_weights"]))
    if args.out:
        paths = save_results(args.out, "memory", rows, {"model": asdict(model), "dtype": args.dtype,
                                                        "kv_dtype": args.kv_dtype or args.dtype, "batch": args.batch})
        print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0
