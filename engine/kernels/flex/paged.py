"""A paged batch on FlexAttention, K/V read in place from the pools (no gathered per-sequence copy).

The pools are one flat key axis (a view); the packed queries one row axis, each sequence's rows starting a query
block of their own. ``mask_mod`` maps a physical key index to (page, slot) and, through the inverse table
``logical_page`` (the page's index in the block's sequence, -1 where it owns nothing), to a key position; the
``BlockMask`` lists only key blocks holding a page the block's sequence may see (full ones without mask_mod)::

    storage [pages, P, Hkv, D] (NHD)    keys [1, Hkv, pages * P, D]          index k = page * P + slot
    storage [pages, Hkv, P, D] (HND)    keys [1, 1, pages * Hkv * P, D]      index k = (page * Hkv + head) * P + slot
    P = 2; sequence 0: 3 keys in pages [4, 1], 1 query at 2; sequence 1: 2 keys in page [4] (shared), 2 queries;
    query block Q = 2: rows [s0 q@2, pad | s1 q@0, s1 q@1], logical_page rows [-1 1 -1 -1 0], [-1 -1 -1 -1 0]
    mask_mod(row, k) = logical >= 0 & key < kv_len & key <= query_pos (& query_pos - key < window)
                       with logical = logical_page[row // Q, k // P], key = logical * P + k % P (HND: & head = h // G)

softcap is a ``score_mod`` (``c * tanh(s / c)`` of the scaled score), GQA Flex's ``enable_gqa``, sinks a step after
(engine.kernels.sinks on out and lse); no ALiBi, no gradients. Runs (torch 2.13) compiled on CPU (C++) in
fp32/bf16/fp16 without the lse; the lse (asked for, or for sinks) or fp64 takes Flex's unfused implementation, which
materialises ``[Hq, rows, the pool's keys]`` scores (refused past ``UNFUSED_MAX_SCORES``). CUDA: compiled (Triton),
NHD pools; not yet run on a GPU. Rows are padded to a power of two of query blocks: a serving loop meets few shapes.

NaN/inf in K/V: Flex multiplies whole key blocks (``0 * NaN``), so a bad value in a masked slot of a listed block
would leak. The K pool is checked up front (one read; a bad key can hide behind a -inf score), the output after;
only when either is non-finite are the pools copied with bad entries zeroed (engine.kernels.nonfinite: two
pool-sized copies) and the rows that see a bad owned entry poisoned, as the reference does.
Readable twin: the gathered path of engine.paged.attention (each sequence's slots gathered, then causal_attention).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.kernels.common import compute_dtype
from engine.kernels.flex.block_mask import BlockMask
from engine.kernels.flex.flex import AuxRequest, _flex_attention, _unfused, softcap_mod
from engine.kernels.nonfinite import all_finite, guard_non_finite
from engine.kernels.sinks import apply_sinks
from engine.masks.window import range_sees, sees

if TYPE_CHECKING:  # a type only: engine.paged imports this module
    from engine.paged.tables import PagedBatch

Q_BLOCK = {"cpu": 16, "cuda": 128}  # query rows per block, at most (CPU: fewer for a decode step, measured 3x)
KV_BLOCK = {"cpu": 16, "cuda": 128}  # keys per block (NHD): whole pages, at least this many (CUDA: a multiple)
UNFUSED_MAX_SCORES = 1 << 25  # Hq * rows * pool keys of Flex's unfused path (fp32: 128 MiB a copy)

__all__ = ["flex_paged_fits", "flex_paged_attention"]


class PoolView(NamedTuple):
    """The pools as Flex's key axis (views of the pools' memory)."""

    keys: torch.Tensor  # [1, Hkv, num_pages * P, D] (NHD) or [1, 1, num_pages * Hkv * P, D] (HND)
    values: torch.Tensor  # likewise with Dv
    heads_in_axis: bool  # HND: the key index carries the head


def pool_view(k_pages: torch.Tensor, v_pages: torch.Tensor) -> PoolView | None:
    """The pools as one key axis without a copy, or None when their strides allow neither view."""
    def flat(pages, head_major):  # [1, Hkv, pages * P, E] or [1, 1, pages * Hkv * P, E]; None: needs a copy
        n, p, h, e = pages.shape
        order, shape = ((0, 2, 1, 3), (1, 1, n * h * p, e)) if head_major else ((2, 0, 1, 3), (1, h, n * p, e))
        try:
            return pages.permute(order).view(shape) if pages.stride(3) == 1 or e == 1 else None
        except RuntimeError:  # the axes do not merge
            return None

    for head_major in (False, True):
        keys, values = flat(k_pages, head_major), flat(v_pages, head_major)
        if keys is not None and values is not None:
            return PoolView(keys, values, head_major and k_pages.shape[2] > 1)
    return None


def flex_paged_fits(q, k_pages, v_pages, tables: PagedBatch, softcap, alibi_slopes, sinks, needs_grad: bool, *,
                    return_lse: bool = True) -> str | None:
    """Why Flex cannot read this paged batch in place (None: it can). Builds nothing."""
    if _flex_attention is None or BlockMask is None:
        return f"this torch ({torch.__version__}) has no FlexAttention (torch >= 2.5)"
    if not all(isinstance(x, torch.Tensor) for x in (q, k_pages, v_pages)):
        return "pools that are not plain tensors (a quantized cache): Flex reads float pages"
    device = q.device.type
    if device not in Q_BLOCK:
        return f"Flex runs on CPU and CUDA; q is on {q.device}"
    if needs_grad or alibi_slopes is not None:
        return "gradients or ALiBi: the in-place Flex path is inference only (no CPU backward), without ALiBi"
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (q.shape[1],)):
        return "sinks not of shape [Hq]: the gathered path checks them"
    if q.shape[2] == 0 or v_pages.shape[3] == 0:
        return "D = 0 or Dv = 0: Flex needs non-empty head dims"
    view = pool_view(k_pages, v_pages)
    if view is None:
        return "pools whose strides make no flat key axis (NHD or HND storage, last axis contiguous): a copy"
    if device == "cuda" and (view.heads_in_axis or q.dtype == torch.float64 or min(q.shape[2], v_pages.shape[3]) < 16):
        return "CUDA takes NHD pools in fp16/bf16/fp32 with head dims >= 16"
    if any(len(set(owned)) < len(owned) for owned in ([p for p in pages if p >= 0] for pages in tables.pages)):
        return "a sequence lists one page twice: its slots would have two positions"
    unfused = device == "cpu" and (return_lse or sinks is not None or q.dtype == torch.float64)
    scores = q.shape[1] * _query_rows(tables, device)[3] * view.keys.shape[2]  # Hq x rows x pool keys
    if unfused and scores > UNFUSED_MAX_SCORES:
        return f"the lse on CPU takes Flex's unfused path: {scores} scores (Hq x rows x pool) > {UNFUSED_MAX_SCORES}"
    return None


def flex_paged_attention(q, k_pages, v_pages, tables: PagedBatch, positions: torch.Tensor, window: int | None,
                         softcap: float | None, scale: float | None, sinks: torch.Tensor | None, *,
                         return_lse: bool = True):
    """``(out [Nq, Hq, Dv] in q's dtype, lse [Nq, Hq] natural log in fp32 (fp64 for fp64 q), or None without
    return_lse and sinks)`` for a batch ``flex_paged_fits`` accepts; ``positions [Nq]`` int64 the queries' positions.
    A query that sees no key gives 0 and lse -inf. None when only the gathered path is exact: NaN/inf in q (it
    keeps them to their rows) or sums that overflow (values near the float max)."""
    want_lse = return_lse or sinks is not None
    result = _attend(q, k_pages, v_pages, tables, positions.to("cpu", torch.long), window, softcap, scale, want_lse)
    if result is None:
        return None
    out, lse = result
    if sinks is not None:  # [Nq, Hq, 1, Dv] and [Nq, Hq, 1] as apply_sinks' [B, Hq, T, Dv]
        out, lse = (x[:, :, 0] for x in apply_sinks(out[:, :, None], lse[:, :, None], sinks))
    return out, (lse if return_lse else None)


def _attend(q, k_pages, v_pages, tables: PagedBatch, positions, window, softcap, scale, want_lse: bool):
    """The Flex call with the NaN/inf semantics of engine.kernels.nonfinite (None: only the gathered path is exact)."""
    if not (q.shape[0] and k_pages.shape[0]):  # no query, or no page: nothing to see
        return q.new_zeros(*q.shape[:2], v_pages.shape[3]), torch.full(  # [Nq, Hq, Dv], [Nq, Hq]
            q.shape[:2], -math.inf, dtype=compute_dtype(q.dtype), device=q.device)
    plan = _plan(q, k_pages, v_pages, tables, positions, window)
    out = lse = None
    if all_finite(k_pages):  # then a finite output proves no bad value met a skipped or a visible slot
        out, lse = _run(q, k_pages, v_pages, plan, softcap, scale, want_lse)
    if out is not None and all_finite(out):
        return out, lse
    if not all_finite(q):
        return None
    guard = guard_non_finite(k_pages, v_pages)  # zeroed copies of the pools, and where the bad entries were
    if guard is None:  # finite inputs, a non-finite output: the sums overflowed
        return None
    out, lse = _run(q, guard.k, guard.v, plan, softcap, scale, want_lse)
    return None if not all_finite(out) else _poison(out, lse, guard, plan, tables, positions, window)


class FlexPagedPlan(NamedTuple):
    """What the Flex call needs, from the tables alone."""

    rows: torch.Tensor  # [Nq] int64: query r's row of Flex's row axis
    padded_rows: int  # rows of Flex's axis (a power of two of query blocks)
    block_mask: object  # BlockMask [1, 1 | Hq, blocks, key blocks]
    logical_page: torch.Tensor  # [B, num_pages] int64: page p is key page logical_page[b, p] of sequence b, or -1
    row_seq: torch.Tensor  # [Nq] int64: each query's sequence
    heads_in_axis: bool  # the pools' layout the block mask was built for (PoolView)


def _plan(q, k_pages, v_pages, tables: PagedBatch, positions: torch.Tensor, window: int | None) -> FlexPagedPlan:
    """Rows, inverse table and BlockMask of one call (host work on the small tables; positions int64 on CPU)."""
    device, (num_pages, page_size, kv_heads, _) = q.device.type, k_pages.shape
    q_heads, heads_in_axis = q.shape[1], pool_view(k_pages, v_pages).heads_in_axis
    table, lengths = tables.page_table, torch.tensor(tables.kv_lens, dtype=torch.long)  # [B, max_pages], [B]
    used = (torch.arange(table.shape[1]) < (lengths[:, None] + page_size - 1) // page_size) & (table >= 0)
    seq, column = used.nonzero(as_tuple=True)
    logical_page = torch.full((tables.batch + 1, num_pages), -1, dtype=torch.long)  # [B + 1, pages]: row B empty
    logical_page[seq, table[seq, column]] = column
    rows, row_seq, block_seq, padded_rows, q_block = _query_rows(tables, device)
    blocks = padded_rows // q_block
    row_pos = torch.full((padded_rows,), -1, dtype=torch.long).index_put_((rows,), positions)  # padding: -1
    row_len = torch.zeros(padded_rows, dtype=torch.long).index_put_((rows,), lengths[row_seq])  # [rows]
    real = torch.zeros(padded_rows, dtype=torch.bool).index_fill_(0, rows, True)  # [rows]: not padding
    per_block = 1 if heads_in_axis else -(-KV_BLOCK[device] // page_size)  # pages per key block (HND: one head's)
    if device == "cuda" and not heads_in_axis:  # whole pages, a multiple of the Triton kernel's 128 keys
        per_block = KV_BLOCK["cuda"] // math.gcd(KV_BLOCK["cuda"], page_size)
    key_blocks = -(-num_pages // per_block)
    block_logical = torch.full((blocks, key_blocks * per_block), -1, dtype=torch.long)  # [blocks, pages padded]
    block_logical[:, :num_pages] = logical_page[block_seq]
    some, every = (x.view(blocks, key_blocks, per_block) for x in _page_visibility(
        block_logical, *(x.view(blocks, q_block) for x in (real, row_pos, row_len)), page_size, window))
    some, every = some.any(-1), every.all(-1)  # [blocks, key_blocks]
    lists = [(x.sum(-1), torch.argsort((~x).to(torch.int8), dim=-1, stable=True))  # (count, chosen blocks first)
             for x in (some & ~every, every)]  # partial blocks (mask_mod decides), full blocks
    if heads_in_axis:  # page list -> the (page, KV head) block of each query head
        head_of = torch.arange(q_heads) // (q_heads // kv_heads)  # [Hq]
        lists = [(count.expand(q_heads, -1), torch.cat([order[None] * kv_heads + head_of[:, None, None],  # [Hq, ..]
                  order.new_zeros(q_heads, blocks, num_pages * (kv_heads - 1))], dim=-1)) for count, order in lists]
    lists = [(count.reshape(1, -1, blocks).to(q.device, torch.int32),  # [1, 1 | Hq, blocks]
              order.reshape(1, -1, blocks, order.shape[-1]).to(q.device, torch.int32)) for count, order in lists]
    limit = torch.tensor(window if window is not None else 1 << 62)  # a tensor: one kernel for every window
    tensors = (x.to(q.device) for x in (block_logical, row_pos, row_len, limit))
    mask_mod = _mask_mod(*tensors, q_block, page_size, kv_heads if heads_in_axis else None, q_heads // kv_heads)
    keys = num_pages * page_size * (kv_heads if heads_in_axis else 1)
    block_mask = BlockMask.from_kv_blocks(*lists[0], *lists[1], BLOCK_SIZE=(q_block, page_size * per_block),
                                          mask_mod=mask_mod, seq_lengths=(padded_rows, keys), compute_q_blocks=False)
    return FlexPagedPlan(rows, padded_rows, block_mask, logical_page[:-1], row_seq, heads_in_axis)


def _query_rows(tables: PagedBatch, device: str):
    """``(rows [Nq], row_seq [Nq], block_seq [blocks], padded_rows, Q)``: each sequence's queries from the start of
    a block of Q rows (a power of two, up to Q_BLOCK) of their own (``block_seq``: its sequence, B for padding), the
    blocks rounded up to a power of two."""
    counts = torch.tensor(tables.starts).diff()  # [B] queries of each sequence
    most = int(counts.max()) if tables.batch else 1
    q_block = Q_BLOCK[device] if device == "cuda" else min(Q_BLOCK[device], 1 << max(most - 1, 0).bit_length())
    row_seq = torch.repeat_interleave(torch.arange(tables.batch), counts)  # [Nq]
    seq_blocks = (counts + q_block - 1) // q_block  # [B]
    padded_rows = (1 << max(int(seq_blocks.sum()) - 1, 0).bit_length()) * q_block
    first_row = (seq_blocks.cumsum(0) - seq_blocks) * q_block  # [B]
    rows = first_row[row_seq] + torch.arange(row_seq.shape[0]) - torch.tensor(tables.starts[:-1])[row_seq]
    block_seq = torch.full((padded_rows // q_block,), tables.batch, dtype=torch.long)  # [blocks]
    block_seq[:int(seq_blocks.sum())] = torch.repeat_interleave(torch.arange(tables.batch), seq_blocks)
    return rows, row_seq, block_seq, padded_rows, q_block


def _page_visibility(block_logical, real, pos, length, page_size: int, window: int | None):
    """``(some, every)`` bool ``[blocks, pages]``: some query of the block may see a key of the page / every query
    sees every slot. ``block_logical [blocks, pages]``; ``real`` (not padding), ``pos``, ``length [blocks, Q]``."""
    q_min = torch.where(real, pos, 1 << 62).amin(1, keepdim=True)  # [blocks, 1]
    q_max = torch.where(real, pos, -1).amax(1, keepdim=True)  # [blocks, 1]
    low = block_logical * page_size  # [blocks, pages]: the page's first key position
    filled = (length.amax(1, keepdim=True) - low).clamp(0, page_size)  # its keys below kv_len
    owned = block_logical >= 0
    some, every = range_sees(q_min, q_max, low, low + filled - 1, window)  # keys low .. low + filled - 1
    return owned & (filled > 0) & some, owned & (filled == page_size) & every


def _mask_mod(block_logical, row_pos, row_len, window, q_block: int, page_size: int, kv_heads: int | None,
              group: int):
    """``mask_mod(b, h, q_idx, kv_idx)``: the rule at a physical key index (``kv_heads``: an HND pool's index)."""

    def mask_mod(b, h, q_idx, kv_idx):
        page, slot = kv_idx // page_size, kv_idx % page_size
        if kv_heads is not None:
            page, head = page // kv_heads, page % kv_heads
        logical = block_logical[q_idx // q_block, page]  # -1: not the sequence's page
        visible = _visible(logical, slot, row_len[q_idx], row_pos[q_idx], window, page_size)
        return visible if kv_heads is None else visible & (head == h // group)

    return mask_mod


def _visible(logical, slot, length, pos, window, page_size: int):
    """The rule at a slot of a sequence's page ``logical`` (-1: not its page): its key ``logical * P + slot`` is
    below the sequence's length, not after the query's position and, with a window, less than it before."""
    key = logical * page_size + slot
    return (logical >= 0) & (key < length) & sees(pos, key, window)


def _flex_call(q, k, v, **kwargs):
    return _flex_attention(q, k, v, **kwargs)


@functools.cache
def _compiled(device_type: str):
    """Flex compiled as in engine.kernels.flex.flex, through a function of its own: torch.compile's limit of 8
    kernels counts per function, so paged shapes do not push the unpaged calls into the unfused path."""
    return torch.compile(_flex_call, dynamic=False if device_type == "cpu" else None)


def _run(q, k_pages, v_pages, plan: FlexPagedPlan, softcap, scale, want_lse: bool):
    """One Flex call: ``(out [Nq, Hq, Dv] in q's dtype, lse [Nq, Hq] or None)``."""
    view = pool_view(k_pages, v_pages)
    if view is None or view.heads_in_axis != plan.heads_in_axis:  # a guard's zeroed copies, laid out otherwise
        view = pool_view(*(x.transpose(1, 2).contiguous().transpose(1, 2) if plan.heads_in_axis else x.contiguous()
                           for x in (k_pages, v_pages)))
    q_rows = q.new_zeros(1, q.shape[1], plan.padded_rows, q.shape[2])  # [1, Hq, rows, D]
    q_rows[0, :, plan.rows] = q.detach().transpose(0, 1)
    compiled = q.device.type == "cuda" or (q.dtype != torch.float64 and not want_lse)
    lse_request = {} if not want_lse else {"return_lse": True} if AuxRequest is None else \
        {"return_aux": AuxRequest(lse=True)}
    result = (_compiled(q.device.type) if compiled else _unfused)(
        q_rows, view.keys.detach(), view.values.detach(), score_mod=None if softcap is None else softcap_mod(softcap),
        block_mask=plan.block_mask, scale=scale, enable_gqa=q.shape[1] != view.keys.shape[1], **lse_request)
    out = (result[0] if want_lse else result)[0][:, plan.rows].transpose(0, 1)  # [Nq, Hq, Dv]
    if not want_lse:
        return out, None
    lse = result[1] if AuxRequest is None else result[1].lse  # [1, Hq, rows], natural log
    return out, lse[0][:, plan.rows].transpose(0, 1).to(compute_dtype(q.dtype))  # [Nq, Hq]


def _poison(out, lse, guard, plan: FlexPagedPlan, tables: PagedBatch, positions, window):
    """Rows that see a bad owned key: NaN (lse -inf); channels that see a bad owned value: NaN."""
    pages, page_size, kv_heads, dv = guard.v.shape
    bad = torch.zeros(pages, page_size, kv_heads, dv + 1, dtype=torch.bool)  # [pages, P, Hkv, Dv + 1]: values, key
    for part, found in ((slice(0, dv), guard.value_bad), (dv, guard.key_bad)):
        bad[..., part] = False if found is None else found.cpu()
    lengths, slots = torch.tensor(tables.kv_lens), torch.arange(page_size)
    owned = _visible(plan.logical_page[:, :, None], slots, lengths[:, None, None], 1 << 62, None, page_size)
    page, slot = (owned.any(0) & bad.flatten(2).any(-1)).nonzero(as_tuple=True)  # [n]: bad slots someone owns
    if page.numel() == 0:
        return out, lse
    visible = _visible(plan.logical_page[plan.row_seq[:, None], page], slot, lengths[plan.row_seq][:, None],
                       positions[:, None], window, page_size)  # [Nq, n]
    hits = torch.einsum("rn,nhc->rhc", visible.double(), bad[page, slot].double()) > 0  # [Nq, Hkv, Dv + 1]
    hits = hits.repeat_interleave(out.shape[1] // kv_heads, 1)  # [Nq, Hq, Dv + 1]
    row_hit = hits[..., dv]
    out = out.masked_fill((hits[..., :dv] | row_hit[..., None]).to(out.device), math.nan)
    return out, None if lse is None else lse.masked_fill(row_hit.to(lse.device), -math.inf)
