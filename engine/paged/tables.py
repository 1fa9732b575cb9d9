"""A paged batch's tables, validated: which pages hold each sequence's keys, and which packed rows are its queries.

The layout is FlashInfer's (NHD) and vLLM's block table::

    k_pages, v_pages   [num_pages, page_size, Hkv, D]     one pool of pages per layer
    page_table         [B, max_pages] int                 sequence b's key j is in page page_table[b, j // P],
                                                          slot j % P (P = page_size)
    kv_lens            [B] int                            sequence b's cached keys, its new ones included
    query_indptr       [B + 1] int                        sequence b's queries are q[query_indptr[b]:query_indptr[b+1]]

    page_size 4, kv_lens [6, 3], page_table [[7, 2], [5, x]]:
        sequence 0: keys 0..3 in page 7, keys 4..5 in page 2 (slots 0, 1; slots 2, 3 unowned)
        sequence 1: keys 0..2 in page 5 (x: past its pages, ignored)

A page entry of -1 is a released page (a sliding-window cache gave it back): allowed only where no query of the
call can see any of its keys (``check_released``), and never read. K/V pools may be ``QuantizedKV`` (int8 / fp8 data
``[num_pages, page_size, Hkv, D]`` with scales ``[num_pages, page_size, Hkv]``, engine.quantized).

``paged_batch`` checks every table against the pools and q and returns a ``PagedBatch`` of plain ints (one host
read of the small tables), or raises a ValueError naming what was expected and what was given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.inputs import SUPPORTED_DTYPES
from engine.masks.window import range_sees
from engine.quantized import QuantizedKV

__all__ = ["PagedBatch", "paged_batch", "check_released", "RELEASED"]

RELEASED = -1  # a page table entry whose page was given back (its keys outside every query's window)


@dataclass(frozen=True)
class PagedBatch:
    """The tables of one paged call: per sequence its query rows ``[starts[b], starts[b+1])`` and number of keys
    (Python ints), and ``page_table`` int64 ``[B, max_pages]`` whose first ``ceil(kv_len / page_size)`` entries
    of row b (``pages[b]``) are checked page ids (or RELEASED); the entries after them are never read."""

    starts: list[int]
    kv_lens: list[int]
    page_table: torch.Tensor
    page_size: int
    released: bool = False  # some sequence's own entries are RELEASED

    @property
    def readable_table(self) -> torch.Tensor:
        """``page_table`` with RELEASED entries pointing at page 0: what a kernel that computes an address for every
        key it might touch reads (those keys are masked out, never used)."""
        return self.page_table.clamp(min=0) if self.released else self.page_table

    @property
    def pages(self) -> list[list[int]]:
        """Each sequence's own pages as ints (the gathered path's index)."""
        table = self.page_table.tolist()
        return [table[b][:-(-n // self.page_size)] for b, n in enumerate(self.kv_lens)]

    @property
    def batch(self) -> int:
        return len(self.kv_lens)

    def query_rows(self, b: int) -> slice:
        return slice(self.starts[b], self.starts[b + 1])


def _integer_tensor(x, name: str, dims: int, shape_text: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        kind = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be an integer tensor {shape_text}, got {kind}")
    if x.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {shape_text}, got shape {list(x.shape)}")
    if x.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor: the tables need values")
    return x


def _check_pools(q, k_pages, v_pages) -> None:
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q must be a torch.Tensor [Nq, Hq, D], got {type(q).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [Nq, Hq, D], got shape {list(q.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ValueError(f"q must have dtype {supported}, got {q.dtype}")
    quantized = isinstance(k_pages, QuantizedKV), isinstance(v_pages, QuantizedKV)
    if any(quantized) and not all(quantized):
        raise ValueError(f"k_pages and v_pages must both be QuantizedKV pools or both tensors, got "
                         f"{type(k_pages).__name__} and {type(v_pages).__name__}")
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if not isinstance(x, (torch.Tensor, QuantizedKV)):
            raise ValueError(f"{name} must be a torch.Tensor (or QuantizedKV) [num_pages, page_size, Hkv, D], got "
                             f"{type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [num_pages, page_size, Hkv, D], got shape {list(x.shape)}")
    if all(quantized):
        if k_pages.data.dtype != v_pages.data.dtype:
            raise ValueError(f"quantized k_pages and v_pages must share one dtype, got {k_pages.data.dtype} and "
                             f"{v_pages.data.dtype}")
    elif not (q.dtype == k_pages.dtype == v_pages.dtype):
        raise ValueError(f"q, k_pages, v_pages must share one dtype, got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
    if not (q.device == k_pages.device == v_pages.device):
        raise ValueError(f"q, k_pages, v_pages must be on one device, got {q.device}, {k_pages.device}, "
                         f"{v_pages.device}")
    if k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(f"k_pages and v_pages must be pools of the same pages [num_pages, page_size, Hkv], got "
                         f"{list(k_pages.shape[:3])} and {list(v_pages.shape[:3])}")
    if k_pages.shape[1] == 0:
        raise ValueError("page_size (k_pages.shape[1]) must be at least 1, got 0")
    q_heads, kv_heads = q.shape[1], k_pages.shape[2]
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"Query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    if k_pages.shape[3] != q.shape[2]:
        raise ValueError(f"head dim mismatch: q has D={q.shape[2]}, k_pages has D={k_pages.shape[3]}")


def paged_batch(q, k_pages, v_pages, page_table, kv_lens, query_indptr, default_positions: bool) -> PagedBatch:
    """Validate a paged call's tensors and tables; ``default_positions``: each sequence's queries sit at its last
    keys' positions, so a sequence cannot have more queries than keys."""
    _check_pools(q, k_pages, v_pages)
    num_pages, page_size = k_pages.shape[0], k_pages.shape[1]
    page_table = _integer_tensor(page_table, "page_table", 2, "[B, max_pages]")
    batch = page_table.shape[0]
    kv_lens = _integer_tensor(kv_lens, "kv_lens", 1, f"[B] = [{batch}]")
    query_indptr = _integer_tensor(query_indptr, "query_indptr", 1, f"[B + 1] = [{batch + 1}]")
    if kv_lens.shape[0] != batch:
        raise ValueError(f"kv_lens must have one entry per sequence of page_table, [{batch}], got "
                         f"{list(kv_lens.shape)}")
    if query_indptr.shape[0] != batch + 1:
        raise ValueError(f"query_indptr must have B + 1 = {batch + 1} entries, got {query_indptr.shape[0]}")
    starts, lens = query_indptr.tolist(), kv_lens.tolist()  # the host reads of the small tables, once
    if starts[0] != 0 or starts[-1] != q.shape[0]:
        raise ValueError(f"query_indptr must run from 0 to Nq = {q.shape[0]}, got {starts[0]} .. {starts[-1]}")
    for b in range(batch):
        if starts[b + 1] < starts[b]:
            raise ValueError(f"query_indptr must not decrease, got {starts[b]} then {starts[b + 1]} at sequence {b}")
        queries, keys = starts[b + 1] - starts[b], lens[b]
        if keys < 0:
            raise ValueError(f"kv_lens[{b}] must be >= 0, got {keys}")
        if default_positions and keys < queries:
            raise ValueError(f"kv_lens[{b}] = {keys} is shorter than sequence {b}'s {queries} queries (its new keys "
                             f"count in kv_lens; pass query_positions for queries that are not its last keys)")
        owned = -(-keys // page_size)  # pages the sequence's keys fill
        if owned > page_table.shape[1]:
            raise ValueError(f"kv_lens[{b}] = {keys} needs {owned} pages of {page_size}, but page_table has "
                             f"{page_table.shape[1]} columns")
    table = page_table.to(device="cpu", dtype=torch.long, copy=True).contiguous()  # [B, max_pages], its own copy
    owned = (kv_lens.to("cpu", torch.long) + page_size - 1) // page_size  # [B]
    used = torch.arange(table.shape[1]) < owned[:, None]  # [B, max_pages]: the entries a sequence reads
    bad = used & (((table < 0) & (table != RELEASED)) | (table >= num_pages))
    if bool(bad.any()):
        b, column = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"page_table[{b}] names page {int(table[b, column])}, out of range [0, {num_pages}) for the "
                         f"pools' {num_pages} pages (or {RELEASED}: released)")
    return PagedBatch(starts, lens, table, page_size, bool((used & (table == RELEASED)).any()))


def check_released(tables: PagedBatch, positions: torch.Tensor, window: int | None) -> None:
    """Raise a ValueError when a query could see a key of a RELEASED page: keys ``j0 .. j1`` of one are invisible to
    a query at ``p`` iff ``p < j0`` (all later) or ``p - j1 >= window`` (all outside its window)."""
    if not tables.released:
        return
    size = tables.page_size
    for b, column in (tables.page_table == RELEASED).nonzero().tolist():
        j0, j1 = column * size, min((column + 1) * size, tables.kv_lens[b]) - 1
        if j0 > j1:
            continue  # past the sequence's keys: never read
        p = positions[tables.query_rows(b)].cpu()  # [q_len]
        sees = range_sees(p, p, j0, j1, window)[0]  # [q_len]: the query may see a key of the page
        if bool(sees.any()):
            raise ValueError(f"page_table[{b}, {column}] is {RELEASED} (a released page), but sequence {b}'s query at "
                             f"position {int(p[sees][0])} sees its keys {j0}..{j1} (window={window}): only pages "
                             f"wholly outside every query's window may be released")
