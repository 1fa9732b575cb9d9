"""A paged call validated: what every path of it reads, checked once (the paged twin of engine.inputs).

``paged_inputs(...)`` takes ``paged_attention``'s arguments, checks the tables against the pools and q
(engine.paged.tables: one host read of the small tables), resolves the query positions, the scale and the sinks,
checks released pages against every query's window, and returns a ``PagedInputs``. Kernels read it to say whether
they read the pools in place (their ``Kernel.paged`` row, engine.kernels.dispatch) and to prepare their run; the
readable path plans each sequence's call from it (engine.paged.sequences)::

    options()    what a kernel must compute besides the position rule: {"paged"} always, and "softcap",
                 "alibi", "allowed" (a mask), "quantized_kv" (int8 / fp8 pools) where given (``Kernel.takes``)

``allowed`` (bool ``[Nq, K]``, K at least every sequence's key count) says which keys of its sequence each query row
may see, column j for key j: the engine's ``allowed``, ANDed with the position rule and the window (a speculative
tree's ancestors, a document's bounds, padding). ``score_mod(score, sequence, head, query_pos, key_pos)`` is
causal_attention's, its batch index the sequence's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.inputs import resolve_positions, resolve_scale
from engine.kernels.common import needs_grad
from engine.masks.window import check_window
from engine.modifiers import prepare_modifiers
from engine.paged.tables import PagedBatch, check_released, paged_batch
from engine.quantized import QuantizedKV

__all__ = ["PagedInputs", "paged_inputs", "select"]


@dataclass(frozen=True)
class PagedInputs:
    """One paged call, validated: q ``[Nq, Hq, D]`` and the pools as given (read for their shapes, dtypes, strides
    and device while planning; a plan keeps none of them), the tables, the positions int64 ``[Nq]`` (the call's own
    copy), the window, the modifiers (scale a float; sinks ``[Hq]`` fp32 or None) and whether gradients are needed."""

    q: torch.Tensor
    k_pages: object
    v_pages: object
    tables: PagedBatch
    positions: torch.Tensor
    window: int | None
    softcap: float | None
    scale: float
    sinks: torch.Tensor | None
    alibi_slopes: torch.Tensor | None
    grad: bool
    allowed: torch.Tensor | None = None
    score_mod: object = None  # (score, sequence, head, query_pos, key_pos) -> score, as causal_attention's
    key_indices: torch.Tensor | None = None  # int64 [Nq, Hkv|1, K]: each query's listed keys of its sequence (-1 none)

    def options(self) -> frozenset[str]:
        """What a kernel must compute for this call besides the position rule (``Kernel.takes`` lists what it does)."""
        options = {"paged"}
        if self.softcap is not None:
            options.add("softcap")
        if self.alibi_slopes is not None:
            options.add("alibi")
        if self.allowed is not None:
            options.add("allowed")
        if self.score_mod is not None:
            options.add("score_mod")
        if self.key_indices is not None:
            options.add("key_indices")
        if isinstance(self.k_pages, QuantizedKV) or isinstance(self.v_pages, QuantizedKV):
            options.add("quantized_kv")
        return frozenset(options)

    def queries_per_sequence(self) -> set[int]:
        """The distinct numbers of query rows the sequences have."""
        starts = self.tables.starts
        return {starts[b + 1] - starts[b] for b in range(self.tables.batch)}


def paged_inputs(q: torch.Tensor, k_pages, v_pages, page_table: torch.Tensor, kv_lens: torch.Tensor,
                 query_indptr: torch.Tensor, query_positions: torch.Tensor | None = None, *, window: int | None = None,
                 softcap: float | None = None, scale: float | None = None, sinks: torch.Tensor | None = None,
                 alibi_slopes: torch.Tensor | None = None, allowed: torch.Tensor | None = None,
                 score_mod=None, key_indices: torch.Tensor | None = None) -> PagedInputs:
    """Validate a paged call (``paged_attention``'s arguments); a ValueError names what was expected and given."""
    tables = paged_batch(q, k_pages, v_pages, page_table, kv_lens, query_indptr, query_positions is None)
    positions = _query_positions(query_positions, tables, q)
    check_window(window)
    if alibi_slopes is not None and (not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dim() != 1):
        raise ValueError(f"alibi_slopes of a paged call must be [Hq] = [{q.shape[1]}] (one slope per query head), got "
                         f"{getattr(alibi_slopes, 'shape', type(alibi_slopes).__name__)}")
    scale = resolve_scale(scale, q.shape[2])  # one float for every path (a bad scale refused on each alike)
    if score_mod is not None and not callable(score_mod):
        raise ValueError(f"score_mod must be a callable (score, sequence, head, query_pos, key_pos) -> score, got "
                         f"{type(score_mod).__name__}")
    check_released(tables, positions, window)
    if sinks is not None:
        sinks = prepare_modifiers((q.shape[0], q.shape[1], 1, 1), q.device, sinks=sinks).sinks
    return PagedInputs(q, k_pages, v_pages, tables, positions, window, softcap, scale, sinks, alibi_slopes,
                       needs_grad(q, k_pages, v_pages), _allowed(allowed, tables, q), score_mod,
                       _key_indices(key_indices, tables, q, k_pages.shape[2]))


def _allowed(allowed, tables: PagedBatch, q: torch.Tensor) -> torch.Tensor | None:
    """The call's own copy of ``allowed`` (bool ``[Nq, K]``), checked; None for None."""
    if allowed is None:
        return None
    longest = max(tables.kv_lens, default=0)
    if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool or allowed.dim() != 2 or \
            allowed.shape[0] != q.shape[0] or allowed.shape[1] < longest:
        raise ValueError(f"allowed of a paged call must be a bool tensor [Nq, K] = [{q.shape[0]}, >= {longest}] (row: "
                         f"a query, column j: key j of its sequence), got "
                         f"{getattr(allowed, 'dtype', type(allowed).__name__)} {list(getattr(allowed, 'shape', []))}")
    if allowed.device != q.device:
        raise ValueError(f"allowed must be on q's device {q.device}, got {allowed.device}")
    return allowed[:, :longest].clone()


def _key_indices(key_indices, tables: PagedBatch, q: torch.Tensor, kv_heads: int) -> torch.Tensor | None:
    """The call's own int64 copy of ``key_indices`` ``[Nq, Hkv|1, K]``, checked (each row's indices in [-1, its
    sequence's key count)); None for None."""
    if key_indices is None:
        return None
    if not isinstance(key_indices, torch.Tensor) or key_indices.dtype not in (torch.int32, torch.int64) or \
            key_indices.dim() != 3 or key_indices.shape[0] != q.shape[0] or key_indices.shape[1] not in (1, kv_heads):
        raise ValueError(f"key_indices of a paged call must be an int32 / int64 tensor [Nq, Hkv|1, K] = [{q.shape[0]}, "
                         f"{kv_heads} or 1, K] (a query's listed keys of its sequence, -1 none), got "
                         f"{getattr(key_indices, 'dtype', type(key_indices).__name__)} "
                         f"{list(getattr(key_indices, 'shape', []))}")
    if key_indices.device != q.device:
        raise ValueError(f"key_indices must be on q's device {q.device}, got {key_indices.device}")
    lens = torch.repeat_interleave(torch.tensor(tables.kv_lens, dtype=torch.long),
                                   torch.tensor([tables.starts[b + 1] - tables.starts[b] for b in range(tables.batch)]))
    if key_indices.numel():
        low = int(key_indices.min())
        over = (key_indices.amax(dim=(1, 2)).cpu() - lens).max() if lens.numel() else torch.tensor(-1)
        if low < -1 or int(over) >= 0:
            raise ValueError(f"key_indices must lie in [-1, kv_len) of each query's sequence (-1: no key), got values "
                             f"from {low} to {int(key_indices.max())} (kv_lens {tables.kv_lens})")
    return key_indices.long().clone()


def select(inputs: PagedInputs, members: list[int]) -> tuple[torch.Tensor, PagedInputs]:
    """``(rows [n] int64, call)``: the call of sequences ``members`` alone (their query rows of q, positions, tables;
    sinks left to the whole call's caller, which applies them once per row)."""
    tables = inputs.tables
    rows = torch.cat([torch.arange(tables.starts[b], tables.starts[b + 1]) for b in members])
    counts = [tables.starts[b + 1] - tables.starts[b] for b in members]
    starts = [0, *torch.tensor(counts).cumsum(0).tolist()]
    chosen = PagedBatch(starts, [tables.kv_lens[b] for b in members], tables.page_table[members],
                        tables.page_size, tables.released)
    rows = rows.to(inputs.q.device)
    return rows, replace(inputs, q=inputs.q[rows], tables=chosen, positions=inputs.positions[rows], sinks=None,
                         allowed=None if inputs.allowed is None else inputs.allowed[rows],
                         key_indices=None if inputs.key_indices is None else inputs.key_indices[rows])


def _query_positions(query_positions, tables: PagedBatch, q: torch.Tensor) -> torch.Tensor:
    """int64 ``[Nq]`` (the call's own copy): the given positions, or each sequence's last ``q_len`` key positions."""
    if query_positions is not None:
        return resolve_positions(query_positions, 1, q.shape[0], 0, q.device, "query_positions")[0].clone()  # [Nq]
    default = [torch.arange(tables.kv_lens[b] - (tables.starts[b + 1] - tables.starts[b]), tables.kv_lens[b])
               for b in range(tables.batch)]
    return torch.cat(default).to(q.device) if default else torch.zeros(0, dtype=torch.long, device=q.device)
