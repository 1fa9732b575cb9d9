"""A sequence's paged keys attended a run of pages at a time: no copy of the whole sequence, exact by log-sum-exp.

The gathered path copies a sequence's keys into one ``[1, Hkv, S, D]`` tensor before its call: for a 128k-token
prompt that is the whole cache of the sequence copied once more per layer. Here the keys are taken ``RUN_KEYS`` at a
time (whole pages, in the sequence's order): a run of one page is a view of the pool, a longer run is gathered into
a small run-sized copy; each run is one call with its key positions, planned once per step (engine.paged.sequences:
its kernel skips the tiles no query sees, runs full tiles unmasked and masks only partial ones, as for any call) and
the runs are merged by log-sum-exp (engine.kernels.merge). A run no query can see (all later than every query, or
all outside every query's window) is never read::

    keys of a sequence (page_size 4, RUN_KEYS 8):   | p7 p2 | p5 p0 | p3 |
    run 0: keys 0..7  (p7, p2 gathered)  -> out_0, lse_0
    run 1: keys 8..15 (p5, p0 gathered)  -> out_1, lse_1       out, lse = merge(out_r, lse_r)
    run 2: keys 16..18 (p3, a view)      -> out_2, lse_2

Sinks join once, after the merge (a sink is one logit per row, not one per run). The readable twin is the gathered
path (engine.paged.attention), which the tests compare this with.
"""

from __future__ import annotations

import torch

from engine.masks.window import range_sees
from engine.quantized import QuantizedKV

RUN_KEYS = 4096  # keys per run (rounded down to whole pages, one page at least)

__all__ = ["RUN_KEYS", "run_keys", "runs_seen"]


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
    if pages.stride(2) > pages.stride(0):  # each head's pages one region (PagedKVCache's): one copy, per head
        rows = pages.permute(2, 0, 1, 3).index_select(1, index).flatten(1, 2)  # [Hkv, count * P, E]
    elif pages.stride(1) < pages.stride(2):  # each page's heads side by side: whole pages, then heads first
        rows = pages.transpose(1, 2).index_select(0, index).transpose(0, 1).flatten(1, 2)  # [Hkv, count * P, E]
    else:  # [num_pages, page_size, Hkv, E] pools: whole pages, seen heads first (a view of the copy)
        rows = pages.index_select(0, index).flatten(0, 1).transpose(0, 1)
    return rows[:, :j1 - j0].unsqueeze(0)  # [1, Hkv, n, E]
