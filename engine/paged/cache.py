"""A paged KV cache: one pool of fixed-size pages per layer, each sequence a list of pages.

A contiguous cache reserves the longest length for every row; a paged one gives each sequence pages as it grows,
so a batch of ragged requests holds at most one partly filled page per sequence beyond its tokens, and sequences
that share a prefix (beams, parallel samples, one system prompt) share its pages::

    page_size 4                     pool: [p0 p1 p2 p3 p4 ...]
    sequence 0: 6 tokens   pages [p3, p0]     p0 half full
    fork(0) -> sequence 1  pages [p3, p0]     shared: both hold a reference
    append 1 token to 1    p0 is shared and partly full: copied to p1 first (copy on write), then written
                           sequence 1: pages [p3, p1]; sequence 0 still reads p0 unchanged

With a sliding ``window`` W (keys a query sees, its own included), a step's queries sit at positions >= the
sequence's length L before the step and see keys j with ``pos - j < W``, so keys ``<= L - W`` are never read again:
``append`` first releases every page whose keys all lie there (``release_before(seq, L - W + 1)``). A released page
stays in the sequence's list as ``None`` and ``tables`` writes -1 for it; the pool gets the page back once no other
sequence holds it. A sequence of one-token decode steps so holds at most ``ceil(W / page_size) + 1`` pages::

    window 6, page_size 4, 13 keys (0..12) before a decode step: its query at 13 sees keys 8..13
        pages   [p3    p0    p5     p1]     keys 0..3, 4..7, 8..11, 12
        after   [None  None  p5     p1]     tables() row [-1, -1, 5, 1]; p3, p0 back to the pool

Keys ``[N, Hkv, D]`` of any float dtype go to pools of ``dtype`` (float, or int8 / float8_e4m3fn with a scale per
token and head; engine.paged.pool: where pages come from). ``append`` takes several sequences' packed new tokens
(FlashInfer's ``append_paged_kv_cache``), ``tables`` gives what ``paged_attention`` reads, ``commit_tree`` keeps a
draft tree's accepted path, ``compact`` makes each sequence's pages one run. A refused call leaves the cache as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.masks.window import check_window
from engine.paged.compaction import Compaction
from engine.paged.pool import PagePool, followers
from engine.paged.tables import RELEASED
from engine.paged.tree_commit import TreeCommit
from engine.quantized import QuantizedKV

__all__ = ["PagedKVCache", "Slots"]


class Slots(NamedTuple):
    """Where a step's packed new rows go, the same in every layer: row i to slot ``slots[i]`` of page ``pages[i]``."""

    pages: torch.Tensor
    slots: torch.Tensor


@dataclass
class _Sequence:
    pages: list[int | None] = field(default_factory=list)  # None: released (a prefix of the list)
    length: int = 0
    appended: int = 0  # rows its last extend added (a draft tree, for commit_tree)

    @property
    def released(self) -> int:
        """Leading pages released (their keys are gone)."""
        return next((i for i, page in enumerate(self.pages) if page is not None), len(self.pages))


class PagedKVCache(TreeCommit, Compaction):
    """Pools ``keys [num_pages, page_size, Hkv, D]`` and ``values [num_pages, page_size, Hkv, Dv]`` in ``dtype`` (the
    shape ``paged_attention`` reads; views of engine.paged.pool's storage; ``QuantizedKV`` for int8 / e4m3fn);
    sequences are ids handed out by ``add`` or ``fork``. ``window``: keys a query sees, its own included (at least
    the attention's window), or None to keep every page. ``shared_values``: values are the keys' first columns.
    ``heads_outer=False``: each page's heads side by side in memory, not each head's pages (engine.paged.pool)."""

    def __init__(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int, value_dim: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 window: int | None = None, layers: int = 1, shared_values: bool = False,
                 heads_outer: bool = True) -> None:
        value_dim = head_dim if value_dim is None else value_dim
        for name, n in (("num_pages", num_pages), ("page_size", page_size), ("kv_heads", kv_heads),
                        ("head_dim", head_dim), ("value_dim", value_dim), ("layers", layers)):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        check_window(window)
        self._pool = PagePool(num_pages, page_size, kv_heads, head_dim, value_dim, dtype, device, layers, shared_values,
                              heads_outer)
        self.page_size, self.window, self.layers = page_size, window, layers
        self.keys, self.values = self._pool.keys, self._pool.values  # layer 0's pools
        self._sequences: dict[int, _Sequence] = {}
        self._next_id = 0
        self.extends = 0  # extend calls so far: a model's step names the one it was made by

    @property
    def num_pages(self) -> int:
        return self._pool.num_pages

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - self._pool.free_pages

    @property
    def nbytes(self) -> int:
        """Bytes of the pools (every page, used or not; a quantized pool's scales included)."""
        return self._pool.nbytes

    def length(self, seq: int) -> int:
        return self._get(seq).length

    def pages_held(self, seq: int) -> int:
        """Pages ``seq`` holds (shared ones included; released ones not)."""
        return sum(page is not None for page in self._get(seq).pages)

    def add(self) -> int:
        """A new empty sequence; returns its id."""
        seq, self._next_id = self._next_id, self._next_id + 1
        self._sequences[seq] = _Sequence()
        return seq

    def fork(self, seq: int) -> int:
        """A new sequence holding ``seq``'s tokens: it shares every live page (no copy until one of them writes to
        a shared, partly filled page) and has the same pages released; returns its id."""
        parent, child = self._get(seq), self.add()
        self._sequences[child] = _Sequence(list(parent.pages), parent.length, parent.appended)
        for page in [page for page in parent.pages if page is not None]:
            self._pool.hold(page)
        return child

    def free(self, seq: int) -> None:
        """Forget ``seq``; pages no other sequence holds return to the pool."""
        for page in [page for page in self._get(seq).pages if page is not None]:
            self._pool.drop(page)
        del self._sequences[seq]

    def release_before(self, seq: int, position: int) -> None:
        """Release ``seq``'s pages whose keys all sit before ``position`` (no later query reads them): each becomes
        None in its list (-1 in ``tables``) and returns to the pool when no other sequence holds it."""
        sequence = self._get(seq)
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position <= sequence.length:
            raise ValueError(f"position must be an int in [0, {sequence.length}] (sequence {seq}'s tokens), "
                             f"got {position!r}")
        self._release(sequence, self._releasable(sequence, position))

    def truncate(self, seq: int, length: int) -> None:
        """Roll ``seq`` back to its first ``length`` tokens (rejected draft tokens, a retried step). Released keys do
        not come back: the next query (at ``length``) must not need one, so ``length`` must leave every released
        key outside its window (at least the first kept key position, plus ``window - 1`` with a window)."""
        sequence = self._get(seq)
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= sequence.length:
            raise ValueError(f"length must be an int in [0, {sequence.length}] (sequence {seq}'s tokens), "
                             f"got {length!r}")
        first_kept = sequence.released * self.page_size  # keys before it are gone
        shortest = first_kept + (self.window - 1 if self.window is not None and first_kept else 0)
        if length < shortest:
            window = "" if self.window is None else f" (window {self.window})"
            raise ValueError(f"cannot truncate sequence {seq} to {length} tokens: its keys 0..{first_kept - 1} were "
                             f"released and a query at position {length}{window} could need one; the shortest length "
                             f"it can roll back to is {shortest} (or free it and start again)")
        keep = -(-length // self.page_size)
        for page in sequence.pages[keep:]:
            self._pool.drop(page)
        sequence.pages, sequence.length, sequence.appended = sequence.pages[:keep], length, 0

    def layer(self, index: int) -> tuple:
        """``(keys, values)``: layer ``index``'s pools (``keys``/``values`` are layer 0's)."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.layers:
            raise ValueError(f"layer must be an int in [0, {self.layers}), got {index!r}")
        return self._pool.layer_keys[index], self._pool.layer_values[index]

    def append(self, seqs: list[int], keys: torch.Tensor, values: torch.Tensor | None, indptr: torch.Tensor) -> None:
        """Write packed new tokens: ``keys [N, Hkv, D]``, ``values [N, Hkv, Dv]`` (any float dtype), sequence
        ``seqs[i]`` gets rows ``indptr[i] .. indptr[i+1]-1`` at its next positions. With a window, each sequence's
        pages that this step's queries (at positions >= its length) cannot see are released first. A cache of
        several layers takes ``extend`` once per step and ``write`` per layer instead."""
        if self.layers != 1:
            raise ValueError(f"this cache holds {self.layers} layers: extend(seqs, indptr) once per step, then "
                             f"write(slots, keys, values, layer) for each layer")
        self._check_rows(keys, values)
        slots = self.extend(seqs, indptr, keys.shape[0])
        if keys.shape[0]:
            self._pool.write(slots.pages, slots.slots, keys, values)  # [N] each (the rows checked above)

    def extend(self, seqs: list[int], indptr: torch.Tensor, count: int | None = None) -> Slots:
        """Make room for a step's packed new tokens in every layer: sequence ``seqs[i]`` grows by ``indptr[i+1] -
        indptr[i]`` tokens (releasing, with a window, the pages this step's queries cannot see; copying a shared,
        partly filled last page first); returns where each new row goes. All or nothing: a refused call changes
        nothing. ``count``: the rows the step has (checked against ``indptr``)."""
        counts = self.check_append(seqs, count, indptr)
        released = self._window_releases(seqs)  # per sequence, the indices of its pages to release
        self._reserve(seqs, counts, released)  # all or nothing: refuses before anything changes
        self.extends += 1
        pages, slots = [], []  # where each new row goes
        for seq, n in zip(seqs, counts):
            sequence = self._sequences[seq]
            sequence.appended = n
            if n == 0:
                continue
            positions = torch.arange(sequence.length, sequence.length + n)  # [n]
            first = sequence.length // self.page_size  # the page of its first new token (never released)
            owned = torch.tensor(sequence.pages[first:], dtype=torch.long)  # [pages it writes to]
            pages.append(owned[positions // self.page_size - first])  # [n]
            slots.append(positions % self.page_size)  # [n]
            sequence.length += n
        device = self.keys.data.device if isinstance(self.keys, QuantizedKV) else self.keys.device
        return Slots(*(torch.cat(rows or [torch.zeros(0, dtype=torch.long)]).to(device) for rows in (pages, slots)))

    def write(self, slots: Slots, keys: torch.Tensor, values: torch.Tensor | None, layer: int = 0) -> None:
        """Layer ``layer``'s new keys ``[N, Hkv, D]`` and values ``[N, Hkv, Dv]`` to the rows ``extend`` gave."""
        self._check_rows(keys, values)
        if keys.shape[0] != slots.pages.shape[0]:
            raise ValueError(f"this step made room for {slots.pages.shape[0]} rows, got {keys.shape[0]}")
        self.layer(layer)  # (validates the index)
        if keys.shape[0]:
            self._pool.write(slots.pages, slots.slots, keys, values, layer)  # [N] each

    def tables(self, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(page_table [B, max_pages] int64, kv_lens [B] int64)`` of these sequences for ``paged_attention``;
        a released page is ``RELEASED`` (-1: no query of a step after its release sees it); columns past a
        sequence's pages hold 0 (never read)."""
        rows = [self._get(seq) for seq in seqs]
        width = max([len(s.pages) for s in rows] + [1])
        table = torch.zeros(len(rows), width, dtype=torch.long)
        for b, pages in enumerate([[RELEASED if p is None else p for p in s.pages] for s in rows]):
            table[b, :len(pages)] = torch.tensor(pages, dtype=torch.long)
        lengths = torch.tensor([s.length for s in rows], dtype=torch.long)
        return table.to(self.keys.device), lengths.to(self.keys.device)

    def _get(self, seq: int) -> _Sequence:
        if seq not in self._sequences:
            raise ValueError(f"no sequence {seq!r} in this cache (its sequences: {sorted(self._sequences)})")
        return self._sequences[seq]

    def _releasable(self, sequence: _Sequence, position: int) -> range:
        """Indices of the live pages whose keys all sit before ``position``: page i holds keys ``i*P .. (i+1)*P-1``."""
        return range(sequence.released, position // self.page_size)

    def _release(self, sequence: _Sequence, pages: range) -> None:
        for i in pages:
            self._pool.drop(sequence.pages[i])
            sequence.pages[i] = None

    def _window_releases(self, seqs: list[int]) -> list[range]:
        """Per sequence, its pages this step's queries cannot see (keys all <= length - window)."""
        return [range(0) if self.window is None else self._releasable(s, max(s.length - self.window + 1, 0))
                for s in map(self._sequences.get, seqs)]

    def check_append(self, seqs: list[int], count: int | None, indptr: torch.Tensor) -> list[int]:
        """The new tokens per sequence of an ``append`` of ``count`` rows (None: as many as ``indptr`` says); a
        ValueError for an unknown or repeated sequence or a bad ``indptr`` (an integer tensor ``[len(seqs) + 1]``
        from 0 to ``count``, never decreasing). Changes nothing (a caller checks before it computes its rows)."""
        for seq in seqs:
            self._get(seq)
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"each sequence may appear once per append, got {seqs}")
        if (not isinstance(indptr, torch.Tensor) or indptr.dim() != 1 or indptr.shape[0] != len(seqs) + 1
                or indptr.is_floating_point() or indptr.is_complex() or indptr.dtype == torch.bool):
            got = (f"{indptr.dtype} {list(indptr.shape)}" if isinstance(indptr, torch.Tensor)
                   else type(indptr).__name__)
            raise ValueError(f"indptr must be an int tensor [len(seqs) + 1] = [{len(seqs) + 1}], got {got}")
        starts = indptr.tolist()
        counts = [b - a for a, b in zip(starts, starts[1:])]
        count = starts[-1] if count is None else count
        if starts[0] != 0 or starts[-1] != count or any(c < 0 for c in counts):
            raise ValueError(f"indptr must run from 0 to N = {count} without decreasing, got {starts}")
        return counts

    def _check_rows(self, keys, values) -> None:
        heads, d, dv = self.keys.shape[2], self.keys.shape[3], self.values.shape[3]
        values = self._pool.shared_rows(keys, values) if self._pool.shared_values else values  # (keys' columns)
        for name, x, width in (("keys", keys, d), ("values", values, dv)):
            if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape[1:]) != (heads, width):
                raise ValueError(f"{name} must be [N, Hkv, E] = [N, {heads}, {width}], got "
                                 f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
            if not x.is_floating_point():
                raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if keys.shape[0] != values.shape[0]:
            raise ValueError(f"keys and values must have the same N, got {keys.shape[0]} and {values.shape[0]}")

    def _reserve(self, seqs: list[int], counts: list[int], released: list[range]) -> None:
        """Release the window's pages, then give each sequence the pages its new tokens need, copying a shared
        partly filled last page first; checks the pool has them (counting the pages the releases free) first."""
        plans = []
        for seq, count in zip(seqs, counts):
            sequence = self._sequences[seq]
            shared_tail = (count > 0 and sequence.length % self.page_size != 0
                           and self._pool.references(sequence.pages[-1]) > 1)  # a partial page is never released
            new = -(-(sequence.length + count) // self.page_size) - len(sequence.pages)
            plans.append((sequence, shared_tail, new))
        needed = sum(new + shared for _, shared, new in plans)
        freed = self._pool.freed_by([s.pages[i] for (s, _, _), pages in zip(plans, released) for i in pages])
        if needed > self._pool.free_pages + freed:
            released_text = f" ({freed} of them released by the window)" if freed else ""
            raise ValueError(f"the pool has {self._pool.free_pages + freed} free pages of {self.page_size} tokens"
                             f"{released_text} and this append needs {needed}: free finished sequences or make the "
                             f"pool larger (num_pages)")
        for (sequence, _, _), pages in zip(plans, released):  # every release first: the check counted their pages
            self._release(sequence, pages)
        claimed = followers(s.pages for s in self._sequences.values()) if needed else None  # (engine.paged.pool)
        for sequence, shared_tail, new in plans:
            if shared_tail:  # copy on write: this sequence gets its own copy of the shared, partly filled page
                old, sequence.pages[-1] = sequence.pages[-1], self._pool.take(sequence.pages[:-1], 1, claimed)[0]
                self._pool.copy(old, sequence.pages[-1])
                self._pool.drop(old)
            sequence.pages += self._pool.take(sequence.pages, new, claimed)
