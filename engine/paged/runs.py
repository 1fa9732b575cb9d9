"""A sequence's paged keys attended a run of pages at a time: no copy of the whole sequence, exact by log-sum-exp.

The gathered path copies a sequence's keys into one ``[1, Hkv, S, D]`` tensor before its call: for a 128k-token
prompt that is the whole cache of the sequence copied once more per layer. Here the keys are taken ``RUN_KEYS`` at a
time (whole pages, in the sequence's order): a run of one page is a view of the pool, a longer run is gathered into
a small run-sized copy; each run is one ``causal_attention`` call with its key positions (so its kernel skips the
tiles no query sees, runs full tiles unmasked and masks only partial ones, as for any call) and the runs are merged
by log-sum-exp (engine.kernels.merge). A run no query can see (all later than every query, or all outside every
query's window) is never read::

    keys of a sequence (page_size 4, RUN_KEYS 8):   | p7 p2 | p5 p0 | p3 |
    run 0: keys 0..7  (p7, p2 gathered)  -> out_0, lse_0
    run 1: keys 8..15 (p5, p0 gathered)  -> out_1, lse_1       out, lse = merge(out_r, lse_r)
    run 2: keys 16..18 (p3, a view)      -> out_2, lse_2

Sinks join once, after the merge (a sink is one logit per row, not one per run). The readable twin is the gathered
path (engine.paged.attention), which the tests compare this with.
"""

from __future__ import annotations

import torch

from engine.attention import causal_attention
from engine.kernels.common import nothing_seen
from engine.kernels.merge import merge_attention_states
from engine.masks.window import range_sees, window_mask
from engine.quantized import QuantizedKV

RUN_KEYS = 4096  # keys per run (rounded down to whole pages, one page at least)

__all__ = ["RUN_KEYS", "run_attention", "run_keys", "runs_seen"]


def runs_seen(page_size: int, key_start: int, length: int, query_pos: torch.Tensor, window: int | None):
    """The runs ``(j0, j1)`` of keys ``key_start .. length-1`` some query at ``query_pos`` can see, in order."""
    per_run = max(1, RUN_KEYS // page_size) * page_size
    first, last = int(query_pos.min()), int(query_pos.max())
    runs = []
    for j0 in range(key_start, length, per_run):
        j1 = min(j0 + per_run, length)
        if not range_sees(first, last, j0, j1 - 1, window)[0]:
            continue  # later than every query, or outside every query's window: never read
        runs.append((j0, j1))
    return runs


def run_keys(pages, owned: list[int], j0: int, j1: int, page_size: int):
    """Keys ``j0 .. j1-1`` (``j0`` on a page boundary) of a sequence whose pages are ``owned``: ``[1, Hkv, n, E]``, a
    view of the pool when they lie in one page, else a run-sized copy (a QuantizedKV from quantized pools)."""
    if isinstance(pages, QuantizedKV):
        data, scale = run_keys(pages.data, owned, j0, j1, page_size), run_keys(pages.scale[..., None], owned, j0, j1,
                                                                               page_size)
        return QuantizedKV(data, scale[..., 0])
    first, count = j0 // page_size, -(-(j1 - j0) // page_size)
    ids = [max(page, 0) for page in owned[first:first + count]]  # (a released page, -1, is masked: read page 0)
    if count == 1:
        return pages[ids[0]].transpose(0, 1)[:, :j1 - j0].unsqueeze(0)  # [1, Hkv, n, E], a view
    index = torch.tensor(ids, dtype=torch.long, device=pages.device)  # [count] (none for no keys: an int64 index)
    if pages.stride(1) < pages.stride(2):  # head-major storage (PagedKVCache's): whole pages, then heads first
        rows = pages.transpose(1, 2).index_select(0, index).transpose(0, 1).flatten(1, 2)  # [Hkv, count * P, E]
    else:  # [num_pages, page_size, Hkv, E] pools: whole pages, seen heads first (a view of the copy)
        rows = pages.index_select(0, index).flatten(0, 1).transpose(0, 1)
    return rows[:, :j1 - j0].unsqueeze(0)  # [1, Hkv, n, E]


def run_attention(q_b: torch.Tensor, k_pages, v_pages, owned: list[int], page_size: int, key_start: int, length: int,
                  query_pos: torch.Tensor, window: int | None, scale, kernel: str = "auto", **modifiers):
    """``(out [1, Hq, T, Dv], lse [1, Hq, T])`` of queries ``q_b [1, Hq, T, D]`` at ``query_pos [T]`` over keys
    ``key_start .. length-1`` of pages ``owned``, without sinks (the caller adds them once); ``modifiers``: softcap,
    alibi_slopes (positions make them exact per run). Rows that see nothing: out 0, lse -inf.

    Without ALiBi the queries of a KV head's group are one block of rows (``[1, Hkv, G*T, D]``, row g*T + i: query i
    of head h*G + g): each run's call is then one matrix product per KV head, not G narrower ones."""
    _, q_heads, t, d = q_b.shape
    group = q_heads // k_pages.shape[2]
    grouped = group > 1 and modifiers.get("alibi_slopes") is None
    if grouped:
        q_b = q_b.reshape(1, q_heads // group, group * t, d)  # [1, Hkv, G*T, D]
        query_pos = query_pos.repeat(group)  # [G*T]
    outs, lses = [], []
    for j0, j1 in runs_seen(page_size, key_start, length, query_pos, window):
        key_pos = torch.arange(j0, j1, device=q_b.device)  # [n]
        allowed = None if window is None else window_mask(query_pos, key_pos, window)  # [T, n]
        o, lse = causal_attention(q_b, run_keys(k_pages, owned, j0, j1, page_size),
                                  run_keys(v_pages, owned, j0, j1, page_size), query_pos, key_pos, allowed, scale,
                                  return_lse=True, kernel=kernel, **modifiers)  # [1, H, R, Dv], [1, H, R]
        outs.append(o.to(lse.dtype))
        lses.append(lse)
    if not outs:
        return nothing_seen((1, q_heads, t), v_pages.shape[3], q_b.dtype, q_b.device)
    out, lse = (outs[0], lses[0]) if len(outs) == 1 else merge_attention_states(outs, lses)
    return out.reshape(1, q_heads, t, out.shape[-1]), lse.reshape(1, q_heads, t)  # (rows g*T + i back to heads)
