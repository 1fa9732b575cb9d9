"""PagedKVCache: ragged sequences appended in packed steps read back through paged_attention as attention over each
sequence's own keys; forks share pages and copy a shared partial page before writing; free, roll back, refusals
that leave the cache unchanged, and the memory a ragged batch holds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import PagedKVCache, causal_attention, paged_attention

HKV, HQ, D = 2, 4, 8


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HKV, D, generator=g, dtype=torch.float64), torch.randn(n, HKV, D, generator=g,
                                                                                 dtype=torch.float64)


def attend_all(cache, seqs, q_per_seq):
    """paged_attention of one query per sequence (at its last position) against the cache."""
    table, lens = cache.tables(seqs)
    q = torch.cat(q_per_seq)  # [B, Hq, D]
    return paged_attention(q, cache.keys, cache.values, table, lens, torch.arange(len(seqs) + 1))


def contiguous(q, keys, values):
    """The same query against the sequence's keys held contiguously ([S, Hkv, D] each)."""
    k, v = keys.permute(1, 0, 2)[None], values.permute(1, 0, 2)[None]  # [1, Hkv, S, D]
    return causal_attention(q[None, :, None, :], k, v)[0, :, 0]  # [Hq, D]


@settings(max_examples=30)
@given(st.sampled_from([1, 3, 16]), st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=4), min_size=1,
                                             max_size=4), st.integers(0, 1000))
def test_ragged_appends_read_back_as_each_sequences_own_keys(page_size, steps, seed):
    cache = PagedKVCache(64, page_size, HKV, D, dtype=torch.float64)
    seqs = [cache.add() for _ in steps]
    held = {seq: ([], []) for seq in seqs}
    for round_ in range(max(len(s) for s in steps)):
        counts = [s[round_] if round_ < len(s) else 0 for s in steps]
        keys, values = tokens(sum(counts), seed + round_)
        cache.append(seqs, keys, values, torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist()))
        start = 0
        for seq, count in zip(seqs, counts):
            held[seq][0].append(keys[start:start + count])
            held[seq][1].append(values[start:start + count])
            start += count
    alive = [seq for seq in seqs if cache.length(seq) > 0]
    if not alive:
        return
    g = torch.Generator().manual_seed(seed + 99)
    qs = [torch.randn(1, HQ, D, generator=g, dtype=torch.float64) for _ in alive]
    out = attend_all(cache, alive, qs)
    for i, seq in enumerate(alive):
        keys, values = torch.cat(held[seq][0]), torch.cat(held[seq][1])
        assert cache.length(seq) == keys.shape[0]
        torch.testing.assert_close(out[i], contiguous(qs[i][0], keys, values), rtol=1e-12, atol=1e-12)
    holding = sum(-(-cache.length(seq) // page_size) for seq in seqs)
    assert cache.pages_in_use == holding  # at most one partly filled page per sequence beyond its tokens


def test_a_fork_shares_pages_and_copies_the_shared_partial_page_before_writing():
    cache = PagedKVCache(8, 4, HKV, D, dtype=torch.float64)
    parent = cache.add()
    keys, values = tokens(6, 0)
    cache.append([parent], keys, values, torch.tensor([0, 6]))  # pages: one full, one half
    child = cache.fork(parent)
    assert cache.pages_in_use == 2  # shared, nothing copied
    q = torch.randn(1, HQ, D, dtype=torch.float64)
    before = attend_all(cache, [parent], [q])
    new_keys, new_values = tokens(1, 1)
    cache.append([child], new_keys, new_values, torch.tensor([0, 1]))
    assert cache.pages_in_use == 3  # the half page was copied for the child; the full page is still shared
    table, _ = cache.tables([parent, child])
    assert table[0, 0] == table[1, 0] and table[0, 1] != table[1, 1]
    torch.testing.assert_close(attend_all(cache, [parent], [q]), before, rtol=0, atol=0)  # the parent is unchanged
    want = contiguous(q[0], torch.cat([keys, new_keys]), torch.cat([values, new_values]))
    torch.testing.assert_close(attend_all(cache, [child], [q])[0], want, rtol=1e-12, atol=1e-12)
    cache.free(parent)
    assert cache.pages_in_use == 2  # the shared full page stays with the child
    cache.free(child)
    assert cache.pages_in_use == 0


def test_truncate_rolls_back_to_a_prefix_and_returns_pages():
    cache = PagedKVCache(8, 4, HKV, D, dtype=torch.float64)
    seq = cache.add()
    keys, values = tokens(10, 2)
    cache.append([seq], keys, values, torch.tensor([0, 10]))
    cache.truncate(seq, 5)
    assert cache.length(seq) == 5 and cache.pages_in_use == 2
    q = torch.randn(1, HQ, D, dtype=torch.float64)
    torch.testing.assert_close(attend_all(cache, [seq], [q])[0], contiguous(q[0], keys[:5], values[:5]),
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"length must be an int in \[0, 5\]"):
        cache.truncate(seq, 6)


def test_refused_appends_leave_the_cache_as_it_was():
    cache = PagedKVCache(2, 4, HKV, D, dtype=torch.float64)
    a, b = cache.add(), cache.add()
    keys, values = tokens(5, 3)
    cache.append([a], keys, values, torch.tensor([0, 5]))  # 2 pages: the pool is full
    state = (cache.keys.clone(), cache.pages_in_use, cache.length(a), cache.length(b))
    more, more_values = tokens(4, 4)
    with pytest.raises(ValueError, match="the pool has 0 free pages of 4 tokens and this append needs 1"):
        cache.append([a, b], more, more_values, torch.tensor([0, 3, 4]))  # a fits in its page, b needs a new one
    assert torch.equal(cache.keys, state[0]) and (cache.pages_in_use, cache.length(a), cache.length(b)) == state[1:]
    for bad, match in [(dict(seqs=[a, 7]), "no sequence 7"), (dict(seqs=[a, a]), "each sequence may appear once"),
                       (dict(indptr=torch.tensor([0, 5, 4])), "indptr must run from 0 to N = 4"),
                       (dict(keys=torch.randn(4, 3, D)), r"keys must be \[N, Hkv, E\] = \[N, 2, 8\]")]:
        args = dict(seqs=[a, b], keys=more, values=more_values, indptr=torch.tensor([0, 0, 4])) | bad
        with pytest.raises(ValueError, match=match):
            cache.append(**args)
    with pytest.raises(ValueError, match="num_pages must be a positive int"):
        PagedKVCache(0, 4, HKV, D)
    with pytest.raises(ValueError, match="dtype must be one the kernels compute"):
        PagedKVCache(4, 4, HKV, D, dtype=torch.int8)


def test_64_ragged_requests_hold_one_partial_page_each_at_most():
    # the contiguous cache reserves the longest length for every row; the paged one, each row's own pages
    page_size, g = 16, torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 2048, (64,), generator=g).tolist()
    cache = PagedKVCache(sum(-(-n // page_size) for n in lengths), page_size, 1, 4)
    seqs = [cache.add() for _ in lengths]
    cache.append(seqs, torch.zeros(sum(lengths), 1, 4), torch.zeros(sum(lengths), 1, 4),
                 torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist()))
    paged_slots = cache.pages_in_use * page_size
    assert paged_slots - sum(lengths) < 64 * page_size  # less than one page per request beyond its tokens
    assert paged_slots < 0.6 * 64 * max(lengths)  # the contiguous reservation


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_a_layer_serving_ragged_requests_from_pages_equals_each_request_alone(page_size, window):
    # continuous batching in miniature: three prompts of different lengths prefilled in one packed call, then
    # decode steps that also admit a new request mid-way; each request's outputs equal that request run alone
    # with a contiguous KVCache
    from engine import MultiHeadAttention

    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 4, 2, window=window).double()
    paged = PagedKVCache(64, page_size, 2, 8, dtype=torch.float64)
    prompts = [torch.randn(n, 32, dtype=torch.float64) for n in (7, 3, 12)]
    seqs = [paged.add() for _ in prompts]
    alone = [layer.new_cache(1, 32) for _ in prompts]
    outs = layer.forward_paged(torch.cat(prompts), paged, seqs, torch.tensor([0, 7, 10, 22]))  # [22, E]
    for i, (prompt, start) in enumerate(zip(prompts, (0, 7, 10))):
        want = layer(prompt[None], cache=alone[i])[0]
        torch.testing.assert_close(outs[start:start + len(prompt)], want, rtol=1e-10, atol=1e-10)
    late = torch.randn(5, 32, dtype=torch.float64)  # a request that arrives at the second step
    for step in range(3):
        tokens = torch.randn(len(seqs), 32, dtype=torch.float64)  # one new token per running request
        batch, counts = [tokens], [1] * len(seqs)
        if step == 1:
            seqs.append(paged.add())
            alone.append(layer.new_cache(1, 32))
            batch, counts = [tokens, late], counts + [5]
        indptr = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist())
        outs = layer.forward_paged(torch.cat(batch), paged, seqs, indptr)
        rows = torch.cat(batch)
        for i in range(len(seqs)):
            want = layer(rows[indptr[i]:indptr[i + 1]][None], cache=alone[i])[0]
            torch.testing.assert_close(outs[indptr[i]:indptr[i + 1]], want, rtol=1e-10, atol=1e-10)
