"""Shared-prefix (cascade) attention: the queries of every sequence that shares a prefix's pages attend to it in one
pass, merged by log-sum-exp with each sequence's own suffix. Exact.

Thirty-two samples of one prompt each hold the prompt's pages (``PagedKVCache.fork``); their decode step would read
those pages 32 times. Here the prefix is read once for all of their queries: one pass of the native decode kernel
in place, every member's queries as rows of their KV head (``G * 32`` rows, so each key block loaded once serves
them all), or where it does not fit, one planned call per run of pages (engine.paged.sequences); and the
suffixes (each sequence's keys after the prefix) go to one
paged call with the page table shifted past the prefix::

    page_table  s0: [p4 p9 | p1]      kv_lens [10, 9, 11], page_size 4: the first 2 pages (8 keys) shared
                s1: [p4 p9 | p6]
                s2: [p4 p9 | p2]
    prefix pass:  q of s0, s1, s2 stacked  x  keys 0..7 of [p4 p9]          -> out_p, lse_p
    suffix pass:  paged call on tables [[p1], [p6], [p2]], kv_lens [2, 1, 3], positions - 8   -> out_s, lse_s
    out, lse = merge((out_p, lse_p), (out_s, lse_s)) per query;  sinks once, after the merge

``shared_prefixes`` finds the groups: sequences whose page tables begin with the same full pages (a group per first
page, its prefix the longest run of columns equal across the group). The readable twin is the plain paged call,
which reads the prefix once per sequence; the tests compare the two.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from engine.kernels.common import DoesNotFit
from engine.kernels.decode.native_paged import NativeStep, native_pass_fits
from engine.kernels.merge import merge_attention_states
from engine.paged.inputs import PagedInputs
from engine.paged.sequences import SequencePlans, plan_sequences
from engine.paged.tables import RELEASED, PagedBatch

CASCADE_MIN_KEYS = 256  # a shared prefix shorter than this is read per sequence (a separate pass costs more)

__all__ = ["CASCADE_MIN_KEYS", "shared_prefixes", "prefix_inputs", "PrefixPass", "plan_prefix", "prefix_part",
           "suffix_tables", "merge_prefix"]


def shared_prefixes(tables: PagedBatch, min_keys: int | None = None) -> list[tuple[list[int], int]]:
    """``[(sequences, pages)]``: groups of two or more sequences with queries whose first ``pages`` page-table
    entries are the same full pages, ``pages * page_size >= min_keys`` (default CASCADE_MIN_KEYS)."""
    min_keys = CASCADE_MIN_KEYS if min_keys is None else min_keys
    size, rows = tables.page_size, tables.page_table
    by_first: dict[int, list[int]] = {}
    for b in range(tables.batch):
        if tables.starts[b + 1] > tables.starts[b] and tables.kv_lens[b] >= size and int(rows[b, 0]) != RELEASED:
            by_first.setdefault(int(rows[b, 0]), []).append(b)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        full = min(tables.kv_lens[b] // size for b in members)  # pages full in every member
        block = rows[members, :full]  # [n, full]
        same = (block == block[:1]).all(0) & (block[0] != RELEASED)  # [full]
        pages = full if bool(same.all()) else int((~same).nonzero()[0])
        if pages * size >= min_keys:
            groups.append((members, pages))
    return groups


def prefix_inputs(inputs: PagedInputs, members: list[int], pages: int) -> tuple[torch.Tensor, PagedInputs]:
    """``(rows [n] int64, call)``: the call of one group's prefix pass, one sequence of the prefix's ``pages`` pages
    whose queries are every member's (its packed ``rows``, at their own positions); sinks join after the merge."""
    tables, size = inputs.tables, inputs.tables.page_size
    rows = torch.cat([torch.arange(tables.starts[b], tables.starts[b + 1]) for b in members]).to(inputs.q.device)
    prefix = PagedBatch([0, len(rows)], [pages * size], tables.page_table[members[0:1], :pages], size,
                        tables.released)
    return rows, replace(inputs, q=inputs.q[rows], tables=prefix, positions=inputs.positions[rows], sinks=None)


def suffix_tables(tables: PagedBatch, groups: list[tuple[list[int], int]], positions: torch.Tensor):
    """``(page_table, kv_lens, positions)`` of the batch with each group's shared pages cut off its members."""
    size = tables.page_size
    shift = [0] * tables.batch
    for members, pages in groups:
        for b in members:
            shift[b] = pages
    width = max(1, max(tables.page_table.shape[1] - s for s in shift))
    table = torch.zeros(tables.batch, width, dtype=torch.long)
    for b, s in enumerate(shift):
        table[b, :tables.page_table.shape[1] - s] = tables.page_table[b, s:]
    kv_lens = torch.tensor([n - s * size for n, s in zip(tables.kv_lens, shift)])
    per_row = torch.repeat_interleave(torch.tensor(shift) * size, torch.tensor(tables.starts).diff())  # [Nq]
    return table, kv_lens, positions - per_row.to(positions.device)

def merge_prefix(out: torch.Tensor, lse: torch.Tensor, parts) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [Nq, Hq, Dv]``, ``lse [Nq, Hq]`` (the suffix pass) with each group's prefix part merged into its rows."""
    out, lse = out.clone(), lse.clone()
    for rows, part_out, part_lse in parts:
        merged_out, merged_lse = merge_attention_states([out[rows].to(part_out.dtype), part_out],
                                                        [lse[rows].to(part_lse.dtype), part_lse])
        out[rows], lse[rows] = merged_out.to(out.dtype), merged_lse.to(lse.dtype)
    return out, lse


class PrefixPass(NamedTuple):
    """A shared prefix read once for every member's queries (``rows``): in place by the native kernel, or by runs of
    pages (``sequences``: the prefix as one sequence holding all those rows)."""

    members: list[int]
    pages: int
    rows: torch.Tensor
    native: NativeStep | None
    sequences: SequencePlans | None
    why_not_native: str | None


def plan_prefix(inputs: PagedInputs, members: list[int], pages: int, kernel: str) -> PrefixPass:
    """The pass of one shared prefix: in place by the native kernel where it reads it, else by runs of pages."""
    rows, prefix = prefix_inputs(inputs, members, pages)
    why_not = (None if kernel in ("auto", "decode_native") else f"kernel={kernel!r} forced") or \
        native_pass_fits(prefix)
    native = None
    if why_not is None:
        try:
            native = NativeStep(prefix)
        except DoesNotFit as error:
            why_not = str(error)
    sequences = plan_sequences(prefix, kernel, runs=True) if native is None else None
    return PrefixPass(members, pages, rows, native, sequences, why_not)


def prefix_part(prefix: PrefixPass, q, k_pages, v_pages, fallback: dict, inputs_now, kernel: str):
    """``(rows, out [n, Hq, Dv], lse [n, Hq])`` of one shared prefix's pass (fp32 / fp64). Where the native pass
    finds NaN/inf in q, the runs keep it to its rows: planned at the first such run (``inputs_now()``: the call
    with this run's tensors) and kept in ``fallback``."""
    q_rows = q[prefix.rows]
    result = None if prefix.native is None else prefix.native.run(q_rows, k_pages, v_pages)
    if result is None:
        runs = prefix.sequences
        if runs is None:
            key = ("prefix", prefix.members[0])
            if key not in fallback:
                fallback[key] = plan_sequences(prefix_inputs(inputs_now(), prefix.members, prefix.pages)[1], kernel,
                                               runs=True)
            runs = fallback[key]
        result = runs.run(q_rows, k_pages, v_pages)
    return (prefix.rows, *result)
