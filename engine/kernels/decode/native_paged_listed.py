"""decode_native on a paged call with ``key_indices``: each query row reads only its listed keys, in place in the pools
(DeepSeek V3.2's sparse decode against a paged cache costs its K keys, not its sequence's S).

The contiguous call's way (engine.kernels.decode.native_listed) through the page table: key j of sequence b lives in
slot ``j % page_size`` of page ``page_table[b, j // page_size]``. Where every stride the ids use is a multiple of one
unit u (NHD pools and both of engine.paged.pool's layouts alike), the pool is a buffer of one-key rows u
apart, and each query row's listed keys become its own sequence of them::

    pool [num_pages, page_size, Hkv, E], strides (sp, ss, sh, 1) = u * (P, Q, H, 1/u)
    one list for every head ([Nq, 1, K]):   sequence n: row ids  page_table[b, j // ps] * P + (j % ps) * Q,
                                            a pool of Hkv heads sh apart        (rows: all Hq query heads of row n)
    a list per KV head ([Nq, Hkv, K]):      sequence (n, h): ids  ... + h * H, a pool of one head
                                                                                (rows: the G query heads of head h)

A listed key its row cannot see (the position rule, the window, the call's ``allowed``) is dropped when the plan is
made; each list is sorted and keeps each key once (``decode_native_listed_tables``, in C++). Pools whose parts (data,
int8 / fp8 scales, K and V) step differently are read by the readable twin (engine.paged.sequences), as are pools
whose layout differs from the plan's at a run.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from engine.kernels.common import DoesNotFit
from engine.kernels.decode.decode_native import IO_KINDS, NON_FINITE_Q, paged_run, paged_template
from engine.kernels.decode.native_build import load_native
from engine.kernels.decode.native_listed import build_tables, data_of, one_key_pages, parts_of
from engine.masks.window import sees

if TYPE_CHECKING:
    from engine.paged.inputs import PagedInputs

__all__ = ["ListedStep", "listed_layout", "per_head_lists"]


def _steps(t, per_head: bool) -> tuple[int, tuple[int, int, int]]:
    """``(unit, (page, slot, head) strides in units)`` of a pool part ``[num_pages, page_size, Hkv, ..]``: the unit
    divides every stride the ids use (an axis of size 1 is never stepped: its step is 0)."""
    used = [t.stride(a) if t.shape[a] > 1 and (a < 2 or per_head) else 0 for a in range(3)]
    unit = math.gcd(*used) or 1
    return unit, tuple(x // unit for x in used)


def listed_layout(k_pages, v_pages, per_head: bool) -> tuple[str | None, tuple]:
    """``(why the pools cannot be read as one-key pages or None, the (page, slot, head) steps in units)``: every
    part of both (data, and scales in their own unit) must step its pages, slots (and, for lists per KV head, heads)
    by the same multiples of one unit, so one id names the same key in each (NHD and engine.paged.pool's pools do)."""
    found = {_steps(t, per_head)[1] for t in parts_of(k_pages) + parts_of(v_pages)}
    if len(found) != 1:
        return f"pools whose parts step pages, slots and heads differently ({sorted(found)})", ()
    return None, found.pop()


def per_head_lists(inputs: PagedInputs) -> bool:
    """True when each KV head has its own list (each sequence then reads a pool of one head)."""
    return inputs.key_indices.shape[1] > 1 and inputs.k_pages.shape[2] > 1


class ListedStep:
    """A paged call with key_indices on the native kernel, prepared once (engine.paged.plan): each query row's
    visible listed keys as one-key page ids, the kernel's call; ``run(q, k_pages, v_pages)`` per layer, or None
    where only the readable twin is exact (NaN/inf in q, pools of another layout than planned)."""

    def __init__(self, inputs: PagedInputs) -> None:
        library = load_native()
        if isinstance(library, str):
            raise DoesNotFit(library)
        tables, listed = inputs.tables, inputs.key_indices.cpu()
        nq, q_heads, d = inputs.q.shape
        kv_heads, dv, size = inputs.k_pages.shape[2], inputs.v_pages.shape[3], tables.page_size
        lists = listed.shape[1]
        self.per_head = per_head_lists(inputs)
        why_not, self.steps = listed_layout(inputs.k_pages, inputs.v_pages, self.per_head)
        if why_not is not None:
            raise DoesNotFit(why_not)
        self.library, self.dv, self.lists = library, dv, lists
        self.heads = 1 if self.per_head else kv_heads  # each sequence's pool heads
        self.group = q_heads // (lists if self.per_head else 1) // self.heads
        seq = torch.repeat_interleave(torch.arange(tables.batch), torch.tensor(tables.starts).diff())  # [Nq]
        positions = inputs.positions.cpu()
        visible = (listed >= 0) & sees(positions[:, None, None], listed.clamp(min=0), inputs.window)
        if inputs.allowed is not None:  # [Nq, S]
            visible &= inputs.allowed.cpu().view(nq, 1, -1).expand(nq, lists, -1).gather(2, listed.clamp(min=0))
        longest = max(tables.kv_lens, default=0)
        idx = listed.reshape(nq * lists, listed.shape[2]).contiguous()
        vis = visible.reshape(idx.shape).contiguous().view(torch.uint8)
        local, self.lengths = build_tables(library, idx, idx.shape[0], idx.shape[1], longest, visible=vis,
                                           queries=max(idx.shape[0], 1))  # each list's kept keys, in its sequence
        table = tables.readable_table.cpu()
        if table.shape[1] == 0:  # no sequence has a page: every list is empty (page 0 is never read)
            table = torch.zeros(tables.batch, 1, dtype=torch.int64)
        rows_seq = seq.repeat_interleave(lists)  # [Nq * L]: each sequence's batch row
        page_step, slot_step, head_step = self.steps
        slot = table[rows_seq[:, None], local // size] * page_step + local % size * slot_step  # [Nq * L, K]
        if self.per_head:
            slot += torch.arange(lists).repeat(nq)[:, None] * head_step
        self.pages = torch.where(torch.arange(slot.shape[1]) < self.lengths[:, None], slot, 0).contiguous()
        self.count = (inputs.k_pages.shape[0] - 1) * page_step + (size - 1) * slot_step + \
            ((kv_heads - 1) * head_step if self.per_head else 0) + 1  # the highest id + 1
        self.template = paged_template(data_of(inputs.k_pages).dtype, (idx.shape[0], self.heads, self.group, d), dv,
                                       inputs.scale, self.pages, self.lengths, 1, None, inputs.softcap)

    def run(self, q: torch.Tensor, k_pages, v_pages, return_lse: bool = True):
        """``(out [Nq, Hq, Dv] in q's dtype, lse [Nq, Hq] fp32; None without return_lse)``, or None (see the
        class)."""
        if listed_layout(k_pages, v_pages, self.per_head) != (None, self.steps):
            return None  # a layer's pools of another layout: the readable twin reads them
        nq, q_heads, d = q.shape
        io = q.dtype if q.dtype in IO_KINDS else torch.float32  # (q and out: fp32 or bf16)
        rows = (q if q.dtype == io else q.float()).reshape(-1, self.heads, self.group, d)
        out = torch.empty(rows.shape[0], self.heads, self.group, self.dv, dtype=io)  # written whole
        lse = torch.empty(rows.shape[0], self.heads, self.group) if return_lse else None  # (None: not written)
        pools = (one_key_pages(x, self.count, self.heads, lambda part: (_steps(part, self.per_head)[0], part.stride(2)))
                 for x in (k_pages, v_pages))
        if paged_run(self.library, self.template, rows, *pools, out, lse) == NON_FINITE_Q:
            return None
        out, lse = out.view(nq, q_heads, self.dv), (None if lse is None else lse.view(nq, q_heads))
        return (out if io == q.dtype else out.to(q.dtype)), lse

