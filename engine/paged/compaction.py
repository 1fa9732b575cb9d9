"""``PagedKVCache.compact``: move a cache's pages so that each sequence's pages are one run again.

After requests come and go, a nearly full pool's sequences hold their pages in short runs, and a decode reads a
head's keys a run at a time (engine.paged.pool: 8.8 pages per run with 96.5% of a churned pool in use read at
0.92-0.95x the time of the lowest-id free list of before, one run per sequence at 0.84-0.91x). ``compact`` renumbers
the held pages: sequences in the order they were added, each one's pages in its order, one after another, a page
several sequences share placed with the first of them (a fork's shared prefix stays in its parent's run); the free
pages are spread as equal gaps after the sequences, so each keeps room to grow into::

    before   pages 0..11:  a a b . a c b b . c . a      (a: pages 0, 1, 4, 11; b: 2, 6, 7; c: 5, 9)
    after                  a a a a . b b b . c c .      (gaps of 1: 3 free pages over 3 sequences)

The rows move in every layer (PagePool.renumber: the moved pages read before any is written, one copy of them per
pool at a time); the sequences' page lists follow, so ``tables`` afterwards names the new pages. A plan made before
reads the old tables: plan the next step after compacting (a model's step makes its plan per step anyway).
"""

from __future__ import annotations

__all__ = ["Compaction"]


class Compaction:
    """``PagedKVCache.compact`` (a base of the cache; it reads the cache's sequences and pool)."""

    def compact(self) -> int:
        """Renumber the pages so that each sequence's own pages follow on (the module's text); returns how many
        pages moved."""
        sequences = [self._sequences[seq] for seq in sorted(self._sequences)]
        owners: dict[int, int] = {}  # page -> the first sequence holding it (its place in `sequences`)
        for index, sequence in enumerate(sequences):
            for page in sequence.pages:
                if page is not None:
                    owners.setdefault(page, index)
        holding = sorted(set(owners.values()))
        gap = self._pool.free_pages // max(1, len(holding))
        moves: dict[int, int] = {}
        for rank, index in enumerate(holding):  # (rank: the sequences placed before this one, each a gap)
            for page in sequences[index].pages:
                if page is not None and owners[page] == index and page not in moves:
                    moves[page] = len(moves) + gap * rank
        self._pool.renumber(moves)
        for sequence in sequences:
            sequence.pages = [None if page is None else moves[page] for page in sequence.pages]
        return sum(page != to for page, to in moves.items())
