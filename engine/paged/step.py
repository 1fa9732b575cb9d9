"""One step of a model over a paged cache: made once, read by every layer (vLLM's per-step attention metadata).

``begin_step(cache, seqs, indptr)`` makes room for the step's packed new tokens in every layer of the cache (one
page table and allocator for the model, pools per layer: ``PagedKVCache(..., layers=L)``), and records where each
new row goes, the rows' positions and the tables the layers attend through. Each layer writes its own keys and
values to those slots and runs the step's paged plan for its configuration, made by the first layer that asks
(``plan_for``) and reused by the others::

    step = begin_step(cache, seqs, indptr)                       # once per step
    for i, block in enumerate(blocks):
        x = block.forward_paged(x, cache, step=step, layer=i)   # writes layer i's K/V, runs the shared plan
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
    ``[N]``, the page table and key lengths after the write, and the plans its layers share."""

    seqs: list[int]
    indptr: torch.Tensor
    cache: PagedKVCache
    extend: int  # the cache's extend that made room for this step (its layers refuse an older step)
    slots: Slots
    positions: torch.Tensor
    page_table: torch.Tensor
    kv_lens: torch.Tensor
    plans: dict = field(default_factory=dict)

    def plan_for(self, q: torch.Tensor, k_pages, v_pages, *, window=None, softcap=None, scale=None) -> PagedPlan:
        """The step's plan for a layer of this configuration: made by the first layer that asks, reused by every
        other (a layer whose tensors differ, in dtype or gradient need, gets its own)."""
        return reuse(self.plans, (window, softcap, scale), (q, k_pages, v_pages),
                     lambda: plan_paged(q, k_pages, v_pages, self.page_table, self.kv_lens, self.indptr, window=window,
                                        softcap=softcap, scale=scale))


def begin_step(cache: PagedKVCache, seqs: list[int], indptr: torch.Tensor, rows: int | None = None) -> PagedStep:
    """Extend every sequence of ``seqs`` by its rows of ``indptr`` in ``cache`` (all or nothing; ``rows``: the
    packed rows the step has, checked against ``indptr``) and return the step its layers read; positions continue
    each sequence from its length."""
    before = [cache.length(seq) for seq in seqs]  # (an unknown sequence is refused here, before any change)
    slots = cache.extend(seqs, indptr, rows)  # the one check of seqs and indptr
    device = slots.pages.device
    positions = torch.cat([torch.arange(start, cache.length(seq)) for seq, start in zip(seqs, before)]
                          or [torch.zeros(0, dtype=torch.long)]).to(device)  # [N]
    table, lengths = cache.tables(seqs)
    return PagedStep(list(seqs), indptr, cache, cache.extends, slots, positions, table, lengths)


def check_step(step, cache: PagedKVCache, rows: int) -> None:
    """ValueError unless ``step`` is the newest step of ``cache`` (its last ``extend``) for ``rows`` packed rows."""
    if not isinstance(step, PagedStep):
        raise ValueError(f"step must be a PagedStep (engine.paged.step.begin_step), got {type(step).__name__}")
    why = ("of another cache" if step.cache is not cache else "made before the cache last grew"
           if step.extend != cache.extends else f"of {step.slots.pages.shape[0]} rows"
           if step.slots.pages.shape[0] != rows else None)
    if why is not None:
        raise ValueError(f"step must be this cache's newest step for these {rows} rows, got a step {why}")
