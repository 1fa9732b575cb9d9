"""Keep a verified draft tree's accepted path in a paged cache: speculative decoding's commit step.

A step appends a tree of N draft tokens to a sequence of ``past`` tokens (node i's keys and values at slot
``past + i`` of every layer), verifies the whole tree in one call (engine.masks.tree) and accepts a root path:
nodes ``accepted[0], accepted[1], ...``, the first a child of the cached tokens (parent -1), each the parent of the
next. ``commit_tree`` moves the accepted nodes' rows to slots ``past, past + 1, ...`` (every layer's keys and
values; a quantized pool's scales with its data) and drops the other nodes: the sequence then holds ``past +
len(accepted)`` tokens, the same rows as decoding the accepted tokens one at a time would have written::

    parents  [-1, 0, 0, 1, 2]      accepted [0, 2, 4]
    slots    past + [0  1  2  3  4]   ->   past + [0  1  2]   holding nodes 0, 2, 4; nodes 1 and 3 dropped

A node's index is at least its depth, so rows only move towards the sequence's start; every moved row is read
before any is written. Pages past the new length return to the pool (or lose this sequence's reference). A page
that receives a row but another sequence holds too (a fork taken after the append) is copied first (copy on
write): the other sequence still reads its tree as it was. All or nothing: a refused call changes nothing.
"""

from __future__ import annotations

import torch

from engine.masks.tree import tree_depths
from engine.paged.pool import followers
from engine.quantized import QuantizedKV

__all__ = ["TreeCommit", "check_path", "commit_tree"]


class TreeCommit:
    """``PagedKVCache.commit_tree`` (a base of the cache, kept here beside the moves it makes; it reads the cache's
    sequences, pool and page size)."""

    def commit_tree(self, seq: int, parents, accepted) -> None:
        """Keep the root path ``accepted`` (node indices, each the parent of the next) of the draft tree ``parents``
        (engine.masks.tree) that ``seq``'s last extend appended, at its next slots; drop the other nodes (every
        layer). A ValueError, and no change, for a path that is not a root path of that tree."""
        claimed = followers(s.pages for s in self._sequences.values())  # (where a copied page must not go)
        commit_tree(self._get(seq), self._pool, self.page_size, seq, parents, accepted, self.window, claimed)


def check_path(parents, accepted, appended: int, seq: int) -> list[int]:
    """``accepted`` as a list of node indices, checked against the tree ``parents`` (engine.masks.tree) and the
    ``appended`` rows the sequence ``seq`` added in its last extend; a ValueError says what was expected."""
    depths = tree_depths(parents)  # (a bad tree is refused here)
    n = depths.shape[0]
    if appended != n:
        raise ValueError(f"commit_tree keeps a path of the tree sequence {seq} appended in its last extend: that "
                         f"extend appended {appended} rows, the tree has {n} nodes (len(parents))")
    if isinstance(accepted, torch.Tensor):
        accepted = accepted.tolist() if accepted.dim() == 1 and not accepted.is_floating_point() else None
    if (not isinstance(accepted, (list, tuple))
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in accepted)):
        raise ValueError(f"accepted must be a list of node indices (ints), got {accepted!r}")
    parents = [int(p) for p in torch.as_tensor(parents, dtype=torch.long).tolist()]
    for depth, node in enumerate(accepted):
        expected = -1 if depth == 0 else accepted[depth - 1]
        if not 0 <= node < n or parents[node] != expected:
            got = "out of range" if not 0 <= node < n else f"its parent is {parents[node]}"
            raise ValueError(f"accepted must be a root path of the tree of {n} nodes (accepted[0]'s parent -1, each "
                             f"next node a child of the one before): accepted[{depth}] = {node} should be a node in "
                             f"[0, {n}) whose parent is {expected}, but {got}; accepted = {list(accepted)}")
    return list(accepted)


def commit_tree(sequence, pool, page_size: int, seq: int, parents, accepted, window: int | None = None,
                claimed: set[int] | None = None) -> None:
    """Keep the accepted root path of the tree ``sequence`` (engine.paged.cache's record of sequence ``seq``: its
    pages, length and rows appended last) appended last; ``pool``: the cache's PagePool, ``window`` its window,
    ``claimed`` its sequences' followers (``PagePool.take``'s). See the module's text."""
    path = check_path(parents, accepted, sequence.appended, seq)
    past = sequence.length - sequence.appended
    kept = past + len(path)
    first_kept = sequence.released * page_size  # keys before it were released (as truncate's rule)
    if kept < first_kept + (window - 1 if window is not None and first_kept else 0):
        raise ValueError(f"sequence {seq}'s keys 0..{first_kept - 1} were released (release_before after the append): "
                         f"keeping {len(path)} of its tree's nodes leaves {kept} tokens, and the next query could need "
                         f"a released key")
    moves = [(past + node, past + depth) for depth, node in enumerate(path) if node != depth]  # (from, to) slots
    released = sorted({slot // page_size for move in moves for slot in move if slot < first_kept})
    if released:
        raise ValueError(f"sequence {seq}'s tree rows sit in released pages {released} (release_before after the "
                         f"append): nothing to keep them from")
    keep_pages = -(-kept // page_size)
    tail = [page for page in sequence.pages[keep_pages:] if page is not None]  # pages wholly past the kept tokens
    shared = sorted({to // page_size for _, to in moves if pool.references(sequence.pages[to // page_size]) > 1})
    available = pool.free_pages + pool.freed_by(tail)
    if len(shared) > available:
        raise ValueError(f"commit_tree must copy {len(shared)} pages sequence {seq} shares with another before "
                         f"writing to them, and the pool has {available} free: free finished sequences or make the "
                         f"pool larger (num_pages)")
    rows = _read(sequence.pages, pool, [source for source, _ in moves], page_size)  # every row before any write
    for page in tail:
        pool.drop(page)
    sequence.pages, sequence.length, sequence.appended = sequence.pages[:keep_pages], kept, 0
    for i in shared:  # copy on write: the other holders keep the page as it was
        old, sequence.pages[i] = sequence.pages[i], pool.take(sequence.pages[:i], 1, claimed)[0]
        pool.copy(old, sequence.pages[i])
        pool.drop(old)
    if moves:
        pages, slots = _where(sequence.pages, [target for _, target in moves], page_size, pool)
        for tensor, moved in zip(_tensors(pool), rows):
            tensor[pages, slots] = moved  # [moves, Hkv, E] (a scale: [moves, Hkv])


def _tensors(pool) -> list[torch.Tensor]:
    """Every layer's key and value tensors of the pool (a quantized pool's data and scales)."""
    tensors = []
    for kv in pool.layer_keys + pool.layer_values:
        tensors += [kv.data, kv.scale] if isinstance(kv, QuantizedKV) else [kv]
    return tensors


def _where(pages: list, slots: list[int], page_size: int, pool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pages [n], slots [n])`` int64 on the pools' device of a sequence's token slots ``slots``."""
    device = _tensors(pool)[0].device
    return (torch.tensor([pages[s // page_size] for s in slots], dtype=torch.long, device=device),
            torch.tensor([s % page_size for s in slots], dtype=torch.long, device=device))


def _read(pages: list, pool, slots: list[int], page_size: int) -> list[torch.Tensor]:
    """Copies of the rows at a sequence's token ``slots`` in every tensor of the pool (``_tensors``' order)."""
    if not slots:
        return []
    where = _where(pages, slots, page_size, pool)
    return [tensor[where] for tensor in _tensors(pool)]  # advanced indexing: copies
