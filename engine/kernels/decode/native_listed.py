"""decode_native on a call with ``key_indices``: only each query's listed keys read, in place (a decode step of
DeepSeek V3.2's sparse attention costs its K keys, not the S the cache holds).

The native kernel already reads keys through a page table (engine.kernels.decode.native_paged). A list of keys is a
page table with pages of one key: each (batch row, KV head, query) becomes a sequence of its listed keys, sorted
and without repeats, each one "page" of the cache's own buffer seen with a row stride::

    k [B, Hkv, S, D], strides (sb, sh, ss, 1)     key j of row b, head h  =  page  b*sb/ss + h*sh/ss + j
    sequence (b, h, t): pages = its listed keys' page ids (the rule and any other mask applied), length = their count
    rows: the G query heads of KV head h at query t         (out, lse folded back to [B, Hq, T, Dv] / [B, Hq, T])

The position rule and any other part of the mask (one shared by every head) are read on the listed keys when the
plan is made; a listed key a query cannot see is dropped from its sequence. Where the layout has no such row stride
(the batch or head stride not a multiple of the row stride, V's or the scales' not in step with K's) or another
mask differs per head, ``listed_runner`` returns None and the dense native path reads the call.
"""

from __future__ import annotations

import torch

from engine.inputs import AttentionInputs
from engine.kernels.common import DoesNotFit
from engine.kernels.decode.native_build import NON_FINITE_Q, NativeLibrary
from engine.masks.key_indices import split_listed
from engine.quantized import QuantizedKV

__all__ = ["listed_runner"]


def _strides(x) -> tuple | None:
    """``(batch, head) strides in rows`` of K/V data ``[B, Hkv, S, E]`` (and a quantized one's scales), or None."""
    parts = [x.data, x.scale] if isinstance(x, QuantizedKV) else [x]
    found = set()
    for t in parts:
        row = t.stride(2)
        if row <= 0 or t.stride(0) % row or t.stride(1) % row:
            return None
        found.add((t.stride(0) // row, t.stride(1) // row))
    return found.pop() if len(found) == 1 else None


def _as_pages(x, count: int):
    """``x`` seen as ``count`` pages of one key, ``[count, 1, 1, E]`` (scales ``[count, 1, 1]``)."""
    def view(t, width):
        row = t.stride(2)
        size = (count, 1, 1) + ((width,) if width else ())
        return t.as_strided(size, (row, row, row) + ((1,) if width else ()), t.storage_offset())
    if isinstance(x, QuantizedKV):
        return QuantizedKV(view(x.data, x.data.shape[3]), view(x.scale, 0))
    return view(x, x.shape[3])


def _tables(inputs: AttentionInputs, listed, others, steps: tuple[int, int]):
    """``(pages int64 [B*Hkv*T, K], lengths int64 [B*Hkv*T])``: each sequence's visible listed keys as page ids."""
    batch, _, t, _ = inputs.q.shape
    kv_heads, s = inputs.k.shape[1], inputs.k.shape[2]
    idx = listed.indices.expand(batch, kv_heads, t, -1)  # [B, Hkv, T, K]
    visible = idx >= 0
    safe = idx.clamp(min=0)
    if inputs.causal:
        key_pos = inputs.key_positions.gather(1, safe.reshape(batch, -1)).view(idx.shape)
        visible &= key_pos <= inputs.query_positions[:, None, :, None]
    for part in others:  # one block per batch row, shared by every head ([1, T, S])
        dense = torch.stack([part.block(b if part.batched() else 0, 0, t, 0, s).reshape(t, s) for b in range(batch)])
        visible &= dense[:, None].expand(batch, kv_heads, t, s).gather(3, safe)
    ordered, _ = torch.where(visible, safe, s).sort(dim=-1)  # hidden ones last (as S)
    repeat = torch.zeros_like(visible)
    repeat[..., 1:] = ordered[..., 1:] == ordered[..., :-1]
    ordered, _ = torch.where(repeat, s, ordered).sort(dim=-1)  # repeats last too
    lengths = (ordered < s).sum(-1)  # [B, Hkv, T]
    base = (torch.arange(batch)[:, None] * steps[0] + torch.arange(kv_heads)[None, :] * steps[1])[..., None, None]
    pages = base + torch.where(ordered < s, ordered, 0)  # [B, Hkv, T, K] (past a length: never read)
    return pages.reshape(batch * kv_heads * t, -1).contiguous(), lengths.reshape(-1).contiguous()


def listed_runner(library: NativeLibrary, inputs: AttentionInputs, resume: str, template, paged_run):
    """``run(q, k, v, return_lse)`` reading only the listed keys, or None where the dense path must read the call.
    ``template`` / ``paged_run``: decode_native's paged call (engine.kernels.decode.decode_native)."""
    listed, others = split_listed(inputs.allowed)
    if listed is None or any(part.shape[1] != 1 for part in others):
        return None
    steps = _strides(inputs.k)
    if steps is None or _strides(inputs.v) != steps:
        return None
    batch, q_heads, t, d = inputs.q.shape
    kv_heads, dv = inputs.k.shape[1], inputs.v.shape[3]
    group = q_heads // kv_heads
    pages, lengths = _tables(inputs, listed, others, steps)
    count = (batch - 1) * steps[0] + (kv_heads - 1) * steps[1] + inputs.k.shape[2]  # ids up to the last key
    if pages.numel() and not 0 <= int(pages.min()) <= int(pages.max()) < count:  # (never: a guard on the layout)
        return None
    kind = (inputs.k.data if isinstance(inputs.k, QuantizedKV) else inputs.k).dtype
    call = template(kind, (pages.shape[0], 1, group, d), dv, inputs.scale, pages, lengths, 1, None)

    def run(q, k, v, return_lse: bool, tables=(pages, lengths)):  # (the tables outlive every run: the call's)
        if _strides(k) != steps or _strides(v) != steps:
            raise DoesNotFit("K/V strides unlike the plan's: the dense path reads them", resume="sparse")
        rows = q.float().view(batch, kv_heads, group, t, d).transpose(2, 3).reshape(-1, 1, group, d)
        out = torch.empty(rows.shape[0], 1, group, dv)  # fp32, written whole
        lse = torch.empty(rows.shape[0], 1, group)
        if paged_run(library, call, rows, _as_pages(k, count), _as_pages(v, count), out, lse) == NON_FINITE_Q:
            raise DoesNotFit("NaN/inf in q: the torch kernels keep it to the rows it belongs to", resume=resume)
        out = out.view(batch, kv_heads, t, group, dv).transpose(2, 3).reshape(batch, q_heads, t, dv)
        lse = lse.view(batch, kv_heads, t, group).transpose(2, 3).reshape(batch, q_heads, t) if return_lse else None
        return (out if q.dtype == torch.float32 else out.to(q.dtype)), lse

    return run
