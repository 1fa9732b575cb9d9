"""Plan a paged step once, run it in every layer: ``plan_paged(...) -> PagedPlan``, then ``plan.run(q, k, v)``.

A serving step calls paged attention in every layer with the same tables (page table, key lengths, query offsets,
positions); only q and the pools change. ``plan_paged`` validates the tables and reads them to the host once,
resolves the positions, checks released pages, finds the shared prefixes, chooses the path and, for a decode step
read in place, builds the native kernel's call (page table, lengths, each row's visibility) once; ``run`` checks
that q and the pools are the tensors planned for (engine.planning's ``Signature``) and runs, reading nothing back
to the host on the in-place path::

    step = engine.plan_paged(q, k_pages, v_pages, page_table, kv_lens, query_indptr)   # once per step
    for layer in layers:
        out = step.run(q_layer, k_pages_of[layer], v_pages_of[layer])                  # every layer
    print(step)   # the path and why; each sequence's kernel where each runs its own call

The paths (engine.paged.attention's docstring shows each): ``flex`` (forced, or auto on CUDA), ``cascade`` (a prefix
several sequences share read once), ``native in place`` (a decode step), ``per sequence`` (the readable path:
gathered, or a run of pages at a time). A plan owns what it decided: the tables and positions are copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.inputs import resolve_positions, resolve_scale
from engine.kernels.common import DoesNotFit, needs_grad
from engine.kernels.flex.paged import flex_paged_attention, flex_paged_fits
from engine.kernels.sinks import apply_sinks
from engine.masks.window import check_window
from engine.modifiers import prepare_modifiers
from engine.paged.cascade import cascade_parts, merge_prefix, shared_prefixes, suffix_tables
from engine.paged.explain import describe
from engine.paged.native import NativeStep, native_paged_fits
from engine.paged.sequences import per_sequence
from engine.paged.tables import PagedBatch, check_released, paged_batch
from engine.planning import Signature, TensorSignature, signature_of

__all__ = ["PagedPlan", "plan_paged"]

PATHS = ("flex", "cascade", "native in place", "per sequence")


@dataclass(frozen=True)
class PagedPlan:
    """A paged step with its path chosen: ``run(q, k_pages, v_pages)`` for tensors of the planned signature.

    tables: the validated tables (host ints and the page table); positions: int64 ``[Nq]``; path: one of PATHS and
    why; native: the prepared in-place call (path ``native in place``); groups: the shared prefixes (``cascade``),
    suffix: the plan of the suffixes' call."""

    signature: Signature
    grad: bool
    tables: PagedBatch
    query_indptr: torch.Tensor
    positions: torch.Tensor
    window: int | None
    softcap: float | None
    scale: float
    sinks: torch.Tensor | None
    alibi_slopes: torch.Tensor | None
    kernel: str
    path: str
    reason: str
    native: NativeStep | None = None
    groups: tuple = ()
    suffix: PagedPlan | None = None
    flex_lse: bool = False  # the Flex path also fits when the lse is asked for

    def run(self, q: torch.Tensor, k_pages, v_pages, *, return_lse: bool = False):
        """``out [Nq, Hq, Dv]`` in q's dtype (``(out, lse [Nq, Hq])`` with ``return_lse``) for q and pools of the
        planned shapes, dtypes and device; a ValueError names what differs from the plan otherwise."""
        if not self.matches(q, k_pages, v_pages):
            self._refuse(q, k_pages, v_pages)
        out, lse = self._attend(q, k_pages, v_pages, return_lse)
        return (out, lse) if return_lse else out

    __call__ = run

    def matches(self, q, k_pages, v_pages) -> bool:
        """True when q and the pools are tensors this plan was made for (kind, shape, dtype, device; gradients)."""
        if not isinstance(q, torch.Tensor):
            return False
        try:
            given = signature_of(q, k_pages, v_pages)
        except AttributeError:  # not a tensor
            return False
        return given == self.signature and needs_grad(q, k_pages, v_pages) == self.grad

    def _refuse(self, q, k_pages, v_pages) -> None:
        for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
            if not hasattr(x, "shape") or not hasattr(x, "device"):
                raise ValueError(f"{name} must be a torch.Tensor (a pool may be a QuantizedKV), got "
                                 f"{type(x).__name__}")
        for name, planned, got in zip(("q", "k_pages", "v_pages"), self.signature,
                                      signature_of(q, k_pages, v_pages)):
            for what, want, have in zip(TensorSignature._fields, planned, got):
                if want != have:
                    want, have = (list(x) if isinstance(x, torch.Size) else x for x in (want, have))
                    raise ValueError(f"this paged plan was made for {name}'s {what} {want}, got {have}: plan the "
                                     f"step for these tensors (engine.plan_paged)")
        state = "need" if self.grad else "do not need"
        raise ValueError(f"this paged plan was made for tensors that {state} gradients, got the other kind: plan "
                         f"the step under the same grad mode")

    def _attend(self, q, k_pages, v_pages, return_lse: bool):
        """``(out, lse)`` on the planned path; the in-place paths fall back to the readable one when they find NaN/inf
        in q (which it keeps to its rows)."""
        if self.path == "flex" and (self.flex_lse or not return_lse):
            result = flex_paged_attention(q, k_pages, v_pages, self.tables, self.positions, self.window,
                                          self.softcap, self.scale, self.sinks, return_lse=return_lse)
            if result is not None:  # (None: NaN/inf in q or an overflow: the gathered path is exact)
                return result  # (sinks applied by the Flex path)
        result = None
        if self.path == "cascade":
            modifiers = {name: x for name, x in (("softcap", self.softcap), ("alibi_slopes", self.alibi_slopes))
                         if x is not None}
            parts = cascade_parts(q, k_pages, v_pages, self.tables, self.positions, list(self.groups), self.window,
                                  self.scale, self.kernel, modifiers)
            out, lse = self.suffix.run(q, k_pages, v_pages, return_lse=True)
            result = merge_prefix(out, lse, parts)
        elif self.native is not None:
            result = self.native.run(q, k_pages, v_pages)
        if result is None:
            result = per_sequence(q, k_pages, v_pages, self.tables, self.positions, self.window, self.scale,
                                  self.kernel, softcap=self.softcap, alibi_slopes=self.alibi_slopes)
        out, lse = result
        if self.sinks is not None:  # once per row, after every part: [Nq, Hq, 1, Dv] and [Nq, Hq, 1] as [B, Hq, T, ..]
            out, lse = (x[:, :, 0] for x in apply_sinks(out[:, :, None], lse[:, :, None], self.sinks))
        return out, lse

    def __str__(self) -> str:
        return describe(self)


def plan_paged(q: torch.Tensor, k_pages, v_pages, page_table: torch.Tensor, kv_lens: torch.Tensor,
               query_indptr: torch.Tensor, query_positions: torch.Tensor | None = None, *, window: int | None = None,
               softcap: float | None = None, scale: float | None = None, sinks: torch.Tensor | None = None,
               alibi_slopes: torch.Tensor | None = None, kernel: str = "auto",
               cascade: bool | None = None) -> PagedPlan:
    """Validate a paged step and choose its path once (``paged_attention``'s arguments; q and the pools are read for
    their shapes, dtypes and device, not their values). ``paged_attention(...)`` is
    ``plan_paged(...).run(q, k_pages, v_pages)``."""
    tables = paged_batch(q, k_pages, v_pages, page_table, kv_lens, query_indptr, query_positions is None)
    positions = _query_positions(query_positions, tables, q)
    _check_options(window, alibi_slopes, q.shape[1], cascade)
    scale = resolve_scale(scale, q.shape[2])  # one float for every path (a bad scale refused on each alike)
    check_released(tables, positions, window)
    if sinks is not None:
        sinks = prepare_modifiers((q.shape[0], q.shape[1], 1, 1), q.device, sinks=sinks).sinks
    grad = needs_grad(q, k_pages, v_pages)
    signature = Signature(*(TensorSignature(*part) for part in signature_of(q, k_pages, v_pages)))
    common = dict(signature=signature, grad=grad, tables=tables, query_indptr=query_indptr, positions=positions,
                  window=window, softcap=softcap, scale=scale, sinks=sinks, alibi_slopes=alibi_slopes,
                  kernel=kernel)
    groups = [] if cascade is False else shared_prefixes(tables, min_keys=1 if cascade else None)
    why_not_flex = _why_not_flex(q, k_pages, v_pages, tables, softcap, alibi_slopes, sinks, kernel, grad, False)
    if not groups and why_not_flex is None:
        flex_lse = _why_not_flex(q, k_pages, v_pages, tables, softcap, alibi_slopes, sinks, kernel, grad,
                                 True) is None
        return PagedPlan(**common, path="flex", flex_lse=flex_lse,
                         reason="Flex reads K/V in place from the pools (a BlockMask of each sequence's pages; no "
                                "gathered copy)")
    if groups:  # the shared prefixes once, then one paged call on the suffixes (planned here too)
        table, lens, shifted = suffix_tables(tables, groups, positions)
        suffix = plan_paged(q, k_pages, v_pages, table, lens, query_indptr, shifted, window=window, softcap=softcap,
                            scale=scale, alibi_slopes=alibi_slopes, kernel=kernel, cascade=False)
        return PagedPlan(**common, path="cascade", groups=tuple(groups), suffix=suffix,
                         reason="shared prefixes read once for every sequence that holds them")
    why_not = native_paged_fits(q, k_pages, v_pages, tables, softcap, alibi_slopes, kernel)
    if why_not is None:
        try:
            native = NativeStep(tuple(q.shape), k_pages, v_pages, tables, positions, window, scale)
            return PagedPlan(**common, path="native in place", native=native,
                             reason=f"decode_native reads K/V in place through the page table (every sequence "
                                    f"{tables.starts[1] - tables.starts[0]} queries; no gathered copy)")
        except DoesNotFit as error:
            why_not = str(error)
    return PagedPlan(**common, path="per sequence", reason=f"not decode_native in place: {why_not}")


def _why_not_flex(q, k_pages, v_pages, tables: PagedBatch, softcap, alibi_slopes, sinks, kernel: str, grad: bool,
                  return_lse: bool) -> str | None:
    """Why the in-place Flex path does not run this call (None: it does): ``kernel="flex"`` asks for it; ``auto``
    takes it on CUDA (on the CPU the native kernel and the fused op are faster, measured)."""
    if kernel != "flex" and not (kernel == "auto" and q.device.type == "cuda"):
        return "Flex in place: kernel='flex', or auto on CUDA"
    return flex_paged_fits(q, k_pages, v_pages, tables, softcap, alibi_slopes, sinks, grad, return_lse=return_lse)


def _query_positions(query_positions, tables: PagedBatch, q: torch.Tensor) -> torch.Tensor:
    """int64 ``[Nq]`` (the plan's own copy): the given positions, or each sequence's last ``q_len`` key positions."""
    if query_positions is not None:
        return resolve_positions(query_positions, 1, q.shape[0], 0, q.device, "query_positions")[0].clone()  # [Nq]
    default = [torch.arange(tables.kv_lens[b] - (tables.starts[b + 1] - tables.starts[b]), tables.kv_lens[b])
               for b in range(tables.batch)]
    return torch.cat(default).to(q.device) if default else torch.zeros(0, dtype=torch.long, device=q.device)


def _check_options(window, alibi_slopes, q_heads: int, cascade) -> None:
    if cascade is not None and not isinstance(cascade, bool):
        raise ValueError(f"cascade must be True, False or None (auto), got {cascade!r}")
    check_window(window)
    if alibi_slopes is not None and (not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dim() != 1):
        raise ValueError(f"alibi_slopes of a paged call must be [Hq] = [{q_heads}] (one slope per query head), got "
                         f"{getattr(alibi_slopes, 'shape', type(alibi_slopes).__name__)}")
