"""The native decode kernel's row for paged calls: a decode step read in place through the page table (no copy).

It serves the decode step of a batch: every sequence with the same number of new queries ``T <= 16`` (one, for
plain decoding; with key_indices any number, each query row its own list: engine.kernels.decode.native_paged_listed),
on the CPU, pages in fp32 / bf16 / fp16 or int8 / fp8 with per-token scales (dequantised in registers), without
gradients (a softcap and ALiBi are added to the scores in C++: native_scores; sinks act on its out and lse
afterwards, engine.paged.attention); a call's ``allowed`` joins each row's visibility.
The kernel reads key j of sequence b from slot ``j % page_size`` of page ``page_table[b, j // page_size]``, stops at
the sequence's own length, and takes each query row's visibility from positions (and the window) unless every
key up to that length is visible (one query per sequence at its default position, no window)::

    q [Nq = B*T, Hq, D] -> rows [B, Hkv, G*T, D]     (row g*T + i: query i of head h*G + g)
    out [B, Hkv, G*T, Dv] -> [Nq, Hq, Dv],  lse likewise
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.kernels.common import DoesNotFit, fold_groups, unfold_groups
from engine.kernels.decode.decode_native import IO_KINDS, MAX_QUERIES, NON_FINITE_Q, paged_run, paged_template
from engine.kernels.decode.native_build import load_native, native_unavailable
from engine.kernels.decode.native_listed import data_of
from engine.kernels.decode.native_paged_listed import listed_layout, per_head_lists
from engine.kernels.decode.native_scores import MAX_POSITION, ScoreOps
from engine.masks.window import sees

if TYPE_CHECKING:
    from engine.paged.inputs import PagedInputs

__all__ = ["NativeStep", "native_paged_fits", "native_pass_fits"]


def native_paged_fits(inputs: PagedInputs) -> str | None:
    """Why the native kernel cannot read this paged decode step in place (None: it can). Builds nothing. Options it
    does not compute (a bias, score_mod) are the kernel table's business (``Kernel.takes``)."""
    why_not = native_pass_fits(inputs)
    if why_not is not None:
        return why_not
    if inputs.alibi_slopes is not None:
        if inputs.key_indices is not None:
            return "ALiBi with key_indices: the listed keys' positions are not read in place"
        largest = max([abs(int(x)) for x in (inputs.positions.min(), inputs.positions.max())] + inputs.tables.kv_lens) \
            if inputs.positions.numel() else 0
        if largest >= MAX_POSITION:
            return f"ALiBi at position {largest}: the native kernel's fp32 distances are exact below 2^24"
    if inputs.key_indices is not None:  # every query row its own sequence of its listed keys (native_paged_listed)
        return listed_layout(inputs.k_pages, inputs.v_pages, per_head_lists(inputs))[0]
    counts = inputs.queries_per_sequence()
    if len(counts) != 1 or not 1 <= next(iter(counts)) <= MAX_QUERIES:
        return f"sequences with {sorted(counts)} queries: the native kernel takes the same 1..{MAX_QUERIES} for all"
    return None


def native_pass_fits(inputs: PagedInputs) -> str | None:
    """Why the native kernel cannot read this call's pools in place as one pass over one sequence's keys (a shared
    prefix's pass, engine.paged.cascade: any number of queries); None: it can."""
    why_not = native_unavailable()
    if why_not is not None:
        return why_not
    q = inputs.q
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"the native kernel takes fp32 / bf16 / fp16 queries on the CPU, got {q.dtype} on {q.device}"
    if inputs.grad:
        return "gradients are needed: the native kernel has no backward"
    if any(x.stride(-1) != 1 and x.shape[-1] > 1 for x in (data_of(inputs.k_pages), data_of(inputs.v_pages))):
        return "a pool whose last axis is strided: the native kernel reads each row as contiguous memory"
    if data_of(inputs.k_pages).dtype != data_of(inputs.v_pages).dtype:
        return (f"page dtypes {data_of(inputs.k_pages).dtype}, {data_of(inputs.v_pages).dtype}: not read in place by "
                f"the native kernel")
    return None


class NativeStep:
    """A decode step on the native kernel, prepared once from a paged call's inputs (engine.paged.plan): the page
    table and key lengths as the kernel reads them, each row's visibility (or none), and the kernel's call with
    everything but the tensors' addresses; ``run(q, k_pages, v_pages)`` per layer reads nothing back to the host.
    Raises DoesNotFit where the library cannot be built or does not read the pools' dtype."""

    def __init__(self, inputs: PagedInputs) -> None:
        library = load_native()
        if isinstance(library, str):
            raise DoesNotFit(library)
        tables, window = inputs.tables, inputs.window
        nq, q_heads, d = inputs.q.shape
        batch, t = tables.batch, tables.starts[1] - tables.starts[0]
        kv_heads, dv = inputs.k_pages.shape[2], inputs.v_pages.shape[3]
        group = q_heads // kv_heads
        self.library, self.shape, self.dv = library, (batch, t, kv_heads, group, d), dv
        self.pages = tables.readable_table.contiguous()  # [B, max_pages] int64: each sequence's own entries read
        self.lengths = torch.tensor(tables.kv_lens, dtype=torch.long)  # [B]
        per_row = inputs.positions.view(batch, t).cpu()  # [B, T]
        self.visible = None  # every query at or after its sequence's last key, the window covering all: no mask
        allowed = None if inputs.allowed is None else inputs.allowed.cpu().view(batch, t, -1)  # [B, T, S]
        if allowed is not None or not (bool((per_row >= self.lengths[:, None] - 1).all())
                                       and (window is None or bool((per_row < window).all()))):
            self.visible = _row_visibility(per_row, self.lengths, window, group, allowed)  # [B, 1, G*T, S]
        rows = (batch, kv_heads, group * t, d)
        # a decode step (T = 1): q [Nq = B, Hq, D] holds fold_groups' rows in their order, so its fold is a reshape to
        # the shape read here, once, off fold_groups (as the contiguous plan reads its shapes), and the output is
        # allocated as [Nq, Hq, Dv], the same bytes as the kernel's [B, Hkv, G, Dv]: the general path's views and
        # calls took 1-4 us each, 8 us of a 48 us call in SmolLM2-135M's shape (B 8, S 16, pages of 16)
        self.folded = tuple(fold_groups(torch.empty(batch, q_heads, 1, d, device="meta"), kv_heads).shape) \
            if t == 1 else None
        self.template = paged_template(data_of(inputs.k_pages).dtype, rows, dv, inputs.scale, self.pages, self.lengths,
                                       tables.page_size, self.visible)
        # the softcap; ALiBi: each query's position and key j's, j (the slopes, the caller's, read at each run)
        scores = ScoreOps.paged(inputs.softcap, inputs.alibi_slopes, per_row, int(self.lengths.max()))
        scores.fill(self.template)
        self.scores = scores if scores.per_run else None

    def run(self, q: torch.Tensor, k_pages, v_pages, return_lse: bool = True):
        """``(out [Nq, Hq, Dv] in q's dtype, lse [Nq, Hq] fp32; None without return_lse)``, or None when q holds
        NaN/inf (the kernel found it as it scaled q; the gathered path keeps it to its rows) or these pools' last axis
        is strided (the plan was made for other strides: the gathered path reads any)."""
        batch, t, kv_heads, group, d = self.shape
        kd, vd = data_of(k_pages), data_of(v_pages)
        if (kd.stride(-1) != 1 and kd.shape[-1] > 1) or (vd.stride(-1) != 1 and vd.shape[-1] > 1):
            return None  # a layer's pools with a strided last axis: the kernel reads rows as contiguous memory
        io, heads = (q.dtype if q.dtype in IO_KINDS else torch.float32), q.shape[1]  # (q and out: fp32 or bf16)
        q_io = q if q.dtype == io else q.float()
        if self.folded is not None:  # (T = 1)
            q_rows = q_io.reshape(self.folded)  # [B, Hkv, G, D]
            out = torch.empty(batch, heads, self.dv, dtype=io)  # [Nq, Hq, Dv]: the kernel's [B, Hkv, G, Dv], whole
            lse = torch.empty(batch, heads) if return_lse else None  # [Nq, Hq] (None: not written)
        else:
            q_rows = fold_groups(q_io.view(batch, t, -1, d).transpose(1, 2), kv_heads)  # [B, Hkv, G*T, D]
            out = torch.empty(batch, kv_heads, group * t, self.dv, dtype=io)  # [B, Hkv, G*T, Dv], written whole
            lse = torch.empty(batch, kv_heads, group * t) if return_lse else None  # [B, Hkv, G*T]
        if q_rows.stride(-1) != 1 and d > 1:
            q_rows = q_rows.contiguous()
        if paged_run(self.library, self.template, q_rows, k_pages, v_pages, out, lse, self.scores) == NON_FINITE_Q:
            return None
        if self.folded is None:
            out = unfold_groups(out, heads).transpose(1, 2).reshape(batch * t, heads, self.dv)  # [Nq, Hq, Dv]
            if lse is not None:
                lse = unfold_groups(lse, heads).transpose(1, 2).reshape(batch * t, heads)  # [Nq, Hq]
        return (out if io == q.dtype else out.to(q.dtype)), lse


def _row_visibility(positions: torch.Tensor, lengths: torch.Tensor, window: int | None, group: int,
                    allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Bool ``[B, 1, G*T, S]``: key j visible to query i of sequence b iff ``j <= pos[b, i]``, ``j < length[b]``,
    (with a window) ``pos[b, i] - j < window`` and (with a mask) ``allowed[b, i, j]``; rows g*T + i repeat query i
    for each head of the group."""
    longest = int(lengths.max())
    keys = torch.arange(longest)  # [S]
    visible = sees(positions[:, :, None], keys, window) & (keys < lengths[:, None, None])  # [B, T, S]
    if allowed is not None:
        visible &= allowed[:, :, :longest]
    batch, t, s = visible.shape
    return visible[:, None].expand(batch, group, t, s).reshape(batch, 1, group * t, s)
