"""Converted weights cached on disk, so that a second ``run.py serve`` on a ``.gguf`` file starts in seconds.

transformers' GGUF loader parses the file's metadata three times (SmolLM2's 49,152-token vocabulary and 48,900 merges
are most of it), maps every tensor name and dequantises each tensor: about 15 s for SmolLM2-135M's 272 tensors on every
start. The first start keeps the result as a transformers model directory; later starts load that directory (~0.3 s)::

    ~/.cache/attention-engine/converted/<gguf stem>-<dtype>-<sha256 of the key, 16 hex digits>/
        config.json  generation_config.json  model.safetensors  tokenizer.json  tokenizer_config.json  ...
        manifest.json       the key and every other file's size and sha256, written last

The key (``cache_key``): the GGUF file's resolved path, size and modification time (ns), the dtype, the versions of
transformers and gguf (their conversion code) and this cache's format. An entry is used only when its manifest holds
the key and every file it lists has its size and sha256 (~0.3 s for SmolLM2's 540 MB in float32): a truncated,
corrupt or partial entry is converted again, never trusted. An entry is written in a temporary folder beside the others
and renamed into place, so a crash, or a second server converting at the same time, never leaves half of one.
``ATTENTION_ENGINE_CACHE`` moves the root (as it does for the native decode kernel's builds).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["FORMAT", "cache_key", "cache_root", "entry_folder", "invalid_reason", "load_converted"]

FORMAT = 1  # bump when what an entry holds changes: older entries then miss
MANIFEST = "manifest.json"


def cache_root() -> Path:
    """``$ATTENTION_ENGINE_CACHE/converted``, by default ``~/.cache/attention-engine/converted``."""
    base = os.environ.get("ATTENTION_ENGINE_CACHE") or Path.home() / ".cache" / "attention-engine"
    return Path(base) / "converted"


def cache_key(gguf_file: str | os.PathLike, dtype: torch.dtype) -> dict:
    """What an entry must have been converted from: the file (path, size, mtime), the dtype and the converters."""
    import gguf
    import transformers

    path = Path(gguf_file).resolve()
    stat = path.stat()
    return {"format": FORMAT, "gguf": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "dtype": str(dtype).removeprefix("torch."), "transformers": transformers.__version__,
            "gguf_package": getattr(gguf, "__version__", None) or _version("gguf")}


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def entry_folder(root: Path, key: dict) -> Path:
    """The entry's folder under ``root``: readable names, then a digest of the whole key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(root) / f"{Path(key['gguf']).stem}-{key['dtype']}-{digest}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def invalid_reason(folder: Path, key: dict) -> str | None:
    """None if ``folder`` is a complete entry for ``key``, else why not (missing, another key, a file's size or
    sha256 not the manifest's)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return "no entry" if not folder.exists() else f"no {MANIFEST} (a partial entry)"
    except (OSError, ValueError) as error:
        return f"{MANIFEST} unreadable ({error})"
    if not isinstance(manifest, dict) or manifest.get("key") != key or not isinstance(manifest.get("files"), dict):
        return f"{MANIFEST} is for another key"
    if not manifest["files"]:
        return f"{MANIFEST} lists no files"
    for name, (size, digest) in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} holds {path.stat().st_size} bytes, the manifest says {size}"
        if _sha256(path) != digest:
            return f"{name}'s sha256 is not the manifest's"
    return None


def _write(model, tokenizer, folder: Path, key: dict) -> None:
    """The model as a transformers directory in ``folder`` (which exists, empty), its manifest last."""
    from safetensors.torch import save_model

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):  # the GGUF loader's note; the saved weights are plain tensors
        del config.quantization_config
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})  # tied weights stored once
    tokenizer.save_pretrained(folder)
    files = {p.name: [p.stat().st_size, _sha256(p)] for p in sorted(folder.iterdir()) if p.is_file()}
    (folder / MANIFEST).write_text(json.dumps({"key": key, "files": files}, indent=1))


def _install(built: Path, folder: Path, key: dict) -> None:
    """Rename ``built`` into place at ``folder``; an invalid entry there is moved aside first. If another process
    installed a valid entry meanwhile, that one stays and ``built`` is removed."""
    try:
        if folder.exists():
            if invalid_reason(folder, key) is None:
                shutil.rmtree(built)
                return
            stale = Path(tempfile.mkdtemp(prefix=f".{folder.name}-stale-", dir=folder.parent))
            os.replace(folder, stale / "entry")
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(built, folder)
    except OSError:
        if invalid_reason(folder, key) is not None:
            raise
        shutil.rmtree(built, ignore_errors=True)


def load_converted(gguf_file: str | os.PathLike, dtype: torch.dtype, convert: Callable[[], tuple],
                   load_folder: Callable[[Path], tuple], root: Path | None = None) -> tuple[tuple, str]:
    """``(load_folder(entry), what it did)``: the cached entry of ``gguf_file`` in ``dtype`` when it is valid, else
    ``convert()``'s ``(model, tokenizer)`` written to a new entry first (then loaded from it, so that a first and a
    second start run the same model). ``root``: default ``cache_root()``."""
    root = cache_root() if root is None else Path(root)
    key = cache_key(gguf_file, dtype)
    folder = entry_folder(root, key)
    reason = invalid_reason(folder, key)
    if reason is None:
        return load_folder(folder), f"loaded converted weights from {folder}"
    model, tokenizer = convert()
    root.mkdir(parents=True, exist_ok=True)
    built = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=root))
    try:
        _write(model, tokenizer, built, key)
        _install(built, folder, key)
    finally:
        if built.exists():
            shutil.rmtree(built, ignore_errors=True)
    del model, tokenizer
    again = "" if reason == "no entry" else f" (the entry there was rebuilt: {reason})"
    return load_folder(folder), f"converted {Path(gguf_file).name} and cached it at {folder}{again}"
