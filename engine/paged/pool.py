"""The pages of a paged KV cache: storage, reference counts and where the next page comes from (engine.paged.cache
keeps sequences).

Storage is head-outer, ``[Hkv, num_pages, page_size, D]``: each KV head's pages are one region of memory, so a head's
keys over pages p, p + 1, ... are one run, which the native kernel streams as it does a contiguous cache's. ``keys``
and ``values`` show it in ``paged_attention``'s ``[num_pages, page_size, Hkv, D]`` order through a permuted view.
``heads_outer=False`` stores ``[num_pages, Hkv, page_size, D]`` instead (a head's keys of one page one run, the
kernel reading two heads of a page side by side, four for bf16 / fp16): decodes over pages of 16 that follow on took
1.00-1.04x contiguous held so against 1.07-1.23x; over pages that do not, 1.11-1.6x against 1.07-1.32x; after a
serving-like churn of requests, with this allocator, 0.87-0.93x the time of the other layout and the lowest-id free
list of before (89% of the pool in use) or 0.92-0.95x (96.5%) (docs/BENCHMARKS.md, "Decode at the bandwidth limit,
round 18"). The NHD order (``[num_pages, page_size, Hkv, D]`` in memory) puts a head's keys of a page Hkv * D apart:
1.3-1.9x slower decode, measured.

Where pages come from (``take``): a sequence's next page is the one after its last where that is free, so its pages
follow on. A page that starts a run (a new sequence's, or one whose follower is taken) goes where the new run has the
most room: a free run no sequence grows into is its own from its first page; one that a sequence would grow into
(its first page the follower of that sequence's last: ``claimed``) is shared, the new run starting in its middle, so
sequences growing side by side each keep room to grow into.

A quantized pool (``dtype`` int8 or float8_e4m3fn, engine.quantized) keeps 1-byte entries and one fp32 scale per
token and head; ``keys`` and ``values`` are then ``QuantizedKV`` views::

    data  [num_pages, page_size, Hkv, D]   of storage [Hkv, num_pages, page_size, D]   (int8 / e4m3)
    scale [num_pages, page_size, Hkv]      of storage [Hkv, num_pages, page_size]      (fp32)
    entry [p, s, h, d] stands for data[p, s, h, d] * scale[p, s, h]

so a token costs ``Hkv * (D + 4)`` bytes for its keys (fp32: ``4 * Hkv * D``). Slots no token was written to hold
0 (scale 1).

With ``shared_values`` a layer has one pool of rows: ``values`` is ``keys[..., :Dv]`` (a latent cache's
``[c_kv | k_rope]``, engine.shared_rows), written and copied once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from engine import huge_pages
from engine.inputs import SUPPORTED_DTYPES
from engine.quantized import QUANTIZED_DTYPES, QuantizedKV, quantize

__all__ = ["PagePool", "check_pool_dtype", "followers"]


def check_pool_dtype(dtype) -> bool:
    """True for a quantized dtype, False for one the kernels compute; ValueError naming every supported one else."""
    if isinstance(dtype, torch.dtype) and dtype in SUPPORTED_DTYPES:
        return False
    if isinstance(dtype, torch.dtype) and dtype in QUANTIZED_DTYPES:
        return True
    plain = ", ".join(str(d) for d in SUPPORTED_DTYPES)
    quantized = ", ".join(str(d) for d in QUANTIZED_DTYPES)
    raise ValueError(f"dtype must be one the kernels compute ({plain}) or a quantized one ({quantized}), got "
                     f"{dtype!r}")


def followers(page_lists) -> set[int]:
    """The pages sequences would grow into next (each list's last page + 1; None: released): ``take``'s ``claimed``."""
    return {pages[-1] + 1 for pages in page_lists if pages and pages[-1] is not None}


def _pool(num_pages: int, page_size: int, heads: int, width: int, dtype: torch.dtype, device, quantized: bool,
          heads_outer: bool):
    """Zeroed ``[num_pages, page_size, Hkv, E]`` (a ``QuantizedKV`` with scales 1 when quantized), stored
    ``[Hkv, num_pages, page_size, E]`` (``heads_outer``) or ``[num_pages, Hkv, page_size, E]``."""
    stored, view = ((heads, num_pages, page_size), (1, 2, 0)) if heads_outer else \
        ((num_pages, heads, page_size), (0, 2, 1))  # the storage's leading axes; their order in the view
    data = huge_pages.zeros(*stored, width, dtype=dtype, device=device).permute(*view, 3)
    if not quantized:
        return data  # [num_pages, page_size, Hkv, E]
    return QuantizedKV(data, torch.ones(*stored, device=device).permute(*view))  # scale [num_pages, page_size, Hkv]


class PagePool:
    """``keys [num_pages, page_size, Hkv, D]`` and ``values [num_pages, page_size, Hkv, Dv]`` (tensors, or
    ``QuantizedKV`` for a quantized ``dtype``), with a reference count per page: ``take`` hands out free pages
    (count 1; the module's note says which), ``hold`` adds a holder, ``drop`` removes one and frees the page at 0."""

    def __init__(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int, value_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None, layers: int = 1,
                 shared_values: bool = False, heads_outer: bool = True) -> None:
        self.quantized = check_pool_dtype(dtype)
        if shared_values not in (True, False) or (shared_values and value_dim > head_dim):
            raise ValueError(f"shared_values (the values as the first value_dim columns of the keys' rows) must be "
                             f"True or False, with value_dim <= head_dim = {head_dim}: got {shared_values!r}, "
                             f"value_dim {value_dim}")
        if heads_outer not in (True, False):
            raise ValueError(f"heads_outer (each KV head's pages one region of memory) must be True or False, got "
                             f"{heads_outer!r}")
        self.page_size, self.shared_values, self.heads_outer = page_size, shared_values, heads_outer
        # one pair of pools per layer, one page numbering and set of free pages for all of them (page p of every layer
        # belongs to the same tokens); a layer's two allocated one after the other (huge_pages staggers them)
        self.layer_keys, self.layer_values = [], []
        for _ in range(layers):
            keys = _pool(num_pages, page_size, kv_heads, head_dim, dtype, device, self.quantized, heads_outer)
            self.layer_keys.append(keys)
            self.layer_values.append(_value_rows(keys, value_dim) if shared_values else
                                     _pool(num_pages, page_size, kv_heads, value_dim, dtype, device, self.quantized,
                                           heads_outer))
        self.keys, self.values = self.layer_keys[0], self.layer_values[0]
        self._references = [0] * num_pages  # holders of each page
        self._free = bytearray(b"\x01") * num_pages  # 1 where a page is free (read as a tensor by _run_start)
        self._free_count = num_pages

    @property
    def num_pages(self) -> int:
        return len(self._references)

    @property
    def free_pages(self) -> int:
        return self._free_count

    @property
    def nbytes(self) -> int:
        """Bytes of the pools (every page, used or not; a quantized pool's scales included)."""
        return sum(pool.nbytes for pool in self._stored())

    def references(self, page: int) -> int:
        return self._references[page]

    def freed_by(self, pages: list[int]) -> int:
        """How many pages would be freed if one reference were dropped per entry of ``pages``."""
        return sum(1 for page, n in Counter(pages).items() if self._references[page] == n)

    def take(self, before: Sequence[int | None] = (), count: int = 1, claimed: set[int] | None = None) -> list[int]:
        """``count`` free pages (each held once) to follow a sequence's pages ``before`` (None: released), in order:
        each the page after the one before it where that is free, else ``_run_start``'s. ``claimed``: the pages other
        sequences would grow into next (each one's last page + 1), to which the pages' own follower is added. The
        caller checks there are ``count`` free pages."""
        pages, after = [], before[-1] if before else None
        for left in range(count, 0, -1):
            follower = None if after is None else after + 1
            page = follower if follower is not None and follower < self.num_pages and self._free[follower] else \
                self._run_start(left, claimed or ())
            self._free[page], self._free_count, self._references[page] = 0, self._free_count - 1, 1
            pages.append(page)
            after = page
        if claimed is not None and pages:
            claimed.add(pages[-1] + 1)
        return pages

    def _run_start(self, count: int, claimed) -> int:
        """Where a new run of ``count`` pages starts: in the free run it has the most room in (the lowest of equals).
        A free run that a sequence would grow into (its first page ``claimed``) is shared, the new run starting in its
        middle after room for the ``count`` pages; any other free run is the new run's from its first page."""
        if not self._free_count:
            raise ValueError(f"no free page in this pool of {self.num_pages} (its caller checks before taking)")
        free = torch.frombuffer(self._free, dtype=torch.uint8).to(torch.int8)
        edges = torch.diff(free, prepend=free.new_zeros(1), append=free.new_zeros(1))  # +1 a run's start, -1 its end
        starts, ends = (edges == 1).nonzero()[:, 0], (edges == -1).nonzero()[:, 0]
        shared = torch.zeros(self.num_pages + 1, dtype=torch.bool)
        shared[[page for page in claimed if 0 <= page < self.num_pages]] = True
        shared = shared[starts]  # [free runs]: a sequence grows into it
        lengths = ends - starts
        best = int(torch.argmax(torch.where(shared, lengths // 2, lengths)))  # (the first of equals)
        start, length = int(starts[best]), int(lengths[best])
        return start + max(0, length - count) // 2 if shared[best] else start

    def hold(self, page: int) -> None:
        self._references[page] += 1

    def drop(self, page: int) -> None:
        self._references[page] -= 1
        if self._references[page] == 0:
            self._free[page], self._free_count = 1, self._free_count + 1

    def copy(self, source: int, target: int) -> None:
        """Page ``target`` becomes a copy of page ``source`` in every layer (keys and values; data and scales)."""
        for pool in self._stored():
            if self.quantized:
                pool.data[target], pool.scale[target] = pool.data[source], pool.scale[source]
            else:
                pool[target] = pool[source]

    def renumber(self, moves: dict[int, int]) -> None:
        """Each held page ``old`` of ``moves`` becomes page ``moves[old]`` (every held page named once, the new
        numbers distinct): its rows in every layer (keys and values; data and scales) and its holders; every other
        page is free after. The moved pages are read before any is written (one copy of them at a time per pool)."""
        held = [page for page, n in enumerate(self._references) if n]
        if sorted(held) != sorted(moves) or len(set(moves.values())) != len(moves) or not all(
                0 <= page < self.num_pages for page in moves.values()):
            raise ValueError(f"renumber needs every held page ({len(held)}) once, each to a distinct page in "
                             f"[0, {self.num_pages}): got {len(moves)} moves")
        old = torch.tensor([page for page, to in moves.items() if page != to], dtype=torch.long)
        new = torch.tensor([to for page, to in moves.items() if page != to], dtype=torch.long)
        for pool in self._stored():
            for tensor in (pool.data, pool.scale) if self.quantized else (pool,):
                tensor[new.to(tensor.device)] = tensor[old.to(tensor.device)]  # (the right side: a copy)
        references = [0] * self.num_pages
        for page, to in moves.items():
            references[to] = self._references[page]
        self._references = references
        self._free[:] = bytes(int(n == 0) for n in references)
        self._free_count = self.num_pages - len(moves)

    def write(self, pages: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              layer: int = 0) -> None:
        """Row i of ``keys [N, Hkv, D]`` and ``values [N, Hkv, Dv]`` goes to slot ``slots[i]`` of page ``pages[i]``
        (int64 ``[N]``, distinct pairs) of ``layer``'s pools; a quantized pool quantizes each row per head first.
        Shared rows: the keys' rows hold the values (``values`` is not read)."""
        written = [(keys, self.layer_keys[layer])]
        if not self.shared_values:
            written.append((values, self.layer_values[layer]))
        for new, pool in written:
            if self.quantized:
                stored = quantize(new[None].to(pool.device), pool.data.dtype)  # [1, N, Hkv, E], scale per token, head
                pool.data[pages, slots] = stored.data[0]  # [N, Hkv, E]
                pool.scale[pages, slots] = stored.scale[0]  # [N, Hkv]
            else:
                pool[pages, slots] = new.to(pool.device, pool.dtype)  # [N, Hkv, E]

    def shared_rows(self, keys, values):
        """A shared-rows pool's new values: ``keys [N, Hkv, D]``'s first Dv columns (``values`` must be None)."""
        if values is not None:
            raise ValueError("this cache's values are the first value_dim columns of its keys' rows "
                             "(shared_values=True): pass values=None")
        dv = self.values.shape[-1]
        return keys[..., :dv] if isinstance(keys, torch.Tensor) and keys.dim() == 3 else keys

    def _stored(self) -> list:
        """The pools that own their storage (shared rows: the keys' alone)."""
        return self.layer_keys if self.shared_values else self.layer_keys + self.layer_values


def _value_rows(keys, value_dim: int):
    """The first ``value_dim`` columns of a pool's rows (a view; a quantized pool's scales are the keys')."""
    if isinstance(keys, QuantizedKV):
        return QuantizedKV(keys.data[..., :value_dim], keys.scale)
    return keys[..., :value_dim]  # [num_pages, page_size, Hkv, Dv]
