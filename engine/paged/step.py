"""One step of a model over a paged cache: made once, read by every layer (vLLM's per-step attention metadata).

``begin_step(cache, seqs, indptr)`` makes room for the step's packed new tokens in every layer of the cache (one
page table and allocator for the model, pools per layer: ``PagedKVCache(..., layers=L)``), and records where each
new row goes, the rows' positions and the tables the layers attend through. Each layer writes its own keys and
values to those slots and runs the step's paged plan for its configuration, made by the first layer that asks
(``plan_for``) and reused by the others::

    step = begin_step(cache, seqs, indptr)                       # once per step
    for i, block in enumerate(blocks):
        x = block.forward_paged(x, cache, step=step, layer=i)   # writes layer i's K/V, runs the shared plan

A step's rows need not be each sequence's next tokens in a line: ``positions`` gives their own positions (RoPE's)
and ``allowed`` which of its sequence's keys each row sees, besides the rule over slots (key j visible to the row
at slot i iff j <= i). A draft tree (engine.masks.tree.tree_step_rows) is one such step: node i at slot past + i,
position past + depth, seeing the cache and its ancestors; every layer verifies the whole tree in one call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.paged.cache import PagedKVCache, Slots
from engine.paged.plan import PagedPlan, plan_paged
from engine.planning import reuse

__all__ = ["PagedStep", "begin_step", "check_step"]


@dataclass
class PagedStep:
    """A step's sequences and new rows (``seqs``, ``indptr``), where the rows go (``slots``), their positions
    ``[N]`` (RoPE's; ``own_positions``: given, not the slots'), the page table and key lengths after the write, the
    rows' ``allowed`` keys (bool ``[N, K]`` or None) and the plans its layers share."""

    seqs: list[int]
    indptr: torch.Tensor
    cache: PagedKVCache
    extend: int  # the cache's extend that made room for this step (its layers refuse an older step)
    slots: Slots
    positions: torch.Tensor
    page_table: torch.Tensor
    kv_lens: torch.Tensor
    plans: dict = field(default_factory=dict)
    allowed: torch.Tensor | None = None
    own_positions: bool = False

    def plan_for(self, q: torch.Tensor, k_pages, v_pages, *, window=None, softcap=None, scale=None) -> PagedPlan:
        """The step's plan for a layer of this configuration: made by the first layer that asks, reused by every
        other (a layer whose tensors differ, in dtype or gradient need, gets its own)."""
        if window is not None and self.own_positions:
            raise ValueError(f"a step with its own positions (a draft tree's) cannot serve a layer with a window of "
                             f"{window}: the window would count slots, not the rows' positions")
        return reuse(self.plans, (window, softcap, scale), (q, k_pages, v_pages),
                     lambda: plan_paged(q, k_pages, v_pages, self.page_table, self.kv_lens, self.indptr, window=window,
                                        softcap=softcap, scale=scale, allowed=self.allowed))


def begin_step(cache: PagedKVCache, seqs: list[int], indptr: torch.Tensor, rows: int | None = None, *,
               positions: torch.Tensor | None = None, allowed: torch.Tensor | None = None) -> PagedStep:
    """Extend every sequence of ``seqs`` by its rows of ``indptr`` in ``cache`` (all or nothing; ``rows``: the
    packed rows the step has, checked against ``indptr``) and return the step its layers read; positions continue
    each sequence from its length, or are ``positions`` (int ``[N]``: the rows' RoPE positions, a draft tree's);
    ``allowed`` (bool ``[N, K]``, K >= every sequence's length after the step): the keys of its sequence each row
    may see (paged_attention's ``allowed``)."""
    before = [cache.length(seq) for seq in seqs]  # (an unknown sequence is refused here, before any change)
    counts = cache.check_append(seqs, rows, indptr)
    _check_rows(positions, allowed, sum(counts), max([n + c for n, c in zip(before, counts)] + [0]))
    slots = cache.extend(seqs, indptr, rows)
    device = slots.pages.device
    default = torch.cat([torch.arange(start, cache.length(seq)) for seq, start in zip(seqs, before)]
                        or [torch.zeros(0, dtype=torch.long)]).to(device)  # [N]
    table, lengths = cache.tables(seqs)
    return PagedStep(list(seqs), indptr, cache, cache.extends, slots, default if positions is None else
                     positions.to(device, torch.long), table, lengths, allowed=None if allowed is None else
                     allowed.to(device), own_positions=positions is not None)


def _check_rows(positions, allowed, rows: int, longest: int) -> None:
    """ValueError unless ``positions`` is None or an int tensor ``[rows]``, and ``allowed`` None or bool ``[rows, >=
    longest]``."""
    if positions is not None and (not isinstance(positions, torch.Tensor) or positions.dim() != 1 or positions.shape[0]
                                  != rows or positions.is_floating_point() or positions.dtype == torch.bool):
        got = (f"{positions.dtype} {list(positions.shape)}" if isinstance(positions, torch.Tensor)
               else type(positions).__name__)
        raise ValueError(f"positions must be an int tensor [N] = [{rows}] (each new row's position), got {got}")
    if allowed is not None and (not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool
                                or allowed.dim() != 2 or allowed.shape[0] != rows or allowed.shape[1] < longest):
        got = f"{allowed.dtype} {list(allowed.shape)}" if isinstance(allowed, torch.Tensor) else type(allowed).__name__
        raise ValueError(f"allowed must be a bool tensor [N, K] = [{rows}, >= {longest}] (row: a new row, column "
                         f"j: key j of its sequence), got {got}")


def check_step(step, cache: PagedKVCache, rows: int) -> None:
    """ValueError unless ``step`` is the newest step of ``cache`` (its last ``extend``) for ``rows`` packed rows."""
    if not isinstance(step, PagedStep):
        raise ValueError(f"step must be a PagedStep (engine.paged.step.begin_step), got {type(step).__name__}")
    why = ("of another cache" if step.cache is not cache else "made before the cache last grew"
           if step.extend != cache.extends else f"of {step.slots.pages.shape[0]} rows"
           if step.slots.pages.shape[0] != rows else None)
    if why is not None:
        raise ValueError(f"step must be this cache's newest step for these {rows} rows, got a step {why}")
