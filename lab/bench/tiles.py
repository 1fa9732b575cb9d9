"""``run.py bench tiles``: calls of many query rows a KV head with and without the native kernel's AMX-BF16 tiles
(decode_native.cpp, "bf16 on AMX tiles, many rows"), each call planned once and run with the tiles on and off in
turn, round by round, in one process.

Cases (a bf16 q; bf16, int8 and fp8 e4m3 caches where noted):

- ``decode G 16``: one new query, Hq 32 / Hkv 2, D 128 (16 rows a KV head; Qwen3-235B's grouping), S 32k;
- ``4 queries G 4``: Hq 32 / Hkv 8, T 4 at the end of S 8k (16 rows: a few speculative tokens);
- ``latent H 16 / H 128``: absorbed MLA over one latent row of 576 per key, V its first 512, S 32k;
- ``top-k prefill``: T 4k queries, each its own list of K 2k keys of S 32k, Hq 16 / Hkv 1, D 64 (key_indices).

``tiles / vector`` is the time with the tiles over the time without; ``max |diff|`` the largest difference between
the two outputs (both rounded to bf16). Where the library has no tiles (a CPU without AMX-BF16, or not granted) the
bench says so and times nothing.

    python run.py bench tiles --quick      # S 4k: seconds
    python run.py bench tiles              # the cases above: about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import engine
from engine.kernels.decode.native_build import load_native
from engine.quantized import quantize
from lab import plots
from lab.measure import format_table, machine_info, progress, save_results
from lab.options import add_common, apply_threads

KINDS = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": getattr(torch, "float8_e4m3fn", None)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "bench_tiles", impl_help="ignored (every case runs both ways)", threads=2)


def _cache(shape: tuple, kind: str, g: torch.Generator):
    x = torch.randn(*shape, generator=g)
    return x.bfloat16() if kind == "bf16" else quantize(x, KINDS[kind])


def _prefix(x, width: int):
    """x's first ``width`` channels (a latent row's values), a view either way."""
    return x[..., :width] if isinstance(x, torch.Tensor) else type(x)(x.data[..., :width], x.scale)


def cases(quick: bool, g: torch.Generator) -> list[tuple[str, tuple, dict]]:
    """``(name, (q, k, v, *positions), options)`` for each call."""
    s = 4096 if quick else 32768
    out = []
    for kind in ("bf16", "int8", "fp8"):
        if KINDS[kind] is None:
            continue
        q = torch.randn(1, 32, 1, 128, generator=g).bfloat16()
        out.append((f"decode G 16 (Hq 32 / Hkv 2), D 128, S {s}, {kind}",
                    (q, _cache((1, 2, s, 128), kind, g), _cache((1, 2, s, 128), kind, g)), {}))
    n = s // 4
    q = torch.randn(1, 32, 4, 128, generator=g).bfloat16()
    out.append((f"4 queries G 4 (Hq 32 / Hkv 8), D 128, S {n}, bf16",
                (q, _cache((1, 8, n, 128), "bf16", g), _cache((1, 8, n, 128), "bf16", g),
                 torch.arange(n - 4, n)[None], torch.arange(n)[None]), {}))
    for kind in ("bf16", "int8", "fp8"):
        if KINDS[kind] is None:
            continue
        rows = _cache((1, 1, s, 576), kind, g)
        for heads in (16, 128):
            q = torch.randn(1, heads, 1, 576, generator=g).bfloat16()
            out.append((f"latent H {heads}, S {s}, {kind}", (q, rows, _prefix(rows, 512)), {}))
    t, k = (512, 256) if quick else (4096, 2048)
    q = torch.randn(1, 16, t, 64, generator=g).bfloat16()
    keys, values = _cache((1, 1, s, 64), "bf16", g), _cache((1, 1, s, 64), "bf16", g)
    qpos, kpos = torch.arange(s - t, s), torch.arange(s)
    listed = (torch.rand(1, 1, t, k, generator=g) * (qpos[None, None, :, None] + 1)).long()
    out.append((f"top-k prefill T {t}, S {s}, K {k}, Hq 16 / Hkv 1, D 64, bf16", (q, keys, values, qpos, kpos),
                {"key_indices": listed, "kernel": "decode_native"}))
    return out


def case_row(library, name: str, inputs: tuple, options: dict, rounds: int) -> dict[str, Any]:
    q, k, v = inputs[:3]
    step = engine.plan(*inputs, **options)
    times: dict[bool, list[float]] = {True: [], False: []}
    outputs = {}
    try:
        for _ in range(rounds + 1):  # (the first round warms both up, untimed)
            for on in (True, False):
                library.use_bf16_tiles(on)
                start = time.perf_counter()
                outputs[on] = step.run(q, k, v)
                times[on].append(time.perf_counter() - start)
    finally:
        library.use_bf16_tiles(True)
    tiles, vector = (sorted(times[on][1:])[rounds // 2] * 1e3 for on in (True, False))
    explained = str(engine.explain(*inputs, **options))
    return {"case": name, "kernel": step.kernel, "tiles ms": tiles, "vector path ms": vector,
            "tiles / vector": tiles / vector, "on the tiles": "AMX-BF16 tiles" in explained,
            "max |diff|": (outputs[True].float() - outputs[False].float()).abs().max().item()}


def plot(rows: list[dict[str, Any]], path) -> None:
    fig, (axes,) = plots.figure(width=8.0)
    plots.grouped_bars(axes, [r["case"] for r in rows], {"tiles / vector path": [r["tiles / vector"] for r in rows]})
    axes.axhline(1.0, color="gray", linestyle="--", label="without the tiles")
    axes.set_ylim(0.0, 1.1)
    axes.legend(fontsize=7)
    axes.set_ylabel("time with the AMX-BF16 tiles / without")
    axes.set_title("many query rows a KV head on the tiles")
    plots.save(fig, path)


def main(args: argparse.Namespace) -> int:
    apply_threads(args)
    library = load_native()
    if isinstance(library, str) or not library.bf16_tiles:
        why = library if isinstance(library, str) else "a CPU without AMX-BF16 (or Linux did not grant the tiles)"
        print(f"bench tiles: no AMX-BF16 tiles here ({why}): nothing to compare")
        return 0
    g = torch.Generator().manual_seed(args.seed)
    rounds = 3 if args.quick else max(5, args.repeats)
    rows = []
    with torch.no_grad():
        for name, inputs, options in progress(cases(args.quick, g), "bench tiles", quiet=args.quiet):
            rows.append(case_row(library, name, inputs, options, rounds))
    print(format_table(rows, ["case", "kernel", "tiles ms", "vector path ms", "tiles / vector", "on the tiles",
                              "max |diff|"]))
    paths = save_results(args.out, "tiles", rows, {**machine_info(), "command": "bench tiles", "args": vars(args)})
    plot(rows, f"{args.out}/tiles.png")
    print("\nwrote " + ", ".join(str(p) for p in paths) + f", {args.out}/tiles.png")
    return 0
