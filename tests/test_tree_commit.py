"""PagedKVCache.commit_tree: after a draft tree was appended and verified, the cache holds exactly what decoding the
accepted path one token at a time would have written (every layer; int8 data and scales), pages past the new length
go back to the pool, a fork sharing the tree's pages still reads its tree, and a refused call changes nothing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import PagedKVCache
from engine.quantized import QuantizedKV

HKV, D, LAYERS = 2, 4, 2


def rows(n, seed):
    """``n`` distinct rows per layer: ``[(keys [n, Hkv, D], values [n, Hkv, D]) per layer]``."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)) for _ in range(LAYERS)]


def append(cache, seq, layer_rows, select=None):
    """Append rows ``select`` (default all) of ``layer_rows`` to ``seq`` in one extend, every layer (a cache of
    shared rows takes the keys alone: its values are their first columns)."""
    n = layer_rows[0][0].shape[0] if select is None else len(select)
    slots = cache.extend([seq], torch.tensor([0, n]))
    shared = cache.values.data_ptr() == cache.keys.data_ptr() if isinstance(cache.keys, torch.Tensor) else False
    for layer, (k, v) in enumerate(layer_rows):
        k, v = (k, v) if select is None else (k[select], v[select])
        cache.write(slots, k, None if shared else v, layer)


def read_back(cache, seq):
    """Every layer's key and value tensors (a quantized pool: data and scales) of ``seq``'s tokens, read through
    its page table slot by slot: key j at page ``table[j // P]``, slot ``j % P``."""
    table, lens = cache.tables([seq])
    p = cache.page_size
    where = [(int(table[0, j // p]), j % p) for j in range(int(lens[0]))]
    out = []
    for layer in range(cache.layers):
        for pool in cache.layer(layer):
            for tensor in ([pool.data, pool.scale] if isinstance(pool, QuantizedKV) else [pool]):
                out.append(torch.stack([tensor[page, slot] for page, slot in where]) if where else tensor[:0, 0])
    return out


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def live_pages(cache, seqs):
    table, lens = cache.tables(seqs)
    return {int(table[b, j]) for b in range(len(seqs)) for j in range(-(-int(lens[b]) // cache.page_size))}


def root_path(parents, node):
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@st.composite
def commits(draw):
    n = draw(st.integers(1, 12))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    path = root_path(parents, draw(st.integers(0, n - 1)))
    accepted = path[:draw(st.integers(0, len(path)))]  # any root path: a prefix of a node's, empty included
    return (parents, accepted, draw(st.integers(0, 20)), draw(st.integers(1, 16)),
            draw(st.sampled_from(["none", "before the tree", "after the tree"])), draw(st.integers(0, 10_000)))


@settings(max_examples=60, deadline=None)
@given(commits(), st.sampled_from([(torch.float32, False), (torch.int8, False), (torch.float32, True)]))
def test_commit_tree_equals_decoding_the_accepted_path_one_token_at_a_time(case, pool):
    parents, accepted, past, page_size, fork, seed = case
    (dtype, shared), n = pool, len(parents)  # shared: the values are the keys' first columns (one row per token)
    prefix, nodes = rows(past, seed), rows(n, seed + 1)
    pages = 3 * (-(-(past + n) // page_size) + 1)
    kinds = {"dtype": dtype, "layers": LAYERS, "value_dim": D // 2 if shared else D, "shared_values": shared}
    cache = PagedKVCache(pages, page_size, HKV, D, **kinds)
    seq = cache.add()
    append(cache, seq, prefix)
    other = cache.fork(seq) if fork == "before the tree" else None  # shares the prefix's pages
    append(cache, seq, nodes)
    if fork == "after the tree":
        other = cache.fork(seq)  # shares the tree's pages: commit_tree must not write into them
    other_before = None if other is None else read_back(cache, other)
    cache.commit_tree(seq, parents, accepted)

    oracle = PagedKVCache(pages, page_size, HKV, D, **kinds)
    plain = oracle.add()
    append(oracle, plain, prefix)
    for node in accepted:  # one decode step per accepted token
        append(oracle, plain, nodes, [node])
    assert cache.length(seq) == past + len(accepted)
    assert same(read_back(cache, seq), read_back(oracle, plain))
    if other is not None:
        assert same(read_back(cache, other), other_before)  # the fork reads what it read before
    held = [seq] if other is None else [seq, other]
    assert cache.pages_in_use == len(live_pages(cache, held))  # every page past the kept tokens came back
    assert cache.pages_held(seq) == -(-(past + len(accepted)) // page_size)


def test_a_fork_taken_after_the_append_keeps_its_own_path():
    # two candidates: the sequence and its fork commit different paths of one tree, each equal to its own decoding
    parents, past, page_size = [-1, 0, 0, 1, 2, 2], 5, 4
    prefix, nodes = rows(past, 0), rows(len(parents), 1)
    cache = PagedKVCache(12, page_size, HKV, D, layers=LAYERS)
    seq = cache.add()
    append(cache, seq, prefix)
    append(cache, seq, nodes)
    child = cache.fork(seq)
    cache.commit_tree(seq, parents, [0, 1, 3])
    cache.commit_tree(child, parents, [0, 2, 5])
    for s, path in ((seq, [0, 1, 3]), (child, [0, 2, 5])):
        oracle = PagedKVCache(12, page_size, HKV, D, layers=LAYERS)
        plain = oracle.add()
        append(oracle, plain, prefix)
        for node in path:
            append(oracle, plain, nodes, [node])
        assert same(read_back(cache, s), read_back(oracle, plain))
    assert cache.pages_in_use == len(live_pages(cache, [seq, child]))


def test_a_page_copied_on_commit_leaves_the_sequences_followers_free():
    # the commit copies the shared page it writes to; the copy goes where no sequence would grow next (the page after
    # the shared last page is both sequences' follower): the middle of the free pages after it, not their first
    cache = PagedKVCache(16, 4, HKV, D, layers=LAYERS)
    seq = cache.add()
    append(cache, seq, rows(6, 0))
    append(cache, seq, rows(3, 1))  # a tree of 3 nodes at slots 6, 7, 8
    (pages,), _ = cache.tables([seq])
    assert pages.tolist() == [0, 1, 2]  # a fresh pool: from page 0, each page after the last
    child = cache.fork(seq)
    cache.commit_tree(seq, [-1, 0, 0], [0, 2])  # node 2 moves from slot 8 to 7, in page 1, which the child shares
    assert cache.tables([seq])[0].tolist() == [[0, 3 + (13 - 1) // 2]]  # not page 3: both sequences' follower
    assert cache.tables([child])[0].tolist() == [[0, 1, 2]]


def state(cache, seqs):
    pools = [t.clone() for layer in range(cache.layers) for pool in cache.layer(layer)
             for t in ([pool.data, pool.scale] if isinstance(pool, QuantizedKV) else [pool])]
    table, lens = cache.tables(seqs)
    return pools, table, lens, cache.pages_in_use, [cache.pages_held(s) for s in seqs]


def same_state(a, b):
    return same(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) and a[3:] == b[3:]


PARENTS = [-1, 0, 0, 1, 2]


@pytest.mark.parametrize("parents, accepted, message", [
    (PARENTS, [1], r"accepted\[0\] = 1 should be a node in \[0, 5\) whose parent is -1, but its parent is 0"),
    (PARENTS, [0, 3], r"accepted\[1\] = 3 should be a node in \[0, 5\) whose parent is 0, but its parent is 1"),
    (PARENTS, [0, 2, 5], r"accepted\[2\] = 5 should be a node in \[0, 5\) whose parent is 2, but out of range"),
    (PARENTS, [0, 1, 1], r"accepted\[2\] = 1 should be a node"),  # a node twice
    (PARENTS, [-1], r"accepted\[0\] = -1 should be a node"),
    (PARENTS, [0.0], "accepted must be a list of node indices"),
    (PARENTS, [True], "accepted must be a list of node indices"),
    (PARENTS, torch.tensor([0.0]), "accepted must be a list of node indices"),
    (PARENTS, "0", "accepted must be a list of node indices"),
    ([-1, 0, 0, 1], [0], "that extend appended 5 rows, the tree has 4 nodes"),
    ([-1, 1, 0, 1, 2], [0], r"parents\[1\] = 1: a node's parent must be an earlier node"),
], ids=["root not a child of the cache", "a skipped level", "out of range", "repeated", "negative", "float",
        "bool", "float tensor", "string", "wrong tree size", "bad tree"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=str)
def test_a_refused_commit_changes_nothing(parents, accepted, message, dtype):
    cache = PagedKVCache(10, 4, HKV, D, dtype=dtype, layers=LAYERS)
    seq = cache.add()
    append(cache, seq, rows(6, 0))
    append(cache, seq, rows(5, 1))
    other = cache.fork(seq)
    before = state(cache, [seq, other])
    with pytest.raises(ValueError, match=message):
        cache.commit_tree(seq, parents, accepted)
    assert same_state(state(cache, [seq, other]), before)
    cache.commit_tree(seq, PARENTS, torch.tensor([0, 2, 4]))  # the cache still takes a good commit (ints tensor)
    assert cache.length(seq) == 9


def test_a_sequence_that_did_not_just_append_the_tree_is_refused():
    cache = PagedKVCache(10, 4, HKV, D, layers=LAYERS)
    seq, late = cache.add(), cache.add()
    append(cache, seq, rows(6, 0))
    with pytest.raises(ValueError, match="that extend appended 6 rows, the tree has 5 nodes"):
        cache.commit_tree(seq, PARENTS, [0])
    append(cache, seq, rows(5, 1))
    cache.truncate(seq, 11)  # (a rollback forgets the tree)
    with pytest.raises(ValueError, match="that extend appended 0 rows, the tree has 5 nodes"):
        cache.commit_tree(seq, PARENTS, [0])
    append(cache, seq, rows(5, 1))
    cache.extend([seq, late], torch.tensor([0, 0, 1]))  # a later step that gave seq no rows
    before = state(cache, [seq, late])
    with pytest.raises(ValueError, match="that extend appended 0 rows"):
        cache.commit_tree(seq, PARENTS, [0])
    with pytest.raises(ValueError, match="no sequence 7"):
        cache.commit_tree(7, PARENTS, [0])
    assert same_state(state(cache, [seq, late]), before)


def test_a_commit_that_must_copy_a_shared_page_into_a_full_pool_is_refused_unchanged():
    # 4 pages of 4: the prefix (4 tokens) and the tree (8 nodes) fill 3; a fork holds them all; the one free page
    # is taken, so moving node 7 to slot 5 (page 1, shared) has nowhere to copy page 1 to
    parents = [-1, 0, 0, 0, 0, 0, 0, 2]
    cache = PagedKVCache(4, 4, HKV, D, layers=LAYERS)
    seq, filler = cache.add(), cache.add()
    append(cache, seq, rows(4, 0))
    append(cache, seq, rows(8, 1))
    other = cache.fork(seq)
    append(cache, filler, rows(1, 2))
    before = state(cache, [seq, other, filler])
    with pytest.raises(ValueError, match="must copy 1 pages sequence 0 shares with another before writing to them, "
                                         "and the pool has 0 free"):
        cache.commit_tree(seq, parents, [0, 2, 7])
    assert same_state(state(cache, [seq, other, filler]), before)
    cache.free(filler)
    cache.commit_tree(seq, parents, [0, 2, 7])  # now the copy has a page
    assert cache.length(seq) == 7 and cache.pages_in_use == len(live_pages(cache, [seq, other]))


def test_rows_or_a_length_in_released_pages_are_refused():
    cache = PagedKVCache(10, 2, HKV, D, layers=LAYERS)
    seq = cache.add()
    append(cache, seq, rows(2, 0))
    append(cache, seq, rows(5, 1))  # the tree at slots 2..6
    cache.release_before(seq, 4)  # pages 0, 1: slots 0..3
    before = state(cache, [seq])
    with pytest.raises(ValueError, match=r"tree rows sit in released pages \[1\]"):
        cache.commit_tree(seq, PARENTS, [0, 2, 4])  # node 2 would move to slot 3, in page 1
    assert same_state(state(cache, [seq]), before)
    cache.release_before(seq, 6)  # pages 0..2: slots 0..5
    before = state(cache, [seq])
    with pytest.raises(ValueError, match=r"keys 0..5 were released .* leaves 4 tokens"):
        cache.commit_tree(seq, PARENTS, [0, 1])
    assert same_state(state(cache, [seq]), before)
