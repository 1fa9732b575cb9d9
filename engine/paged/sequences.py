"""The readable path of a paged call, planned: each sequence's own call on its keys, decided once per step.

A sequence's keys are gathered from its pages into one ``[1, Hkv, S_b, D]`` tensor (only the slots it owns), its
queries are its rows of q, and its call has its positions and window: the engine's one rule, its kernel chosen as
for any call (engine.plan). A sequence longer than one run of pages is read a run at a time instead
(engine.paged.runs: no copy of the whole sequence), one planned call per run, merged by lse. ``plan_sequences``
plans every sequence's calls once (positions, window masks, kernels); ``SequencePlans.run`` gathers and runs them in
each layer. The oracle of the in-place paths: ``kernel="reference"`` always takes it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.kernels.common import fold_groups, nothing_seen
from engine.kernels.merge import merge_attention_states
from engine.masks.window import window_mask
from engine.paged import runs as page_runs
from engine.paged.inputs import PagedInputs
from engine.planning import AttentionPlan, plan
from engine.quantized import QuantizedKV

__all__ = ["SequencePlans", "plan_sequences", "gather_keys", "by_runs"]


class SequencePlan(NamedTuple):
    """One sequence's calls: its query rows, pages, the planned calls ``((j0, j1, plan), ...)`` on its keys
    ``j0 .. j1-1`` (one run from key 0 when gathered whole; none when no query sees a key), and the GQA group folded
    into the rows of each call (1: none)."""

    b: int
    rows: slice
    pages: list[int]
    runs: tuple
    by_runs: bool
    group: int


class SequencePlans(NamedTuple):
    """Every sequence's planned calls (``plan_sequences``); ``run`` per layer."""

    sequences: tuple[SequencePlan, ...]
    shape: tuple  # (Nq, Hq, Dv) of the call's output
    page_size: int

    def run(self, q: torch.Tensor, k_pages, v_pages):
        """``(out [Nq, Hq, Dv] in q's dtype, lse [Nq, Hq])`` without sinks: each sequence's planned calls on its
        keys gathered from these pools."""
        nq, q_heads, dv = self.shape
        out, lse = nothing_seen((nq, q_heads), dv, q.dtype, q.device, q.dtype)  # [Nq, Hq, Dv], [Nq, Hq]
        for s in self.sequences:
            if not s.runs:
                continue  # no query of it sees a key: 0 and -inf
            q_b = _queries(q, s)  # [1, Hq, T, D] or [1, Hkv, G*T, D]
            parts = [call.run(q_b, page_runs.run_keys(k_pages, s.pages, j0, j1, self.page_size),
                              page_runs.run_keys(v_pages, s.pages, j0, j1, self.page_size), return_lse=True)
                     for j0, j1, call in s.runs]  # [1, H, R, Dv], [1, H, R]
            o, part_lse = parts[0] if len(parts) == 1 else merge_attention_states(
                [o.to(part_lse.dtype) for o, part_lse in parts], [part_lse for _, part_lse in parts])
            t = s.rows.stop - s.rows.start
            out[s.rows] = o.reshape(q_heads, t, dv).transpose(0, 1).to(out.dtype)  # [T, Hq, Dv]
            lse[s.rows] = part_lse.reshape(q_heads, t).transpose(0, 1).to(lse.dtype)  # [T, Hq]
        return out, lse


def plan_sequences(inputs: PagedInputs, kernel: str, *, only: list[int] | None = None,
                   runs: bool | None = None) -> SequencePlans:
    """Plan each sequence's calls (``only``: these sequences; ``runs``: read by runs of pages, None: where a
    sequence has more than one run and the kernel is not the reference)."""
    tables, q = inputs.tables, inputs.q
    modifiers = {name: x for name, x in (("softcap", inputs.softcap), ("alibi_slopes", inputs.alibi_slopes))
                 if x is not None}
    per_head = inputs.alibi_slopes is not None or inputs.score_mod is not None  # (no GQA fold: heads stay heads)
    pages, sequences = tables.pages, []
    for b in range(tables.batch) if only is None else only:
        rows = tables.query_rows(b)
        if rows.stop == rows.start:
            continue
        split = by_runs(tables, b, kernel) if runs is None else runs
        group = q.shape[1] // inputs.k_pages.shape[2] if split and not per_head else 1
        if inputs.score_mod is not None:  # its batch index: the sequence's
            modifiers["score_mod"] = _in_sequence(inputs.score_mod, b)
        s = SequencePlan(b, rows, pages[b], (), split, group)
        q_b, query_pos = _queries(q, s), inputs.positions[rows].repeat(group)  # [1, H, R, D], [R]
        mask = None if inputs.allowed is None else inputs.allowed[rows].repeat(group, 1)  # [R, K] or None
        listed = None if inputs.key_indices is None else \
            inputs.key_indices[rows].transpose(0, 1).repeat(1, group, 1)  # [Hkv|1, R, K]
        spans = page_runs.runs_seen(tables.page_size, 0, tables.kv_lens[b], query_pos, inputs.window) if split \
            else [(0, tables.kv_lens[b])]
        calls = tuple((j0, j1, _plan_call(q_b, inputs, query_pos, j0, j1, kernel, modifiers, mask, listed))
                      for j0, j1 in spans)
        sequences.append(s._replace(runs=calls))
    return SequencePlans(tuple(sequences), (q.shape[0], q.shape[1], inputs.v_pages.shape[3]), tables.page_size)


def _plan_call(q_b, inputs: PagedInputs, query_pos, j0: int, j1: int, kernel: str, modifiers: dict,
               mask: torch.Tensor | None, listed: torch.Tensor | None = None) -> AttentionPlan:
    """The plan of one call on keys ``j0 .. j1-1`` (planned on empty stand-ins of the gathered keys: their shape,
    dtype, device and gradient need); ``mask``: the call's ``allowed`` rows ``[R, K]`` or None; ``listed``: its
    rows' key indices into the sequence ``[Hkv|1, R, K]`` (made relative to j0; outside the run: -1) or None."""
    key_pos = torch.arange(j0, j1, device=q_b.device)  # [n]
    allowed = None if inputs.window is None else window_mask(query_pos, key_pos, inputs.window)  # [R, n]
    if mask is not None:
        allowed = mask[:, j0:j1] if allowed is None else allowed & mask[:, j0:j1]
    if listed is not None:
        listed = torch.where((listed >= j0) & (listed < j1), listed - j0, -1)[None]  # [1, Hkv|1, R, K]
    k, v = (_stand_in(pool, j1 - j0) for pool in (inputs.k_pages, inputs.v_pages))
    return plan(q_b, k, v, query_pos, key_pos, allowed, inputs.scale, kernel=kernel, key_indices=listed, **modifiers)


def _in_sequence(score_mod, b: int):
    """``score_mod`` called from sequence b's own call (batch index 0) with the sequence's index."""
    return lambda score, batch, head, query_pos, key_pos: score_mod(score, batch + b, head, query_pos, key_pos)


def _stand_in(pool, n: int):
    """An empty ``[1, Hkv, n, E]`` tensor (a QuantizedKV from quantized pools) like a run of ``n`` keys of
    ``pool``."""
    _, _, kv_heads, e = pool.shape
    if isinstance(pool, QuantizedKV):
        return QuantizedKV(pool.data.new_empty(1, kv_heads, n, e), pool.scale.new_empty(1, kv_heads, n))
    return pool.new_empty(1, kv_heads, n, e).requires_grad_(pool.requires_grad)


def _queries(q: torch.Tensor, s: SequencePlan) -> torch.Tensor:
    """Sequence ``s``'s queries ``[1, Hq, T, D]``, or with its group folded into rows ``[1, Hkv, G*T, D]`` (row
    g*T + i: query i of head h*G + g)."""
    q_b = q[s.rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
    return q_b if s.group == 1 else fold_groups(q_b, q_b.shape[1] // s.group)


def by_runs(tables, b: int, kernel: str) -> bool:
    """Sequence b read a run of pages at a time: more than one run of keys, and not the readable twin (reference)."""
    run = max(page_runs.RUN_KEYS // tables.page_size, 1) * tables.page_size
    return kernel != "reference" and tables.kv_lens[b] > run


def gather_keys(pages, owned: list[int], length: int, page_size: int):
    """A sequence's ``length`` keys (or values) from its pages, ``[1, Hkv, length, E]`` (a QuantizedKV from
    quantized pools): only the slots it owns (its pages' run from key 0, engine.paged.runs.run_keys)."""
    return page_runs.run_keys(pages, owned, 0, length, page_size)
