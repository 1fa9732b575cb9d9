"""The readable path of a paged call: each sequence's own ``causal_attention`` call on its keys.

A sequence's keys are gathered from its pages into one ``[1, Hkv, S_b, D]`` tensor (only the slots it owns), its
queries are its rows of q, and the call has its positions and window: the engine's one rule, its kernel chosen as
for any call. A sequence longer than one run of pages is read a run at a time instead (engine.paged.runs: no copy of
the whole sequence), merged by lse. The oracle of the in-place paths: ``kernel="reference"`` always takes it.
"""

from __future__ import annotations

import torch

from engine.attention import causal_attention
from engine.kernels.common import nothing_seen
from engine.masks.window import window_mask
from engine.paged import runs as page_runs
from engine.paged.tables import PagedBatch

__all__ = ["per_sequence", "sequence_call", "gather_keys", "by_runs"]


def per_sequence(q, k_pages, v_pages, tables: PagedBatch, positions, window, scale, kernel, **modifiers):
    """``(out [Nq, Hq, Dv] in q's dtype, lse [Nq, Hq])``: each sequence's own call, its keys a run of pages at a
    time when it has more than one run (any kernel but ``reference``), else gathered from its pages."""
    modifiers = {name: x for name, x in modifiers.items() if x is not None}
    q_heads, dv = q.shape[1], v_pages.shape[3]
    out, lse = nothing_seen((q.shape[0], q_heads), dv, q.dtype, q.device, q.dtype)  # [Nq, Hq, Dv], [Nq, Hq]
    pages = tables.pages  # [B] lists of page ids
    for b in range(tables.batch):
        rows = tables.query_rows(b)
        if rows.stop == rows.start:
            continue
        if by_runs(tables, b, kernel):
            q_b = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
            o, part_lse = page_runs.run_attention(q_b, k_pages, v_pages, pages[b], tables.page_size, 0,
                                                  tables.kv_lens[b], positions[rows], window, scale, kernel,
                                                  **modifiers)
        else:
            args = sequence_call(q, k_pages, v_pages, tables, pages[b], positions, b, window)
            o, part_lse = causal_attention(*args, scale, return_lse=True, kernel=kernel,
                                           **modifiers)  # [1, Hq, q_len, Dv], [1, Hq, q_len]
        out[rows] = o[0].transpose(0, 1).to(out.dtype)  # [q_len, Hq, Dv]
        lse[rows] = part_lse[0].transpose(0, 1).to(lse.dtype)  # [q_len, Hq]
    return out, lse


def by_runs(tables: PagedBatch, b: int, kernel: str) -> bool:
    """Sequence b read a run of pages at a time: more than one run of keys, and not the readable twin (reference)."""
    run = max(page_runs.RUN_KEYS // tables.page_size, 1) * tables.page_size
    return kernel != "reference" and tables.kv_lens[b] > run


def gather_keys(pages, owned: list[int], length: int, page_size: int):
    """A sequence's ``length`` keys (or values) from its pages, ``[1, Hkv, length, E]`` (a QuantizedKV from
    quantized pools): only the slots it owns (its pages' run from key 0, engine.paged.runs.run_keys)."""
    return page_runs.run_keys(pages, owned, 0, length, page_size)


def sequence_call(q, k_pages, v_pages, tables: PagedBatch, pages: list[int], positions: torch.Tensor, b: int,
                  window: int | None):
    """``(q, k, v, query_positions, key_positions, allowed)`` of sequence b (its ``pages``) as one causal_attention
    call."""
    rows, length = tables.query_rows(b), tables.kv_lens[b]
    q_b = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
    k_b = gather_keys(k_pages, pages, length, tables.page_size)  # [1, Hkv, S_b, D]
    v_b = gather_keys(v_pages, pages, length, tables.page_size)  # [1, Hkv, S_b, Dv]
    query_pos = positions[rows]  # [q_len]
    key_pos = torch.arange(length, device=q.device)  # [S_b]
    allowed = None if window is None else window_mask(query_pos, key_pos, window)  # [q_len, S_b]
    return q_b, k_b, v_b, query_pos, key_pos, allowed
