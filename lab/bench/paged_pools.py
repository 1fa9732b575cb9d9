"""The paged benches' pools: dense keys laid out in pages (shuffled unless asked otherwise), as a paged cache holds
them."""

from __future__ import annotations

import torch

from engine import huge_pages
from engine.quantized import QuantizedKV, quantize

__all__ = ["PLACEMENTS", "on_huge_pages", "placement_table", "pools", "quantized_pool"]


PLACEMENTS = ("shuffled", "in order", "interleaved")


def placement_table(batch: int, n: int, placement: str, generator: torch.Generator) -> torch.Tensor:
    """A page table ``[B, n]`` over ``B * n`` pages: ``shuffled`` (each page anywhere in the pool), ``in order``
    (sequence b's pages b n .. b n + n - 1: each sequence's pages follow on, as a PagedKVCache with room gives them,
    prompts and sequences growing together alike) or ``interleaved`` (sequence b's i-th page i B + b: what a free
    list handing out the lowest id first gives B sequences growing a token at a time in lock step)."""
    if placement == "shuffled":
        return torch.randperm(batch * n, generator=generator).view(batch, n)
    if placement == "in order":
        return torch.arange(batch * n).view(batch, n)
    if placement == "interleaved":
        return torch.arange(batch * n).view(n, batch).t().contiguous()
    raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")


def pools(k: torch.Tensor, v: torch.Tensor, page_size: int, generator: torch.Generator, head_major: bool,
          placement: str = "shuffled"):
    """``(k_pages, v_pages, page_table)`` holding ``k, v [B, Hkv, S, D]`` in pages ``[num_pages, page_size, Hkv,
    D]`` placed as ``placement`` says (``placement_table``; shuffled by default): each page's heads side by side
    (``head_major``: storage ``[num_pages, Hkv, page_size, D]``, as ``PagedKVCache(heads_outer=False)`` keeps it) or
    FlashInfer's NHD order."""
    batch, kv_heads, s, d = k.shape
    n = s // page_size
    table = placement_table(batch, n, placement, generator)  # [B, pages per sequence]
    out = []
    for x in (k, v):
        pages = x.reshape(batch, kv_heads, n, page_size, d).permute(0, 2, 1, 3, 4).reshape(batch * n, kv_heads,
                                                                                           page_size, d)
        stored = torch.empty_like(pages)  # [num_pages, Hkv, P, D]
        stored[table.reshape(-1)] = pages
        out.append(stored.permute(0, 2, 1, 3) if head_major else stored.permute(0, 2, 1, 3).contiguous())
    return out[0], out[1], table


def quantized_pool(pool: torch.Tensor) -> QuantizedKV:
    """An fp32 pool ``[num_pages, page_size, Hkv, D]`` in int8 with a scale per token and head (the same storage order:
    head-major stays head-major)."""
    stored = quantize(pool.permute(0, 2, 1, 3))  # [num_pages, Hkv, page_size, D] as stored
    return QuantizedKV(stored.data.permute(0, 2, 1, 3), stored.scale.permute(0, 2, 1))


def on_huge_pages(x, heads_outer: bool = False):
    """A copy of ``x`` (a tensor or a QuantizedKV) in ``engine.huge_pages`` buffers, as KVCache / PagedKVCache hold
    theirs, its elements in the same memory order (the same strides up to a permutation). ``heads_outer``: a pool's
    (``[num_pages, page_size, Hkv, D]``, scales ``[num_pages, page_size, Hkv]``) heads outermost instead, storage
    ``[Hkv, num_pages, page_size, D]``: each head's pages one region, so a head's keys over pages in order are one
    run of memory (the same view and values: ``PagedKVCache(heads_outer=True)``'s layout)."""
    if isinstance(x, QuantizedKV):
        return QuantizedKV(on_huge_pages(x.data, heads_outer), on_huge_pages(x.scale, heads_outer))
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))  # outermost first
    if heads_outer:
        order = [2] + [d for d in order if d != 2]
    held = huge_pages.zeros(*(x.shape[d] for d in order), dtype=x.dtype)
    held.copy_(x.permute(order))
    return held.permute([order.index(d) for d in range(x.dim())])
