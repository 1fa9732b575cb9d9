"""A paged KV cache: one pool of fixed-size pages per layer, each sequence a list of pages.

A contiguous cache reserves the longest length for every row; a paged one gives each sequence pages as it grows,
so a batch of ragged requests holds at most one partly filled page per sequence beyond its tokens, and sequences
that share a prefix (beams, parallel samples, one system prompt) share its pages::

    page_size 4                     pool: [p0 p1 p2 p3 p4 ...]
    sequence 0: 6 tokens   pages [p3, p0]     p0 half full
    fork(0) -> sequence 1  pages [p3, p0]     shared: both hold a reference
    append 1 token to 1    p0 is shared and partly full: copied to p1 first (copy on write), then written
                           sequence 1: pages [p3, p1]; sequence 0 still reads p0 unchanged

``append`` takes the packed new tokens of several sequences at once (FlashInfer's ``append_paged_kv_cache``);
``tables`` gives the page table and key lengths ``paged_attention`` reads. Every operation checks what it needs
(free pages, known sequences, shapes) before it changes anything, so a refused call leaves the cache as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.inputs import SUPPORTED_DTYPES

__all__ = ["PagedKVCache"]


@dataclass
class _Sequence:
    pages: list[int] = field(default_factory=list)
    length: int = 0


class PagedKVCache:
    """Pools ``keys [num_pages, page_size, Hkv, D]`` and ``values [num_pages, page_size, Hkv, Dv]`` in ``dtype`` (the
    shape ``paged_attention`` reads; views of head-major storage); sequences are ids handed out by ``add`` or
    ``fork``."""

    def __init__(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int, value_dim: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        value_dim = head_dim if value_dim is None else value_dim
        for name, n in (("num_pages", num_pages), ("page_size", page_size), ("kv_heads", kv_heads),
                        ("head_dim", head_dim), ("value_dim", value_dim)):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        if dtype not in SUPPORTED_DTYPES:
            supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
            raise ValueError(f"dtype must be one the kernels compute ({supported}), got {dtype!r}")
        self.page_size = page_size
        # stored head-major, [num_pages, Hkv, page_size, D]: a head's keys of one page are one run of memory, which
        # the native kernel streams (the NHD order puts them Hkv * D apart: 1.3-1.9x slower decode, measured);
        # seen in paged_attention's [num_pages, page_size, Hkv, D] order through a permuted view
        storage = dict(dtype=dtype, device=device)
        self.keys = torch.zeros(num_pages, kv_heads, page_size, head_dim, **storage).permute(0, 2, 1, 3)
        self.values = torch.zeros(num_pages, kv_heads, page_size, value_dim, **storage).permute(0, 2, 1, 3)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: the lowest ids first
        self._references = [0] * num_pages  # sequences holding each page
        self._sequences: dict[int, _Sequence] = {}
        self._next_id = 0

    @property
    def num_pages(self) -> int:
        return self.keys.shape[0]

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def nbytes(self) -> int:
        """Bytes of the pools (every page, used or not)."""
        return self.keys.nbytes + self.values.nbytes

    def length(self, seq: int) -> int:
        return self._get(seq).length

    def add(self) -> int:
        """A new empty sequence; returns its id."""
        seq, self._next_id = self._next_id, self._next_id + 1
        self._sequences[seq] = _Sequence()
        return seq

    def fork(self, seq: int) -> int:
        """A new sequence holding ``seq``'s tokens: it shares every page (no copy until one of them writes to a
        shared, partly filled page); returns its id."""
        parent = self._get(seq)
        child = self.add()
        self._sequences[child] = _Sequence(list(parent.pages), parent.length)
        for page in parent.pages:
            self._references[page] += 1
        return child

    def free(self, seq: int) -> None:
        """Forget ``seq``; pages no other sequence holds return to the pool."""
        for page in self._get(seq).pages:
            self._release(page)
        del self._sequences[seq]

    def truncate(self, seq: int, length: int) -> None:
        """Roll ``seq`` back to its first ``length`` tokens (rejected draft tokens, a retried step)."""
        sequence = self._get(seq)
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= sequence.length:
            raise ValueError(f"length must be an int in [0, {sequence.length}] (sequence {seq}'s tokens), "
                             f"got {length!r}")
        keep = -(-length // self.page_size)
        for page in sequence.pages[keep:]:
            self._release(page)
        sequence.pages, sequence.length = sequence.pages[:keep], length

    def append(self, seqs: list[int], keys: torch.Tensor, values: torch.Tensor, indptr: torch.Tensor) -> None:
        """Write packed new tokens: ``keys [N, Hkv, D]``, ``values [N, Hkv, Dv]``, sequence ``seqs[i]`` gets rows
        ``indptr[i] .. indptr[i+1]-1`` at its next positions."""
        counts = self._check_append(seqs, keys, values, indptr)
        self._reserve(seqs, counts)  # pages for every sequence first: all or nothing
        starts = indptr.tolist()
        for seq, start, count in zip(seqs, starts, counts):
            sequence = self._sequences[seq]
            for offset in range(count):
                page, slot = divmod(sequence.length + offset, self.page_size)
                self.keys[sequence.pages[page], slot] = keys[start + offset]
                self.values[sequence.pages[page], slot] = values[start + offset]
            sequence.length += count

    def tables(self, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(page_table [B, max_pages] int64, kv_lens [B] int64)`` of these sequences for ``paged_attention``;
        columns past a sequence's pages hold 0 (never read)."""
        rows = [self._get(seq) for seq in seqs]
        width = max([len(s.pages) for s in rows] + [1])
        table = torch.zeros(len(rows), width, dtype=torch.long)
        for b, sequence in enumerate(rows):
            table[b, :len(sequence.pages)] = torch.tensor(sequence.pages, dtype=torch.long)
        lengths = torch.tensor([s.length for s in rows], dtype=torch.long)
        return table.to(self.keys.device), lengths.to(self.keys.device)

    def _get(self, seq: int) -> _Sequence:
        if seq not in self._sequences:
            raise ValueError(f"no sequence {seq!r} in this cache (its sequences: {sorted(self._sequences)})")
        return self._sequences[seq]

    def _release(self, page: int) -> None:
        self._references[page] -= 1
        if self._references[page] == 0:
            self._free.append(page)

    def _check_append(self, seqs, keys, values, indptr) -> list[int]:
        for seq in seqs:
            self._get(seq)
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"each sequence may appear once per append, got {seqs}")
        heads, d, dv = self.keys.shape[2], self.keys.shape[3], self.values.shape[3]
        for name, x, width in (("keys", keys, d), ("values", values, dv)):
            if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape[1:]) != (heads, width):
                raise ValueError(f"{name} must be [N, Hkv, E] = [N, {heads}, {width}], got "
                                 f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if keys.shape[0] != values.shape[0]:
            raise ValueError(f"keys and values must have the same N, got {keys.shape[0]} and {values.shape[0]}")
        if not isinstance(indptr, torch.Tensor) or indptr.dim() != 1 or indptr.shape[0] != len(seqs) + 1:
            raise ValueError(f"indptr must be an int tensor [len(seqs) + 1] = [{len(seqs) + 1}]")
        starts = indptr.tolist()
        counts = [b - a for a, b in zip(starts, starts[1:])]
        if starts[0] != 0 or starts[-1] != keys.shape[0] or any(c < 0 for c in counts):
            raise ValueError(f"indptr must run from 0 to N = {keys.shape[0]} without decreasing, got {starts}")
        return counts

    def _reserve(self, seqs: list[int], counts: list[int]) -> None:
        """Give each sequence the pages its new tokens need, copying a shared partly filled last page first."""
        plans = []
        for seq, count in zip(seqs, counts):
            sequence = self._sequences[seq]
            shared_tail = (count > 0 and sequence.length % self.page_size != 0
                           and self._references[sequence.pages[-1]] > 1)
            new = -(-(sequence.length + count) // self.page_size) - len(sequence.pages)
            plans.append((sequence, shared_tail, new))
        needed = sum(new + shared for _, shared, new in plans)
        if needed > len(self._free):
            raise ValueError(f"the pool has {len(self._free)} free pages of {self.page_size} tokens and this append "
                             f"needs {needed}: free finished sequences or make the pool larger (num_pages)")
        for sequence, shared_tail, new in plans:
            if shared_tail:  # copy on write: this sequence gets its own copy of the shared, partly filled page
                old, copy = sequence.pages[-1], self._free.pop()
                self.keys[copy], self.values[copy] = self.keys[old], self.values[old]
                self._references[copy] = 1
                self._release(old)
                sequence.pages[-1] = copy
            for _ in range(new):
                page = self._free.pop()
                self._references[page] = 1
                sequence.pages.append(page)
