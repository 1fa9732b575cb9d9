"""decode_native on a paged call with ``key_indices``: each query row reads only its listed keys, in place in the pools
(DeepSeek V3.2's sparse decode against a paged cache costs its K keys, not its sequence's S).

The contiguous call's way (engine.kernels.decode.native_listed) through the page table: key j of sequence b lives in
slot ``j % page_size`` of page ``page_table[b, j // page_size]``, so a pool whose pages hold their slots back to back
is a buffer of one-key pages, and each query row's listed keys become its own sequence of them::

    pool [num_pages, page_size, Hkv, E], strides (page_size * ss, ss, sh, 1)
    one list for every head ([Nq, 1, K]):   sequence n: one-key pages  g = page_table[b, j // ps] * ps + j % ps,
                                            a pool of Hkv heads sh apart        (rows: all Hq query heads of row n)
    a list per KV head ([Nq, Hkv, K]):      sequence (n, h): pages g * Hkv + h of a pool of one head (ss = Hkv * sh)
                                                                                (rows: the G query heads of head h)

A listed key its row cannot see (the position rule, the window, the call's ``allowed``) is dropped when the plan is
made; each list is sorted and keeps each key once (``decode_native_listed_tables``, in C++). Pools of any other
layout (a slot stride that is not the pages' whole, the heads not packed in a slot for per-head lists) are read by
the readable twin (engine.paged.sequences), as are pools whose strides differ from the plan's at a run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.kernels.common import DoesNotFit
from engine.kernels.decode.decode_native import NON_FINITE_Q, paged_run, paged_template
from engine.kernels.decode.native_build import load_native
from engine.kernels.decode.native_listed import PARALLEL_ENTRIES
from engine.masks.window import sees
from engine.quantized import QuantizedKV

if TYPE_CHECKING:
    from engine.paged.inputs import PagedInputs

__all__ = ["ListedStep", "listed_layout"]


def _parts(pool) -> list:
    return [pool.data, pool.scale] if isinstance(pool, QuantizedKV) else [pool]


def listed_layout(k_pages, v_pages, page_size: int, per_head: bool) -> str | None:
    """Why the pools cannot be read as one-key pages (see the module's table), or None: every part of both (data,
    and scales in their own units) holds a page's slots back to back, and for per-head lists a slot's heads too."""
    for t in _parts(k_pages) + _parts(v_pages):
        slot, head = _slot(t), t.stride(2)
        if t.shape[0] > 1 and t.stride(0) != page_size * slot:
            return f"a pool's page stride {t.stride(0)} is not page_size x its slot stride {slot}"
        if per_head and slot != t.shape[2] * head:
            return f"lists per KV head need a slot's heads back to back (slot stride {slot}, head stride {head})"
    return None


def _slot(t) -> int:
    """The stride of one slot of a pool part ``[num_pages, page_size, Hkv, ..]`` (a page's, for pages of one slot:
    a size-1 axis's stride says nothing)."""
    return t.stride(1) if t.shape[1] > 1 else t.stride(0)


def _one_key_pages(pool, count: int, heads: int, per_head: bool):
    """``pool`` seen as ``count`` pages of one key: ``[count, 1, heads, E]`` (scales ``[count, 1, heads]``)."""
    def view(t, width):
        row = t.stride(2) if per_head else _slot(t)
        size = (count, 1, heads) + ((width,) if width else ())
        return t.as_strided(size, (row, row, t.stride(2)) + ((1,) if width else ()), t.storage_offset())
    if isinstance(pool, QuantizedKV):
        return QuantizedKV(view(pool.data, pool.data.shape[3]), view(pool.scale, 0))
    return view(pool, pool.shape[3])


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
        self.per_head = lists > 1 and kv_heads > 1
        why_not = listed_layout(inputs.k_pages, inputs.v_pages, size, self.per_head)
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
        local, self.lengths = torch.empty_like(idx), torch.empty(idx.shape[0], dtype=torch.int64)
        threads = torch.get_num_threads() if idx.numel() >= PARALLEL_ENTRIES else 1
        base = torch.zeros(idx.shape[0], dtype=torch.int64)  # (held: the call reads it)
        library.listed_tables(idx.data_ptr(), 0, vis.data_ptr(), idx.shape[0], idx.shape[1], longest, base.data_ptr(),
                              local.data_ptr(), self.lengths.data_ptr(), threads, 0, 0, 0, 0, idx.shape[0] or 1, 1)
        table = tables.readable_table.cpu()
        if table.shape[1] == 0:  # no sequence has a page: every list is empty (page 0 is never read)
            table = torch.zeros(tables.batch, 1, dtype=torch.int64)
        rows_seq = seq.repeat_interleave(lists)  # [Nq * L]: each sequence's batch row
        slot = table[rows_seq[:, None], local // size] * size + local % size  # [Nq * L, K]
        if self.per_head:
            slot = slot * kv_heads + torch.arange(lists).repeat(nq)[:, None]
        self.pages = slot.contiguous()
        self.count = inputs.k_pages.shape[0] * size * (kv_heads if self.per_head else 1)
        self.template = paged_template(_data(inputs.k_pages).dtype, (idx.shape[0], self.heads, self.group, d), dv,
                                       inputs.scale, self.pages, self.lengths, 1, None)

    def run(self, q: torch.Tensor, k_pages, v_pages, return_lse: bool = True):
        """``(out [Nq, Hq, Dv] in q's dtype, lse [Nq, Hq] fp32)``, or None (see the class)."""
        size = k_pages.shape[1] if not isinstance(k_pages, QuantizedKV) else k_pages.data.shape[1]
        if listed_layout(k_pages, v_pages, size, self.per_head) is not None:
            return None  # a layer's pools of another layout: the readable twin reads them
        nq, q_heads, d = q.shape
        rows = (q if q.dtype == torch.float32 else q.float()).reshape(-1, self.heads, self.group, d)
        out = torch.empty(rows.shape[0], self.heads, self.group, self.dv)  # fp32, written whole
        lse = torch.empty(rows.shape[0], self.heads, self.group)
        pools = (_one_key_pages(x, self.count, self.heads, self.per_head) for x in (k_pages, v_pages))
        if paged_run(self.library, self.template, rows, *pools, out, lse) == NON_FINITE_Q:
            return None
        out, lse = out.view(nq, q_heads, self.dv), lse.view(nq, q_heads)
        return (out if q.dtype == torch.float32 else out.to(q.dtype)), lse


def _data(pool):
    return pool.data if isinstance(pool, QuantizedKV) else pool
