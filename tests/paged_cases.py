"""The paged cases the paged tests share: a float64 oracle that reads each key straight through the page table (a
per-query loop), and a hypothesis strategy of paged batches (shuffled and shared pages, partial last pages, mixed
batches, NaN in every slot no sequence owns, windows, softcap, sinks, ALiBi, per-token positions, queries of a
sequence with no keys, a fork at exactly the shared prefix's length; the pools in each of three memory orders)."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from engine import paged_attention


def oracle(q, k_pages, v_pages, page_table, kv_lens, query_indptr, query_positions=None, window=None, softcap=None,
           scale=None, sinks=None, alibi=None, allowed=None, score_mod=None):
    """float64 ``(out [Nq, Hq, Dv], lse [Nq, Hq])``, one query and head at a time, each key read at
    ``pool[page_table[b, j // P], j % P]``."""
    nq, hq, d = q.shape
    page_size, hkv, dv = k_pages.shape[1], k_pages.shape[2], v_pages.shape[3]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(nq, hq, dv, dtype=torch.float64)
    lse = torch.full((nq, hq), -math.inf, dtype=torch.float64)
    for b in range(page_table.shape[0]):
        start, stop, length = int(query_indptr[b]), int(query_indptr[b + 1]), int(kv_lens[b])
        for row in range(start, stop):
            pos = int(query_positions[row]) if query_positions is not None else length - (stop - row)
            keys = [j for j in range(length) if j <= pos and (window is None or pos - j < window)
                    and (allowed is None or bool(allowed[row, j]))]
            # every head's rows of key j, read at pool[page_table[b, j // P], j % P]: [n, Hkv, D | Dv]
            pages = page_table[b, [j // page_size for j in keys]]
            slots = torch.tensor([j % page_size for j in keys], dtype=torch.long)
            k_rows, v_rows = k_pages[pages, slots], v_pages[pages, slots]
            distances = torch.tensor([pos - j for j in keys], dtype=torch.float64)
            for h in range(hq):
                k = k_rows[:, h // (hq // hkv)].double() if keys else None
                v = v_rows[:, h // (hq // hkv)].double() if keys else None
                scores = (k @ q[row, h].double()) * scale if keys else torch.zeros(0, dtype=torch.float64)
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                if alibi is not None:
                    scores = scores - float(alibi[h]) * distances
                if score_mod is not None and keys:
                    scores = score_mod(scores, torch.tensor(b), torch.tensor(h), torch.tensor(pos), torch.tensor(keys))
                logits = scores if sinks is None else torch.cat([scores, sinks[h].double().reshape(1)])
                if logits.numel() == 0:
                    continue
                lse[row, h] = torch.logsumexp(logits, 0)
                if keys:
                    out[row, h] = torch.exp(scores - lse[row, h]) @ v
    return out, lse


LAYOUTS = ("NHD", "heads side by side", "heads outer")


def shuffled_pages(lengths: list[int], page_size: int, generator: torch.Generator, spare: int = 3):
    """``(num_pages, table)``: a pool of every sequence's pages and ``spare`` more, each sequence's pages drawn at
    random from it (none shared); ``table [B, most pages]``, 0 past a sequence's pages."""
    pages_per = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_per) + spare
    order = torch.randperm(num_pages, generator=generator)
    table = torch.zeros(len(lengths), max(pages_per), dtype=torch.int64)
    for b, count in enumerate(pages_per):
        start = sum(pages_per[:b])
        table[b, :count] = order[start:start + count]
    return num_pages, table


def decode_pages_match(q, k_pool, v_pool, table, lengths: list[int], exact, **tolerance) -> None:
    """One query a sequence (``q [B, Hq, D]``) over the pools through ``table`` equals the float64 oracle over
    ``exact(pool)`` (the pools' values in float64) within ``tolerance`` (torch.testing.assert_close's)."""
    kv_lens, indptr = torch.tensor(lengths), torch.arange(len(lengths) + 1)
    out = paged_attention(q, k_pool, v_pool, table, kv_lens, indptr)
    want, _ = oracle(q.double(), exact(k_pool), exact(v_pool), table, kv_lens, indptr)
    torch.testing.assert_close(out.double(), want, **tolerance)


def stored(pool: torch.Tensor, layout: str) -> torch.Tensor:
    """``pool [num_pages, page_size, Hkv, E]`` (the same view and values) stored ``[num_pages, page_size, Hkv, E]``
    (NHD), ``[num_pages, Hkv, page_size, E]`` (heads side by side) or ``[Hkv, num_pages, page_size, E]`` (heads outer:
    PagedKVCache's)."""
    if layout == "NHD":
        return pool.contiguous()
    order = (0, 2, 1, 3) if layout == "heads side by side" else (2, 0, 1, 3)
    return pool.permute(order).contiguous().permute([order.index(d) for d in range(4)])


@st.composite
def paged_batches(draw, uniform: bool = False, dtype: torch.dtype = torch.float64):
    """A pool of shuffled pages, some shared between sequences, NaN in every slot no sequence owns; ``uniform``:
    every sequence the same 1..4 queries (a decode step, as the in-place kernel takes it)."""
    page_size = draw(st.sampled_from([1, 2, 3, 16, 256]))
    hkv, group, d = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([4, 8]))
    batch = draw(st.integers(1, 5))
    kv_lens = [draw(st.integers(0, 40)) for _ in range(batch)]
    shared_pages = draw(st.integers(0, 3))  # sequence 0's first pages, shared by each sequence long enough
    if batch > 1 and shared_pages and draw(st.booleans()):  # a fork at exactly the shared prefix: no keys past it
        kv_lens[0], kv_lens[1] = max(kv_lens[0], shared_pages * page_size), shared_pages * page_size
    per_token = draw(st.booleans())  # per-token positions (drawn below): a sequence with no keys may have queries
    q_lens = [draw(st.sampled_from([0, 1, 1, min(3, n), n])) if n else
              (draw(st.sampled_from([0, 1, 2])) if per_token and not uniform else 0) for n in kv_lens]
    if uniform:
        t = draw(st.integers(1, 4))
        kv_lens, q_lens = [max(n, t) for n in kv_lens], [t] * batch
    seed = draw(st.integers(0, 10_000))
    g = torch.Generator().manual_seed(seed)
    owned = [-(-n // page_size) for n in kv_lens]
    spare = draw(st.integers(0, 3))  # pages nobody owns
    num_pages = sum(owned) + spare
    order = torch.randperm(max(num_pages, 1), generator=g).tolist()
    max_pages = max(owned + [1]) + 1
    page_table = torch.full((batch, max_pages), 10**6, dtype=torch.long)  # past each sequence's pages: ignored
    taken = 0
    for b, n in enumerate(owned):
        page_table[b, :n] = torch.tensor(order[taken:taken + n], dtype=torch.long)
        taken += n
    sharing = {b for b in range(1, batch) if min(kv_lens[0], kv_lens[b]) >= shared_pages * page_size}
    for b in sharing:  # a shared prefix (full pages); the pages these sequences drew instead go unowned (NaN)
        page_table[b, :shared_pages] = page_table[0, :shared_pages]
    k_pages = torch.full((max(num_pages, 1), page_size, hkv, d), math.nan, dtype=dtype)
    v_pages = torch.full((max(num_pages, 1), page_size, hkv, d + 1), math.nan, dtype=dtype)
    for b, n in enumerate(kv_lens):
        for j in range(n):
            page, slot = int(page_table[b, j // page_size]), j % page_size
            if b in sharing and j < shared_pages * page_size:
                continue  # sequence 0 wrote this shared page
            k_pages[page, slot] = torch.randn(hkv, d, generator=g, dtype=dtype)
            v_pages[page, slot] = torch.randn(hkv, d + 1, generator=g, dtype=dtype)
    layout = draw(st.sampled_from(LAYOUTS))  # the same values, stored in one of the three orders
    k_pages, v_pages = (stored(x, layout) for x in (k_pages, v_pages))
    indptr = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.long)
    q = torch.randn(int(indptr[-1]), hkv * group, d, generator=g, dtype=dtype)
    options = {}
    if draw(st.booleans()):
        options["window"] = draw(st.integers(1, 8))
    if draw(st.booleans()):
        options["softcap"] = 4.0
    if draw(st.booleans()):
        options["sinks"] = torch.randn(hkv * group, generator=g, dtype=dtype)
    if draw(st.booleans()):
        options["alibi"] = torch.rand(hkv * group, generator=g, dtype=dtype)
    positions = None
    if per_token and q.shape[0]:  # per-token positions: anywhere in the sequence (or before it)
        positions = torch.cat([torch.randint(-2, max(n, 1) + 2, (ql,), generator=g) for n, ql in zip(kv_lens, q_lens)])
    return (q, k_pages, v_pages, page_table, torch.tensor(kv_lens), indptr, positions), options
