"""explain()'s lines on how ``decode_native`` reads the inputs it runs (builds nothing): which of the library's paths
takes them, from the CPU's flags, the loaded library's own report and the inputs' shapes and dtypes (the kernel
itself decides per call, by the same rules: engine/kernels/decode/decode_native.cpp)."""

from __future__ import annotations

import torch

from engine.inputs import AttentionInputs
from engine.invariance import is_batch_invariant
from engine.kernels.decode.decode_native import KINDS
from engine.kernels.decode.native_build import (
    bf16_dot_built,
    bf16_dot_scores,
    f8_words_built,
    native_amx,
    native_bf16_tiles,
    vector_path,
)
from engine.kernels.decode.native_listed import listed_fits
from engine.quantized import QuantizedKV


def bf16_tiles_note(kind: int | None, rows: int, d: int, dv: int) -> str | None:
    """explain()'s words where a bf16 q's call runs on AMX-BF16 tiles (``native_bf16_tiles``): K/V of kind 1, 3 or 4
    (decode_native.KINDS: bf16, int8, fp8 e4m3), 16 or more query rows a KV head; bf16 K/V of 8-15 rows, or 16 of Dv
    up to 128, and fp8 K/V of 4-15 rows (D and Dv multiples of 64, read as bf16 words: ``f8_words_built``), their
    scores alone; D and Dv multiples of 32; else None (and in batch-invariant mode: DecodeCall.rows_alone). Builds
    nothing."""
    name = {1: "bf16", 3: "int8", 4: "fp8 e4m3"}.get(kind)
    if name is None or d % 32 or dv % 32 or is_batch_invariant() or not native_bf16_tiles():
        return None
    # (decode_native.cpp's score_tiles: bf16 from SCORE_TILE_ROWS, fp8 from F8_SCORE_TILE_ROWS)
    bf16_scores = kind == 1 and 8 <= rows and (rows < 16 or (rows == 16 and dv <= 128))
    f8_scores = kind == 4 and 4 <= rows < 16 and d % 64 == 0 and dv % 64 == 0 and f8_words_built()
    if bf16_scores or f8_scores:
        return f"{name} K/V, {rows} rows a KV head: scores on AMX-BF16 tiles (fp32 sums), softmax and values on vectors"
    if rows < 16:
        return None
    return f"{name} K/V, {rows} rows a KV head: blocks whose rows see the same keys on AMX-BF16 tiles (fp32 sums)"


def native_decode_notes(inputs: AttentionInputs) -> list[str]:
    """explain()'s lines: key_indices in place (each query its own list: G rows a KV head); int8 K/V on AMX tiles
    ("int8 on AMX tiles", ``amx_usable``: ``native_amx``, at most 16 rows a KV head where the bf16 tiles do not take
    them, D 64 / 128, Dv 64k, K and V apart); else its vector path (``vector_path``), with a bf16 q of 16+ rows a KV
    head on AMX-BF16 tiles (8-15 rows of bf16 K/V: their scores; ``bf16_tiles_note``), else scores by vdpbf16ps
    (``bf16_dot_scores``) for a bf16 q of 4k rows a KV head, D 32k, K bf16 (Dv 32k), fp8 or int8 (not where int8
    takes the tiles)."""
    k, v, q = inputs.k, inputs.v, inputs.q
    keys = k.data.dtype if isinstance(k, QuantizedKV) else k.dtype  # (a tensor K shares q's dtype)
    listed = listed_fits(inputs) is None
    rows = q.shape[1] // k.shape[1] * (1 if listed else q.shape[2])  # query rows per KV head (G, or G * T)
    note = bf16_tiles_note(KINDS.get(keys), rows, q.shape[3], v.shape[3]) \
        if q.dtype == torch.bfloat16 and inputs.softcap is None else None  # (a softcap: not on the AMX-BF16 tiles)
    tiles = [note] if note else []
    if listed:
        return ["key_indices: read in place, only each query's listed keys (native_listed)", *tiles]
    if native_amx() and isinstance(k, QuantizedKV) and keys == torch.int8 and k is not v:
        if rows <= 16 and not tiles and q.shape[3] in (64, 128) and v.shape[3] % 64 == 0:
            return ["int8 K/V on AMX tiles: scores and weighted values as integer dot products of fixed-point "
                    "digits (26 bits of each q row's largest, 24 of each block's weights)"]
    fits = v.shape[3] % 16 == 0 and not (keys == torch.int8 and native_amx()) if isinstance(k, QuantizedKV) else \
        v.shape[3] % 32 == 0
    path = [vector_path(q.shape[3], v.shape[3])]
    if tiles:
        return path + tiles
    if bf16_dot_built() and q.dtype == torch.bfloat16 and rows % 4 == 0 and q.shape[3] % 32 == 0 < q.shape[3] and fits:
        return path + [f"bf16 q, {str(keys).removeprefix('torch.')} K: scores {bf16_dot_scores()}"]
    return path
