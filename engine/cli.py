"""``python run.py <command> ...``: the engine's subcommands.

Each command lives in its own module, which defines ``add_arguments(parser)`` and ``main(args) -> int``.
Modules are imported only when their command runs, so ``run.py --help`` stays fast. The benchmarks and the cost
lab (``lab.*``) live beside the package at the repository's root: the installed package holds the engine, its
integrations and the server.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (command words, module, one-line help)
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("attention",), "engine.examples", "run the seeds' worked examples and check every stated number"),
    (("generate",), "engine.generate", "run a small model end to end with the engine's layer and KV cache"),
    (("serve",), "engine.serving.server", "an OpenAI-compatible HTTP server: continuous batching on the engine"),
    (("build-native",), "engine.kernels.decode.native_build", "compile the native decode kernel for this CPU now"),
    (("memory",), "lab.calculators.memory", "score-matrix and KV-cache memory calculator with model presets"),
    (("bench", "kernels"), "lab.bench.kernels", "engine kernels vs PyTorch SDPA and FlexAttention"),
    (("bench", "scaling"), "lab.bench.scaling", "time and peak memory vs sequence length, fitted exponents"),
    (("bench", "roofline"), "lab.bench.roofline", "prefill vs decode on this machine's roofline"),
    (("bench", "gqa"), "lab.bench.gqa", "decode bytes and FLOPs for several KV-head counts"),
    (("bench", "cp"), "lab.bench.cp", "context parallelism on P processes: time, memory and bytes per rank"),
    (("bench", "overhead"), "lab.bench.overhead", "per-call cost and generate tokens/s vs PyTorch SDPA"),
    (("bench", "paged"), "lab.bench.paged", "decode over a paged KV cache vs the same keys contiguous"),
    (("bench", "builds"), "lab.bench.builds", "builds of the native decode kernel timed against each other"),
    (("bench", "arm"), "lab.bench.arm", "the decode kernel's aarch64 build under qemu: NEON vs portable, in "
     "instructions"),
    (("bench", "sparse"), "lab.bench.sparse", "top-k sparse attention (key_indices) vs SDPA with the dense mask"),
    (("bench", "latent"), "lab.bench.latent", "absorbed-MLA decode over a latent cache vs rows apart, expanded"),
    (("bench", "tiles"), "lab.bench.tiles", "calls of many rows a KV head with and without the AMX-BF16 tiles"),
    (("bench", "serving"), "lab.bench.serving", "concurrent requests: engine CB vs transformers' CB, static; "
     "--peer: run.py serve vs another server"),
    (("explain", "scaling"), "lab.figures.explain_scaling", "why scores are divided by sqrt(d_k)"),
    (("show", "weights"), "lab.figures.show_weights", "heatmaps of attention weights for each mask family"),
]


def _usage() -> str:
    width = max(len(" ".join(words)) for words, _, _ in COMMANDS)
    rows = "\n".join(f"  {' '.join(words):<{width}}  {text}" for words, _, text in COMMANDS)
    return f"usage: run.py <command> [options]\n\ncommands:\n{rows}\n\n`run.py <command> --help` for options."


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    matches = [(words, module, text) for words, module, text in COMMANDS if tuple(argv[:len(words)]) == words]
    if not matches:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown command: {' '.join(argv[:2])!r}\n", file=sys.stderr)
            print(_usage(), file=sys.stderr)
            return 2
        print(_usage())
        return 0
    words, module_name, text = max(matches, key=lambda m: len(m[0]))
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != "lab":
            raise
        print(f"run.py {' '.join(words)} is one of the lab's commands: they run from a checkout of the repository "
              f"(lab/ beside engine/, run.py at its root), not from the installed package alone", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="run.py " + " ".join(words), description=text)
    module.add_arguments(parser)
    args = parser.parse_args(argv[len(words):])
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
