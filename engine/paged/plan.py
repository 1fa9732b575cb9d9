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

How it is decided, the contiguous call's way: the call is validated once (engine.paged.inputs.PagedInputs), a prefix
several sequences share is split off and read once (``cascade``, merged by lse), and the kernel table is walked for
a kernel that reads the pools in place (``choose_paged``: the rows whose ``takes`` has ``paged``, engine.kernels
.paged_rows: ``native in place`` for a decode step, ``flex`` forced or on CUDA); where none does, a mixed step reads
its decodes in place as one call beside each other sequence's own (``mixed``), and otherwise the readable twin runs
(``per sequence``: each sequence's keys gathered, or a run of pages at a time, and its own call planned here,
engine.paged.sequences). A plan owns what it decided: the tables and positions are copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from engine.kernels.common import MAX_DECODE_QUERIES, DoesNotFit, needs_grad
from engine.kernels.dispatch import KERNELS, KernelChoice, check_kernel_name, untaken
from engine.kernels.sinks import apply_sinks
from engine.paged.cascade import merge_prefix, plan_prefix, prefix_part, shared_prefixes, suffix_tables
from engine.paged.explain import describe
from engine.paged.inputs import PagedInputs, paged_inputs, select
from engine.paged.sequences import SequencePlans, plan_sequences
from engine.planning import Signature, TensorSignature, placeholder, signature_of

__all__ = ["PagedPlan", "plan_paged"]

GATHERED = "gathered"  # a paged call's readable twin: each sequence's keys gathered, its own call planned


def choose_paged(inputs, kernel: str = "auto") -> KernelChoice:
    """The kernel that reads a paged call (engine.paged.inputs.PagedInputs) in place, why, and why not the other
    kernels that take paged calls; ``GATHERED`` where none does (each sequence's own call then walks this table as
    any call, with ``kernel``). A forced kernel reads the call in place where it fits, else runs per sequence."""
    passed_over: dict[str, str] = {}
    names = [name for name, row in KERNELS.items() if row.paged is not None]
    if kernel != "auto":
        check_kernel_name(kernel)
        if kernel not in names:
            why = f"kernel={kernel!r} forced: it reads gathered keys, so each sequence's call runs it"
            return KernelChoice(GATHERED, why, {name: f"kernel={kernel!r} forced" for name in names})
        names = [kernel]
    for name in names:
        row = KERNELS[name]
        why_not = untaken(row, inputs) or row.paged.fits(inputs) or (None if kernel != "auto" else
                                                                       row.paged.pays_off(inputs))
        if why_not is None:
            reason = row.paged.why if kernel == "auto" else f"{row.paged.why} (forced by kernel={kernel!r})"
            return KernelChoice(name, reason, passed_over)
        passed_over[name] = why_not
    reason = "no kernel reads these pools in place: each sequence's keys gathered (a run of pages at a time past " \
             "RUN_KEYS), its own call planned" + ("" if kernel == "auto" else f" with kernel={kernel!r}")
    return KernelChoice(GATHERED, reason, passed_over)


PATHS = ("flex", "cascade", "native in place", "mixed", "per sequence")
IN_PLACE = {"decode_native": "native in place", "flex": "flex"}  # the path of each kernel that reads pools in place


@dataclass(frozen=True)
class PagedPlan:
    """A paged step with its kernel chosen: ``run(q, k_pages, v_pages)`` for tensors of the planned signature.

    call: the validated call (engine.paged.inputs.PagedInputs: the tables, positions int64 ``[Nq]``, window and
    modifiers; q and the pools as meta placeholders, so a plan keeps no tensor of the call alive; its fields read as
    the plan's: ``plan.tables``, ``plan.positions``, ...); choice: the kernel that reads the pools in place and why
    (``GATHERED``: none; each sequence's own planned call, ``sequences``); path: one of PATHS; in_place: that
    kernel's prepared run; prefixes: the shared prefixes' passes and suffix: the plan of the suffixes' call (path
    ``cascade``); kernel: the kernel asked for (``"auto"`` or a name)."""

    signature: Signature
    call: PagedInputs
    query_indptr: torch.Tensor
    kernel: str
    path: str
    choice: KernelChoice
    in_place: object = None
    sequences: SequencePlans | None = None
    prefixes: tuple = ()
    suffix: PagedPlan | None = None
    decodes: tuple = ()  # path mixed: (rows [n] int64, sequences) read in place by ``in_place``
    fallback: dict = field(default_factory=dict, compare=False, repr=False)  # the readable twin, planned if needed

    def __getattr__(self, name: str):  # the call's fields: tables, positions, window, softcap, scale, sinks, ...
        if name in PagedInputs.__dataclass_fields__ and name not in ("q", "k_pages", "v_pages"):
            return getattr(self.call, name)
        raise AttributeError(f"'PagedPlan' object has no attribute {name!r}")

    @property
    def reason(self) -> str:
        return self.choice.reason

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
        return given == self.signature and needs_grad(q, k_pages, v_pages) == self.call.grad

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
        state = "need" if self.call.grad else "do not need"
        raise ValueError(f"this paged plan was made for tensors that {state} gradients, got the other kind: plan "
                         f"the step under the same grad mode")

    def _attend(self, q, k_pages, v_pages, return_lse: bool):
        """``(out, lse)`` on the planned path; an in-place run that finds it cannot be exact (NaN/inf in q, other
        strides) falls back to the readable twin, which keeps NaN to its rows."""
        if self.in_place is not None and self.path != "mixed":
            result = self.in_place.run(q, k_pages, v_pages, return_lse)
            if result is not None:
                return result  # (sinks applied)
        if self.path == "cascade":
            out, lse = self.suffix.run(q, k_pages, v_pages, return_lse=True)
            parts = [prefix_part(p, q, k_pages, v_pages, self.fallback, lambda: self._inputs(q, k_pages, v_pages),
                                 self.kernel) for p in self.prefixes]
            out, lse = merge_prefix(out, lse, parts)
        else:
            out, lse = self._sequences(q, k_pages, v_pages).run(q, k_pages, v_pages)
            if self.path == "mixed":
                self._read_decodes(out, lse, q, k_pages, v_pages)
        if self.call.sinks is not None:  # once per row, after every part ([Nq, Hq, 1, ..] as [B, Hq, T, ..])
            out, lse = (x[:, :, 0] for x in apply_sinks(out[:, :, None], lse[:, :, None], self.call.sinks))
        return out, lse

    def _sequences(self, q, k_pages, v_pages) -> SequencePlans:
        """The readable twin's plans: made when planning on its path, at the first fallback on the others."""
        if self.sequences is not None:
            return self.sequences
        if "sequences" not in self.fallback:
            self.fallback["sequences"] = plan_sequences(self._inputs(q, k_pages, v_pages), self._twin_kernel())
        return self.fallback["sequences"]

    def _read_decodes(self, out, lse, q, k_pages, v_pages) -> None:
        """A mixed step's decodes into their rows of ``out`` and ``lse``: in place, or (NaN/inf in q) each one's own
        call, planned at the first such run."""
        rows, members = self.decodes
        result = self.in_place.run(q[rows], k_pages, v_pages, True)
        if result is None:
            if "decodes" not in self.fallback:
                self.fallback["decodes"] = plan_sequences(self._inputs(q, k_pages, v_pages), self._twin_kernel(),
                                                          only=members)
            result = (x[rows] for x in self.fallback["decodes"].run(q, k_pages, v_pages))
        part_out, part_lse = result
        out[rows], lse[rows] = part_out.to(out.dtype), part_lse.to(lse.dtype)

    def _twin_kernel(self) -> str:
        """The kernel each sequence's call is planned with: the one asked for, unless it is the in-place reader that
        just found it cannot be exact (then auto: the call walks the table as any call)."""
        return self.kernel if self.kernel not in IN_PLACE or self.in_place is None else "auto"

    def _inputs(self, q, k_pages, v_pages) -> PagedInputs:
        return replace(self.call, q=q, k_pages=k_pages, v_pages=v_pages)

    def __str__(self) -> str:
        return describe(self)


def plan_paged(q: torch.Tensor, k_pages, v_pages, page_table: torch.Tensor, kv_lens: torch.Tensor,
               query_indptr: torch.Tensor, query_positions: torch.Tensor | None = None, *, window: int | None = None,
               softcap: float | None = None, scale: float | None = None, sinks: torch.Tensor | None = None,
               alibi_slopes: torch.Tensor | None = None, allowed: torch.Tensor | None = None, score_mod=None,
               kernel: str = "auto", cascade: bool | None = None, key_indices: torch.Tensor | None = None) -> PagedPlan:
    """Validate a paged step and choose its kernel once (``paged_attention``'s arguments; q and the pools are read
    for their shapes, dtypes, strides and device, not their values). ``paged_attention(...)`` is
    ``plan_paged(...).run(q, k_pages, v_pages)``."""
    if cascade is not None and not isinstance(cascade, bool):
        raise ValueError(f"cascade must be True, False or None (auto), got {cascade!r}")
    inputs = paged_inputs(q, k_pages, v_pages, page_table, kv_lens, query_indptr, query_positions, window=window,
                          softcap=softcap, scale=scale, sinks=sinks, alibi_slopes=alibi_slopes, allowed=allowed,
                          score_mod=score_mod, key_indices=key_indices)
    return _plan(inputs, query_indptr, kernel, cascade)


def _plan(inputs: PagedInputs, query_indptr: torch.Tensor, kernel: str, cascade: bool | None) -> PagedPlan:
    i = inputs
    signature = Signature(*(TensorSignature(*part) for part in signature_of(i.q, i.k_pages, i.v_pages)))
    call = replace(i, **{name: placeholder(getattr(i, name)) for name in ("q", "k_pages", "v_pages")})
    common = dict(signature=signature, call=call, query_indptr=query_indptr, kernel=kernel)
    per_row = i.allowed is not None or i.score_mod is not None or i.key_indices is not None
    if cascade and per_row:
        raise ValueError("cascade=True with allowed, score_mod or key_indices: a shared prefix is read once for the "
                         "queries of several sequences; pass cascade=None or False with them")
    no_cascade = cascade is False or per_row
    groups = [] if no_cascade else shared_prefixes(i.tables, min_keys=1 if cascade else None)
    if groups:  # the shared prefixes once, then one paged call on the suffixes (planned here too)
        table, lens, shifted = suffix_tables(i.tables, groups, i.positions)
        suffix = plan_paged(i.q, i.k_pages, i.v_pages, table, lens, query_indptr, shifted, window=i.window,
                            softcap=i.softcap, scale=i.scale, alibi_slopes=i.alibi_slopes, kernel=kernel,
                            cascade=False)
        prefixes = tuple(plan_prefix(i, members, pages, kernel) for members, pages in groups)
        choice = KernelChoice("cascade", "shared prefixes read once for every sequence that holds them")
        return PagedPlan(**common, path="cascade", choice=choice, prefixes=prefixes, suffix=suffix)
    choice = choose_paged(i, kernel)
    if choice.kernel != GATHERED:
        try:
            return PagedPlan(**common, path=IN_PLACE[choice.kernel], choice=choice,
                             in_place=KERNELS[choice.kernel].paged.prepare(i))
        except DoesNotFit as error:  # found while preparing (the library cannot be built, a dtype it cannot read)
            choice = KernelChoice(GATHERED, f"not {choice.kernel} in place: {error}", choice.passed_over)
    return _plan_mixed(i, common, choice, kernel) or PagedPlan(**common, path="per sequence", choice=choice,
                                                               sequences=plan_sequences(i, kernel))


def _plan_mixed(inputs: PagedInputs, common: dict, choice: KernelChoice, kernel: str) -> PagedPlan | None:
    """A mixed step (decodes beside prefills or chunks): the largest group of sequences with the same 1..16 new
    queries read in place as one call where a kernel reads it so, every other sequence its own planned call; None
    where there is no such split."""
    tables, by_count = inputs.tables, {}
    for b in range(tables.batch):
        count = tables.starts[b + 1] - tables.starts[b]
        if count:
            by_count.setdefault(count, []).append(b)
    members = max((group for count, group in by_count.items() if count <= MAX_DECODE_QUERIES), key=len, default=[])
    rest = [b for count, group in by_count.items() for b in group if b not in members]
    if not members or not rest:
        return None
    rows, decodes = select(inputs, members)
    found = choose_paged(decodes, kernel)
    if found.kernel == GATHERED:
        return None
    try:
        in_place = KERNELS[found.kernel].paged.prepare(decodes)
    except DoesNotFit:
        return None
    count = tables.starts[members[0] + 1] - tables.starts[members[0]]
    reason = (f"a mixed step: the {len(members)} sequences of {count} new queries read in place as one call "
              f"({found.reason}), each other sequence its own planned call")
    return PagedPlan(**common, path="mixed", choice=KernelChoice(found.kernel, reason, choice.passed_over),
                     in_place=in_place, sequences=plan_sequences(inputs, kernel, only=rest), decodes=(rows, members))
