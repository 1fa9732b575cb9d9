"""decode_native on a call with ``key_indices``: only each query's listed keys read, in place (a decode step of
DeepSeek V3.2's sparse attention costs its K keys, not the S the cache holds; a prefill its T x K, not T x S).

The native kernel already reads keys through a page table (engine.kernels.decode.native_paged). A list of keys is a
page table with pages of one key: each (batch row, list head, query) becomes a sequence of its listed keys, sorted
and without repeats, each one "page" of the cache's own buffer seen with a row stride::

    k [B, Hkv, S, D], strides (sb, sh, ss, 1)     key j of row b, head h  =  page  b*sb/ss + h*sh/ss + j
    one list for every head ([B, 1, T, K]):      sequence (b, t): pages b*sb/ss + j, the pool's Hkv heads sh apart
    a list per KV head ([B, Hkv, T, K]):         sequence (b, h, t): pages b*sb/ss + h*sh/ss + j, a pool of 1 head
    rows: the query heads of those KV heads at query t      (out, lse folded back to [B, Hq, T, Dv] / [B, Hq, T])

The position rule and any other part of the mask (one shared by every head) are read on the listed keys when the
plan is made; a listed key a query cannot see is dropped from its sequence. The table is built in C++
(``decode_native_listed_tables``: a bitmap of S bits per thread, O(K + S/64) a sequence, no sort). Every query is its
own sequence, so any T is served. Where the layout has no such row stride (the batch or head stride not a multiple of
the row stride, V's or the scales' not in step with K's) or another mask differs per head, ``listed_fits`` says why
and the dense native path (T <= 16) or the sparse kernel reads the call.
"""

from __future__ import annotations

import torch

from engine.inputs import AttentionInputs
from engine.kernels.common import DoesNotFit
from engine.kernels.decode.native_library import NON_FINITE_Q, NativeLibrary
from engine.masks.key_indices import split_listed
from engine.quantized import QuantizedKV

__all__ = ["build_tables", "data_of", "listed_fits", "listed_runner", "one_key_pages", "parts_of"]

PARALLEL_ENTRIES = 1 << 20  # listed entries from which the table is built on every thread (0.1 ms a 32k on one)


def data_of(x):
    """The entries of K/V or a pool (a QuantizedKV's int8 / fp8 data)."""
    return x.data if isinstance(x, QuantizedKV) else x


def parts_of(x) -> list:
    """The tensors K/V or a pool is read from: its data, and a QuantizedKV's scales."""
    return [x.data, x.scale] if isinstance(x, QuantizedKV) else [x]


def _strides(x) -> tuple | None:
    """``(batch, head) strides in rows`` of K/V data ``[B, Hkv, S, E]`` (and a quantized one's scales), or None."""
    found = set()
    for t in parts_of(x):
        row = t.stride(2)
        if row <= 0 or t.stride(0) % row or t.stride(1) % row:
            return None
        found.add((t.stride(0) // row, t.stride(1) // row))
    return found.pop() if len(found) == 1 else None


def one_key_pages(x, count: int, heads: int, strides_of):
    """``x`` (K/V or a pool) seen as ``count`` pages of one key of ``heads`` heads, ``[count, 1, heads, E]`` (scales
    ``[count, 1, heads]``): ``strides_of(part)`` gives each part's ``(row, head)`` strides in its own elements."""
    def view(t, width):
        row, head = strides_of(t)
        size = (count, 1, heads) + ((width,) if width else ())
        return t.as_strided(size, (row, row, head) + ((1,) if width else ()), t.storage_offset())
    if isinstance(x, QuantizedKV):
        return QuantizedKV(view(x.data, x.data.shape[3]), view(x.scale, 0))
    return view(x, x.shape[3])


def build_tables(library, idx: torch.Tensor, rows: int, top: int, keys: int, *, idx_b: int = 0, visible=None,
                 base=None, positions=None, queries: int = 1, lists: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pages int64 [rows, top], lengths int64 [rows])`` from ``decode_native_listed_tables`` (its contract in
    decode_native.cpp): rows ``(b, l, t)`` of ``lists`` x ``queries``, the lists ``idx`` (int64, contiguous, batch
    rows ``idx_b`` apart) over ``keys`` keys, ``visible`` uint8 ``[rows, top]`` or None, ``base`` int64 ``[rows]``
    or None (0), and ``positions`` ``((key_pos, kp_b), (query_pos, qp_b))`` or None (no position rule)."""
    pages, lengths = torch.empty(rows, top, dtype=torch.int64), torch.empty(rows, dtype=torch.int64)
    (key_pos, kp_b), (query_pos, qp_b) = positions or ((None, 0), (None, 0))
    threads = torch.get_num_threads() if rows * top >= PARALLEL_ENTRIES else 1  # (waking a thread costs more)

    def address(x):
        return 0 if x is None else x.data_ptr()
    library.listed_tables(idx.data_ptr(), idx_b, address(visible), rows, top, keys, address(base), pages.data_ptr(),
                          lengths.data_ptr(), threads, address(key_pos), kp_b, address(query_pos), qp_b, queries,
                          lists)
    return pages, lengths


def listed_fits(inputs: AttentionInputs) -> str | None:
    """Why the listed path cannot read this call's key_indices in place (None: it can, for any T)."""
    listed, others = split_listed(inputs.allowed)
    if listed is None:
        return "no key_indices"
    if any(len(part.shape) >= 3 and part.shape[-3] != 1 for part in others):  # (broadcast to [B, Hq, T, S])
        return "key_indices with another mask that differs per head"
    steps = _strides(inputs.k)
    if steps is None or _strides(inputs.v) != steps:
        return "K/V rows without one row stride in step with each other (batch/head strides in whole rows)"
    return None


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(x's rows contiguous, the stride between batch rows)``: one row, stride 0, where x is broadcast over the
    batch (the C++ table builder reads them so)."""
    one = x.shape[0] == 1 or x.stride(0) == 0
    rows = (x[:1] if one else x).long().contiguous()
    return rows, 0 if one else rows[0].numel()


def _tables(library, inputs: AttentionInputs, listed, others, steps: tuple[int, int]):
    """``(pages int64 [B*L*T, K], lengths int64 [B*L*T], (lowest, highest) id)``, L the list's heads (1 or Hkv):
    each sequence's visible listed keys as page ids, sorted, each once. The position rule is read in C++ on the listed
    keys' positions; another mask (one shared by every head) on the listed columns here."""
    batch, _, t, _ = inputs.q.shape
    s = inputs.k.shape[2]
    heads, top = listed.indices.shape[1], listed.indices.shape[3]
    idx, idx_b = _rows(listed.indices)  # [B|1, L, T, K]
    visible = None
    for part in others:  # one block per batch row, shared by every head ([1, T, S])
        dense = torch.stack([torch.broadcast_to(part.block(b if part.batched() else 0, 0, t, 0, s), (1, t, s))[0]
                             for b in range(batch)])
        seen = dense[:, None].expand(batch, heads, t, s).gather(3, idx.expand(batch, -1, -1, -1).clamp(min=0))
        visible = seen if visible is None else visible & seen
    visible = None if visible is None else visible.contiguous().view(torch.uint8)
    positions = (_rows(inputs.key_positions), _rows(inputs.query_positions)) if inputs.causal else None
    base = (torch.arange(batch)[:, None] * steps[0] + torch.arange(heads)[None, :] * steps[1])  # [B, L]
    base = base[..., None].expand(batch, heads, t).reshape(-1).contiguous()
    rows = batch * heads * t
    pages, lengths = build_tables(library, idx, rows, top, s, idx_b=idx_b, visible=visible, base=base,
                                  positions=positions, queries=t, lists=heads)
    bounds = (int(base.min()), int(base.max()) + s - 1) if rows else (0, -1)  # every id lies in base[r] + [0, S)
    return pages, lengths, bounds


def listed_runner(library: NativeLibrary, inputs: AttentionInputs, resume: str, template, paged_run):
    """``run(q, k, v, return_lse)`` reading only the listed keys, or None where ``listed_fits`` says it cannot.
    ``template`` / ``paged_run``: decode_native's paged call (engine.kernels.decode.decode_native)."""
    if listed_fits(inputs) is not None:
        return None
    listed, others = split_listed(inputs.allowed)
    steps = _strides(inputs.k)
    batch, q_heads, t, d = inputs.q.shape
    kv_heads, dv = inputs.k.shape[1], inputs.v.shape[3]
    lists = listed.indices.shape[1]  # 1 (every head reads the list: the pool's heads) or Hkv (a pool of one head)
    pool_heads, group = kv_heads // lists, q_heads // kv_heads
    pages, lengths, bounds = _tables(library, inputs, listed, others, steps)
    count = (batch - 1) * steps[0] + (lists - 1) * steps[1] + inputs.k.shape[2]  # ids up to the last key
    if not (0 <= bounds[0] and bounds[1] < count):  # (never: a guard on the layout)
        return None
    kind = data_of(inputs.k).dtype
    call = template(kind, (pages.shape[0], pool_heads, group, d), dv, inputs.scale, pages, lengths, 1, None,
                    inputs.softcap)
    shape = (batch, lists, pool_heads, group, t)

    def run(q, k, v, return_lse: bool, tables=(pages, lengths)):  # (the tables outlive every run: the call's)
        if _strides(k) != steps or _strides(v) != steps:
            raise DoesNotFit("K/V strides unlike the plan's: the dense path reads them", resume="sparse")
        rows = q.float().view(*shape, d).permute(0, 1, 4, 2, 3, 5).reshape(-1, pool_heads, group, d)
        out = torch.empty(rows.shape[0], pool_heads, group, dv)  # fp32, written whole
        lse = torch.empty(rows.shape[0], pool_heads, group)
        pools = (one_key_pages(x, count, pool_heads, lambda part: (part.stride(2), part.stride(2) * steps[1]))
                 for x in (k, v))
        if paged_run(library, call, rows, *pools, out, lse) == NON_FINITE_Q:
            raise DoesNotFit("NaN/inf in q: the torch kernels keep it to the rows it belongs to", resume=resume)
        out = out.view(batch, lists, t, pool_heads, group, dv).permute(0, 1, 3, 4, 2, 5).reshape(batch, q_heads, t, dv)
        lse = (lse.view(batch, lists, t, pool_heads, group).permute(0, 1, 3, 4, 2).reshape(batch, q_heads, t)
               if return_lse else None)
        return (out if q.dtype == torch.float32 else out.to(q.dtype)), lse

    return run
