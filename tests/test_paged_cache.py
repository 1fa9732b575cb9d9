"""PagedKVCache: ragged sequences appended in packed steps read back through paged_attention as attention over each
sequence's own keys; forks share pages and copy a shared partial page before writing; free, roll back, refusals
that leave the cache unchanged, and the memory a ragged batch holds. Quantized pools (int8, fp8 e4m3) read back
within engine.quantized's bound and attend as their dequantized keys; a windowed cache releases the pages no later
query sees (-1 in the table), holds a bounded number of pages per sequence and serves a layer as a contiguous
cache does."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import PagedKVCache, causal_attention, paged_attention
from engine.quantized import QUANTIZED_DTYPES, QuantizedKV, quantize
from tests.precision import assert_within_precision, plain_attention

HKV, HQ, D = 2, 4, 8
QUANTIZED = list(QUANTIZED_DTYPES)  # int8, and float8_e4m3fn where this torch has it


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HKV, D, generator=g, dtype=torch.float64), torch.randn(n, HKV, D, generator=g,
                                                                                 dtype=torch.float64)


def attend_all(cache, seqs, q_per_seq):
    """paged_attention of one query per sequence (at its last position) against the cache."""
    table, lens = cache.tables(seqs)
    q = torch.cat(q_per_seq)  # [B, Hq, D]
    return paged_attention(q, cache.keys, cache.values, table, lens, torch.arange(len(seqs) + 1))


def offsets(counts):
    """indptr ``[len(counts) + 1]`` of packed rows: sequence i owns rows ``offsets[i] .. offsets[i+1]-1``."""
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist())


def read_pool(pool, row, stop, start=0):
    """Slots ``start .. stop-1`` of one sequence from a pool ``[num_pages, P, ...]`` through its page-table ``row``,
    slot by slot as the layout says (key j: page ``row[j // P]``, slot ``j % P``), in float64; a released page
    (-1) reads as NaN."""
    page_size = pool.shape[1]
    slots = [pool[int(row[j // page_size]), j % page_size].double() if row[j // page_size] >= 0
             else torch.full(pool.shape[2:], float("nan"), dtype=torch.float64) for j in range(start, stop)]
    return torch.stack(slots) if slots else torch.zeros(0, *pool.shape[2:], dtype=torch.float64)


def read_back(cache, seq, start=0, layer=0):
    """``(keys [S, Hkv, D], values [S, Hkv, Dv])`` float64 of ``seq`` from ``start`` as ``layer``'s pools hold them;
    a quantized pool dequantized here, ``data * scale`` (exact in float64)."""
    table, lens = cache.tables([seq])

    def one(pool):
        if isinstance(pool, QuantizedKV):
            scale = read_pool(pool.scale, table[0], int(lens[0]), start)  # [S, Hkv]
            return read_pool(pool.data, table[0], int(lens[0]), start) * scale[..., None]  # [S, Hkv, E]
        return read_pool(pool, table[0], int(lens[0]), start)  # [S, Hkv, E]

    return tuple(one(pool) for pool in cache.layer(layer))


def as_stored(x, dtype):
    """What a pool of ``dtype`` holds for the rows ``x [N, Hkv, E]``, float64: x itself, or x quantized per token
    and head and dequantized exactly."""
    if dtype not in QUANTIZED_DTYPES:
        return x.to(dtype).double()
    stored = quantize(x[None], dtype)  # [1, N, Hkv, E]
    return stored.data[0].double() * stored.scale[0].double()[..., None]


def visible(t, s, window=None):
    """bool ``[T, S]``: T queries at a sequence's last positions ``s-t .. s-1``; key j visible iff ``j <= pos``
    (and ``pos - j < window``)."""
    pos, key_pos = torch.arange(s - t, s)[:, None], torch.arange(s)[None]  # [T, 1], [1, S]
    return (key_pos <= pos) & (pos - key_pos < (window or s + 1))  # [T, S]


def oracle(q, keys, values, window=None):
    """float64 attention of ``q [T, Hq, D]`` (a sequence's last T positions) to its ``keys [S, Hkv, D]``; query
    head h reads KV head h // G. Returns ``[T, Hq, Dv]``."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)  # [S, Hq, D]
    v = values.double().repeat_interleave(group, dim=1)  # [S, Hq, Dv]
    scores = torch.einsum("thd,shd->hts", q.double(), k) * q.shape[2] ** -0.5  # [Hq, T, S]
    weights = scores.masked_fill(~visible(q.shape[0], k.shape[0], window), float("-inf")).softmax(-1)  # [Hq, T, S]
    return torch.einsum("hts,she->the", weights, v)  # [T, Hq, Dv]


def contiguous(q, keys, values):
    """The same query against the sequence's keys held contiguously ([S, Hkv, D] each)."""
    k, v = keys.permute(1, 0, 2)[None], values.permute(1, 0, 2)[None]  # [1, Hkv, S, D]
    return causal_attention(q[None, :, None, :], k, v)[0, :, 0]  # [Hq, D]


@settings(max_examples=30)
@given(st.sampled_from([1, 3, 16]), st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=4), min_size=1,
                                             max_size=4), st.integers(0, 1000), st.booleans())
def test_ragged_appends_read_back_as_each_sequences_own_keys(page_size, steps, seed, heads_outer):
    cache = PagedKVCache(64, page_size, HKV, D, dtype=torch.float64, heads_outer=heads_outer)
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


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(1, 40), min_size=1, max_size=6), st.sampled_from([1, 4, 16]),
       st.booleans())
def test_sequences_growing_together_in_a_pool_with_room_each_hold_one_run_of_pages(batch, prompt, page_size,
                                                                                  one_by_one):
    # each sequence's next page is the one after its last, and a run starts mid-way in the longest free run: with
    # room (8x the pages needed), prompts prefilled together or one by one and a decode a token at a time keep
    # each sequence's pages one run, whatever the interleaving
    lengths = [prompt[i % len(prompt)] for i in range(batch)]
    steps = 2 * page_size + 1  # decode steps: each sequence takes two or three more pages
    needed = sum(-(-(n + steps) // page_size) for n in lengths)
    cache = PagedKVCache(8 * needed, page_size, 1, 2)
    seqs = [cache.add() for _ in lengths]
    for group in ([[seq] for seq in seqs] if one_by_one else [seqs]):
        counts = [lengths[seq] for seq in group]
        cache.append(group, torch.randn(sum(counts), 1, 2), torch.randn(sum(counts), 1, 2), offsets(counts))
    for _ in range(steps):
        cache.append(seqs, torch.randn(batch, 1, 2), torch.randn(batch, 1, 2), torch.arange(batch + 1))
    table, lens = cache.tables(seqs)
    for row, length in zip(table.tolist(), lens.tolist()):
        pages = row[:-(-length // page_size)]
        assert pages == list(range(pages[0], pages[0] + len(pages)))
    assert cache.pages_in_use == needed


def test_the_pool_gives_a_sequence_the_page_after_its_last_else_the_free_run_with_the_most_room():
    from engine.paged.pool import PagePool
    pool, claimed = PagePool(16, 4, 1, 2, 2, torch.float32, None), set()
    first = pool.take((), 3, claimed)
    assert first == [0, 1, 2] and claimed == {3}  # no sequence grows into pages 0..15: the run's from page 0
    second = pool.take((), 2, claimed)  # pages 3..15 are the first one's to grow into: shared, from the middle
    assert second == [3 + (13 - 2) // 2, 3 + (13 - 2) // 2 + 1] and claimed == {3, 10}
    assert pool.take(first, 1, claimed) == [3] and pool.take([None, 9], 1, claimed) == [10]  # followers
    assert pool.take([15]) == [11]  # no page 16; no claims given: the longest free run (11..15) from its start
    for page in (3, 10):
        pool.drop(page)
    assert pool.free_pages == 16 - 6 and pool.references(3) == 0 and pool.take([2]) == [3]
    while pool.free_pages:
        pool.take(())
    with pytest.raises(ValueError, match="no free page in this pool of 16"):
        pool.take(())


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=str)
@pytest.mark.parametrize("page_size, window", [(1, None), (4, None), (16, None), (4, 6)])
def test_a_heads_outer_cache_holds_each_heads_pages_as_one_region_and_attends_bitwise_as_heads_side_by_side(
        dtype, page_size, window):
    caches = [PagedKVCache(64, page_size, HKV, D, dtype=dtype, window=window, heads_outer=outer)
              for outer in (False, True)]
    for pool in (caches[1].keys, caches[1].values):  # [num_pages, P, Hkv, D] over [Hkv, num_pages, P, D]
        data = pool.data if isinstance(pool, QuantizedKV) else pool
        assert data.stride() == (page_size * D, D, 64 * page_size * D, 1)
        if isinstance(pool, QuantizedKV):
            assert pool.scale.stride() == (page_size, 1, 64 * page_size)
    outs = []
    for cache in caches:  # the same steps on each: prompts, a fork, decode steps, a free
        seqs = [cache.add() for _ in range(3)]
        keys, values = tokens(6 + 11 + 1, 5)
        cache.append(seqs, keys.float(), values.float(), offsets([6, 11, 1]))
        seqs.append(cache.fork(seqs[1]))
        for step in range(5):
            new_keys, new_values = tokens(len(seqs), 10 + step)
            cache.append(seqs, new_keys.float(), new_values.float(), torch.arange(len(seqs) + 1))
        cache.free(seqs.pop(0))
        counts = [1, 3, 2]  # a decode row, and queries at each sequence's last positions (the gathered runs' path)
        q = torch.randn(sum(counts), HQ, D, generator=torch.Generator().manual_seed(4))  # [Nq, Hq, D]
        table, lens = cache.tables(seqs)
        out = paged_attention(q, cache.keys, cache.values, table, lens, offsets(counts), window=window)
        outs.append((table, out))
        for seq, start, stop in zip(seqs, offsets(counts)[:-1].tolist(), offsets(counts)[1:].tolist()):
            k, v = read_back(cache, seq)  # float64 attention over the keys as the pools hold them
            live = ~k.isnan().any(-1).any(-1)  # (a window's released keys read as NaN: outside the window)
            want = oracle(q[start:stop].double(), k[live], v[live], window)
            torch.testing.assert_close(out[start:stop].double(), want, rtol=1e-4, atol=1e-4)
    (table, out), (table_outer, out_outer) = outs
    assert torch.equal(table, table_outer)  # where pages go is not the layout's
    assert torch.equal(out, out_outer)


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
    with pytest.raises(ValueError, match=r"dtype must be one the kernels compute \(.*float64.*\) or a quantized one "
                                         r"\(torch.int8.*\), got torch.int32"):
        PagedKVCache(4, 4, HKV, D, dtype=torch.int32)
    with pytest.raises(ValueError, match="keys must be a floating-point tensor, got torch.int64"):
        cache.append([b], torch.zeros(1, HKV, D, dtype=torch.long), more_values[:1], torch.tensor([0, 1]))


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


# --- quantized pools --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", QUANTIZED, ids=str)
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_quantized_appends_read_back_within_the_stated_bound(dtype, page_size):
    cache = PagedKVCache(32, page_size, HKV, D, dtype=dtype)
    assert isinstance(cache.keys, QuantizedKV) and cache.keys.data.dtype == dtype
    assert cache.keys.shape == (32, page_size, HKV, D) and cache.values.scale.shape == (32, page_size, HKV)
    assert cache.nbytes == 2 * 32 * page_size * HKV * (D + 4)  # 1-byte entries, a 4-byte scale per token and head
    seqs = [cache.add() for _ in range(3)]
    written = {seq: [] for seq in seqs}
    for step, counts in enumerate([[5, 1, 9], [1, 0, 1], [3, 4, 0]]):  # ragged prefills, decodes, an idle row
        keys, values = tokens(sum(counts), step)
        keys = (keys * torch.rand(len(keys), HKV, 1, dtype=torch.float64) * 10).float()  # rows of many sizes, fp32
        cache.append(seqs, keys, values.float(), offsets(counts))
        for seq, start, stop in zip(seqs, offsets(counts)[:-1].tolist(), offsets(counts)[1:].tolist()):
            written[seq].append(keys[start:stop])
    for seq in seqs:
        x = torch.cat(written[seq])  # [S, Hkv, D] as written
        table, _ = cache.tables([seq])
        data = read_pool(cache.keys.data, table[0], len(x))  # [S, Hkv, D]
        scale = read_pool(cache.keys.scale, table[0], len(x))  # [S, Hkv]
        stored = quantize(x[None], dtype)  # per token and head, as if the sequence were quantized alone
        assert torch.equal(data, stored.data[0].double()) and torch.equal(scale, stored.scale[0].double())
        err = (data * scale[..., None] - x.double()).abs()  # [S, Hkv, D]
        if dtype == torch.int8:  # half a step, plus fp32's rounding of x / scale (|x / scale| <= 127)
            bound = scale[..., None] * (0.5 + 127 * 2.0 ** -24)
        else:  # e4m3: max(|x| / 16, 2^-10 * scale), engine.quantized's bound
            bound = torch.maximum(x.double().abs() / 16, scale[..., None] * 2.0 ** -10) * (1 + 1e-6)
        assert bool((err <= bound).all())


@pytest.mark.parametrize("dtype", QUANTIZED, ids=str)
def test_a_quantized_fork_copies_the_shared_partial_pages_data_and_scales_before_writing(dtype):
    cache = PagedKVCache(8, 4, HKV, D, dtype=dtype)
    parent = cache.add()
    keys, values = tokens(6, 0)
    cache.append([parent], keys, values, offsets([6]))  # pages: one full, one half
    child = cache.fork(parent)
    before = read_back(cache, parent)
    new_keys, new_values = tokens(1, 1)
    cache.append([child], new_keys * 100, new_values, offsets([1]))  # a far larger scale: a shared scale would show
    assert cache.pages_in_use == 3
    table, _ = cache.tables([parent, child])
    assert table[0, 0] == table[1, 0] and table[0, 1] != table[1, 1]
    after = read_back(cache, parent)
    assert all(torch.equal(a, b) for a, b in zip(after, before))  # the parent is unchanged, data and scales
    child_keys, child_values = read_back(cache, child)
    assert torch.equal(child_keys[:6], before[0]) and torch.equal(child_values[:6], before[1])  # the copy
    assert torch.equal(child_keys[6:], as_stored(new_keys * 100, dtype))
    assert torch.equal(child_values[6:], as_stored(new_values, dtype))
    cache.free(parent)
    cache.free(child)
    assert cache.pages_in_use == 0


@pytest.mark.parametrize("dtype", QUANTIZED, ids=str)
@pytest.mark.parametrize("query_counts", [(1, 1, 1), (1, 3, 2)], ids=["decode", "mixed"])
def test_a_quantized_pool_attends_as_its_dequantized_keys(dtype, query_counts):
    # needs paged_attention to take QuantizedKV pools. The oracle dequantizes the pools itself (read_back, exact in
    # float64), so the only error left is float32 arithmetic: within 2x a plain float32 run's (tests.precision)
    cache = PagedKVCache(16, 4, HKV, D, dtype=dtype)
    lengths = (5, 13, 2)  # a partial page; four pages; less than the query count would allow
    seqs = [cache.add() for _ in lengths]
    keys, values = tokens(sum(lengths), 7)
    cache.append(seqs, keys, values, offsets(lengths))
    q = torch.randn(sum(query_counts), HQ, D)  # [Nq, Hq, D] float32
    table, lens = cache.tables(seqs)
    out = paged_attention(q, cache.keys, cache.values, table, lens, offsets(query_counts))  # [Nq, Hq, D]
    for seq, start, stop in zip(seqs, offsets(query_counts)[:-1].tolist(), offsets(query_counts)[1:].tolist()):
        k, v = read_back(cache, seq)  # [S, Hkv, D] dequantized
        q_b = q[start:stop]  # [T, Hq, D]
        plain = plain_attention(q_b.transpose(0, 1)[None], k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None],
                                visible(len(q_b), len(k)), D ** -0.5, torch.float32)[0].transpose(0, 1)  # [T, Hq, D]
        assert_within_precision(out[start:stop], oracle(q_b, k, v), plain, torch.float32)


# --- sliding-window release -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8], ids=str)
@pytest.mark.parametrize("page_size, window", [
    (1, 1),  # a query sees only itself: every older page goes
    (4, 6),  # the window spans a page boundary
    (4, 5),  # W - 1 a multiple of P: one page fewer than the bound at most
    (3, 7),  # odd sizes
    (16, 6),  # pages longer than the window
])
def test_a_long_windowed_generation_holds_at_most_ceil_w_over_p_plus_one_pages_per_sequence(dtype, page_size, window):
    bound = -(-window // page_size) + 1
    prompts = (11, 2)
    pool = sum(max(-(-n // page_size), bound) for n in prompts)  # the prefill's pages, then the bound: no more
    cache = PagedKVCache(pool, page_size, HKV, D, dtype=dtype, window=window)
    seqs = [cache.add() for _ in prompts]
    keys, values = tokens(sum(prompts), 0)
    cache.append(seqs, keys, values, offsets(prompts))
    written = [[keys[:11]], [keys[11:]]]
    for step in range(200):  # a pool without releases would run out after a few steps
        before = [cache.length(seq) for seq in seqs]
        new_keys, new_values = tokens(2, step + 1)
        cache.append(seqs, new_keys, new_values, offsets([1, 1]))
        table, lens = cache.tables(seqs)
        columns = torch.arange(table.shape[1])
        for b, seq in enumerate(seqs):
            written[b].append(new_keys[b:b + 1])
            assert cache.pages_held(seq) <= bound
            # released: a page whose keys are all <= length before the step - W (the step's queries sit at >= it)
            released = ((columns + 1) * page_size <= before[b] - window + 1) & (columns < -(-int(lens[b]) // page_size))
            assert torch.equal(table[b] == -1, released)
        assert cache.pages_in_use == sum(cache.pages_held(seq) for seq in seqs)  # the released pages are free
    for b, seq in enumerate(seqs):
        x = torch.cat(written[b])  # [S, Hkv, D]
        back, _ = read_back(cache, seq)
        first_kept = int((cache.tables([seq])[0][0] == -1).sum()) * page_size
        assert bool(back[:first_kept].isnan().all())  # released pages are not read
        assert torch.equal(back[first_kept:], as_stored(x[first_kept:], dtype))  # the window's keys are kept
        assert first_kept >= len(x) - window - page_size


def test_a_page_shared_by_forks_returns_to_the_pool_only_when_every_holder_releases_it():
    cache = PagedKVCache(6, 4, HKV, D, dtype=torch.float64, window=4)
    parent = cache.add()
    keys, values = tokens(9, 0)
    cache.append([parent], keys[:8], values[:8], offsets([8]))  # pages a (keys 0..3), b (keys 4..7)
    (a, b), = cache.tables([parent])[0].tolist()
    assert b == a + 1  # a sequence's pages follow on
    child = cache.fork(parent)
    cache.append([parent], keys[8:], values[8:], offsets([1]))  # its query at 8 sees keys 5..8: page a released
    table = cache.tables([parent, child])[0].tolist()
    assert table == [[-1, b, b + 1], [a, b, 0]]  # the child still holds page a; the parent's new page follows b
    assert cache.pages_in_use == 3
    cache.append([child], keys[8:], values[8:], offsets([1]))  # the last holder lets go: page a is free
    (released, shared, own), = cache.tables([child])[0].tolist()
    assert (released, shared) == (-1, b) and own not in (b, b + 1)  # (b + 1, its follower, is the parent's)
    assert cache.pages_in_use == 3
    grandchild = cache.fork(child)  # shares the live pages only
    assert cache.tables([grandchild])[0].tolist() == [[-1, b, own]] and cache.pages_in_use == 3
    cache.free(child)
    assert cache.pages_in_use == 3  # the grandchild holds them
    cache.free(grandchild)
    assert cache.pages_in_use == 2  # page b stays with the parent
    cache.free(parent)
    assert cache.pages_in_use == 0


def test_truncate_cannot_roll_back_into_released_keys():
    cache = PagedKVCache(8, 4, HKV, D, dtype=torch.float64, window=4)
    seq = cache.add()
    keys, values = tokens(13, 0)
    cache.append([seq], keys[:12], values[:12], offsets([12]))
    pages = cache.tables([seq])[0][0].tolist()
    cache.append([seq], keys[12:], values[12:], offsets([1]))  # its query at 12 sees keys 9..12: keys 0..7 released
    assert cache.tables([seq])[0].tolist() == [[-1, -1, pages[2], pages[2] + 1]] and cache.pages_in_use == 2
    with pytest.raises(ValueError, match=r"keys 0..7 were released and a query at position 10 \(window 4\) could need "
                                         r"one; the shortest length it can roll back to is 11"):
        cache.truncate(seq, 10)  # its query at 10 would see keys 7..10
    assert cache.length(seq) == 13 and cache.pages_in_use == 2  # refused: unchanged
    cache.truncate(seq, 11)  # the next query, at 11, sees keys 8..11: all kept
    assert cache.length(seq) == 11 and cache.tables([seq])[0].tolist() == [[-1, -1, pages[2]]]
    assert cache.pages_in_use == 1
    # released by hand (no window): pages whose keys are all before the position; no rolling back before it
    plain = PagedKVCache(8, 4, HKV, D, dtype=torch.float64)
    seq = plain.add()
    plain.append([seq], keys, values, offsets([13]))
    pages = plain.tables([seq])[0][0].tolist()
    plain.release_before(seq, 9)  # its first two pages (keys 0..7); the third still holds key 8
    assert plain.tables([seq])[0].tolist() == [[-1, -1] + pages[2:]] and plain.pages_held(seq) == 2
    plain.release_before(seq, 3)  # nothing more: a no-op
    with pytest.raises(ValueError, match="shortest length it can roll back to is 8"):
        plain.truncate(seq, 7)
    with pytest.raises(ValueError, match=r"position must be an int in \[0, 13\] \(sequence 0's tokens\), got 14"):
        plain.release_before(seq, 14)
    plain.truncate(seq, 8)
    assert plain.pages_in_use == 0 and plain.tables([seq])[0].tolist() == [[-1, -1]]
    with pytest.raises(ValueError, match="window must be a positive int \\(keys seen, own included\\) or None, got 0"):
        PagedKVCache(8, 4, HKV, D, window=0)


def test_a_windowed_append_counts_the_pages_it_releases_and_a_refused_one_releases_none():
    cache = PagedKVCache(3, 2, HKV, D, dtype=torch.float64, window=2)
    a, b = cache.add(), cache.add()
    keys, values = tokens(6, 0)
    cache.append([a, b], keys, values, offsets([4, 2]))  # a: pages 0, 1; b: page 2; the pool is full
    more, more_values = tokens(6, 1)
    with pytest.raises(ValueError, match=r"the pool has 1 free pages of 2 tokens \(1 of them released by the window\) "
                                         r"and this append needs 4"):
        cache.append([a, b], more, more_values, offsets([3, 3]))  # a would release page 0 (keys 0, 1 <= 4 - 2)
    assert cache.tables([a, b])[0].tolist() == [[0, 1], [2, 0]] and cache.pages_in_use == 3  # nothing released
    cache.append([a], more[:1], more_values[:1], offsets([1]))  # fits: the page a releases takes its new key
    assert cache.tables([a])[0].tolist() == [[-1, 1, 0]] and cache.pages_in_use == 3


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_a_layer_with_a_windowed_cache_releasing_pages_equals_each_request_alone(page_size):
    # needs paged_attention to take -1 page-table entries outside every query's window. Three prompts prefilled in
    # one packed call, twelve decode steps (a request joins at the fourth): the cache releases pages as the window
    # moves on, and each request's outputs equal that request run alone with a contiguous KVCache
    from engine import MultiHeadAttention

    torch.manual_seed(0)
    window = 6
    layer = MultiHeadAttention(32, 4, 2, window=window).double()
    paged = PagedKVCache(64, page_size, 2, 8, dtype=torch.float64, window=window)
    seqs, alone = [], []
    steps = [[torch.randn(n, 32, dtype=torch.float64) for n in (7, 3, 12)]]  # step 0: the prompts
    for step in range(1, 13):
        steps.append([torch.randn(1, 32, dtype=torch.float64) for _ in range(3 if step < 4 else 4)])
        if step == 4:
            steps[-1][-1] = torch.randn(5, 32, dtype=torch.float64)  # a late request's prompt
    for rows in steps:
        while len(seqs) < len(rows):
            seqs.append(paged.add())
            alone.append(layer.new_cache(1, 32))
        indptr = offsets([len(r) for r in rows])
        outs = layer.forward_paged(torch.cat(rows), paged, seqs, indptr)  # [N, E]
        for i, r in enumerate(rows):
            want = layer(r[None], cache=alone[i])[0]
            torch.testing.assert_close(outs[indptr[i]:indptr[i + 1]], want, rtol=1e-10, atol=1e-10)
    table, _ = paged.tables(seqs)
    assert bool((table == -1).any())  # pages were released ...
    assert all(paged.pages_held(seq) <= -(-window // page_size) + 1 for seq in seqs)  # ... down to the bound


def cache_state(cache, seqs):
    return (cache.keys.clone(), cache.pages_in_use, [cache.length(s) for s in seqs], cache.tables(seqs)[0].tolist())


@pytest.mark.parametrize("order", ["releasing first", "releasing last"])
def test_a_windowed_append_on_a_nearly_full_pool_takes_the_pages_a_later_sequence_releases(order):
    # x's window releases its page 0 in this append; y needs that page and the last free one. The capacity check
    # counts the release, so the append must succeed whichever sequence comes first in the list
    cache = PagedKVCache(4, 2, HKV, D, dtype=torch.float64, window=2)
    x, y = cache.add(), cache.add()
    keys, values = tokens(6, 0)
    cache.append([x, y], keys, values, offsets([4, 2]))  # x: two pages; y: one; one page free
    x_pages = cache.tables([x])[0][0].tolist()
    seqs, counts = ([x, y], [0, 3]) if order == "releasing first" else ([y, x], [3, 0])
    more, more_values = tokens(3, 1)
    cache.append(seqs, more, more_values, offsets(counts))
    assert cache.tables([x])[0].tolist()[0][:2] == [-1, x_pages[1]]
    assert cache.length(x) == 4 and cache.length(y) == 5 and cache.pages_in_use == 4
    got = cache.keys[cache.tables([y])[0][0, 1]][:2]  # y's keys 2, 3 (its second page)
    assert torch.equal(got, more[:2])


def test_a_windowed_append_of_three_sequences_where_the_last_releases_what_the_first_two_take():
    # free 1 page; x and y need one each, z's window releases one: it fits, and each reads back its own keys
    cache = PagedKVCache(5, 2, HKV, D, dtype=torch.float64, window=2)
    x, y, z = cache.add(), cache.add(), cache.add()
    keys, values = tokens(8, 0)
    cache.append([x, y, z], keys, values, offsets([2, 2, 4]))  # x, y: 1 page each, z: 2; one page free
    more, more_values = tokens(2, 1)
    cache.append([x, y, z], more, more_values, offsets([1, 1, 0]))  # z's query at 4 sees keys 3, 4: page 0 released
    table = cache.tables([x, y, z])[0]
    assert cache.pages_in_use == 5 and table[2, 0] == -1
    for row, seq in enumerate((x, y)):
        assert cache.length(seq) == 3 and torch.equal(cache.keys[table[row, 1], 0], more[row])


def test_a_window_release_of_a_page_a_fork_still_holds_frees_nothing():
    # the parent's window releases page 0, which the fork still holds: no page returns to the pool, so an append
    # that needs one page more than is free is refused (and changes nothing) instead of taking a page twice
    cache = PagedKVCache(3, 4, HKV, D, dtype=torch.float64, window=4)
    parent = cache.add()
    keys, values = tokens(9, 0)
    cache.append([parent], keys[:8], values[:8], offsets([8]))  # pages 0, 1 full
    child = cache.fork(parent)  # holds pages 0 and 1 too; one page free
    before = cache_state(cache, [parent, child])
    more, more_values = tokens(5, 1)
    with pytest.raises(ValueError, match=r"the pool has 1 free pages of 4 tokens and this append needs 2"):
        cache.append([parent], more, more_values, offsets([5]))  # 13 keys: 2 new pages; page 0 stays the child's
    after = cache_state(cache, [parent, child])
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]
    cache.append([parent], keys[8:], values[8:], offsets([1]))  # one page: fits; page 0 released by the parent only
    assert cache.tables([parent, child])[0].tolist() == [[-1, 1, 2], [0, 1, 0]] and cache.pages_in_use == 3


@pytest.mark.parametrize("indptr", [torch.tensor([0.0, 2.0]), torch.tensor([False, True]), [0, 2]], ids=str)
def test_an_indptr_that_is_not_an_int_tensor_is_refused_naming_it(indptr):
    cache = PagedKVCache(4, 4, HKV, D, dtype=torch.float64)
    seq = cache.add()
    keys, values = tokens(2, 0)
    with pytest.raises(ValueError, match=r"indptr must be an int tensor \[len\(seqs\) \+ 1\] = \[2\], got"):
        cache.append([seq], keys[:2] if not isinstance(indptr, torch.Tensor) or indptr.dtype != torch.bool
                     else keys[:1], values[:2] if not isinstance(indptr, torch.Tensor) or indptr.dtype != torch.bool
                     else values[:1], indptr)
    assert cache.length(seq) == 0 and cache.pages_in_use == 0


@pytest.mark.parametrize("bad", ["bf16 cache", "cache window below the layer's", "windowed cache, no layer window",
                                 "unknown sequence", "float indptr"])
def test_forward_paged_refuses_before_the_cache_grows(bad):
    from engine import MultiHeadAttention

    layer = MultiHeadAttention(32, 4, 2, window=8 if "below" in bad else None).double()
    dtype = torch.bfloat16 if bad == "bf16 cache" else torch.float64
    window = 4 if "window" in bad else None
    cache = PagedKVCache(8, 4, 2, 8, dtype=dtype, window=window)
    seq = cache.add()
    seqs, indptr = ([seq + 5] if bad == "unknown sequence" else [seq]), torch.tensor([0, 3])
    if bad == "float indptr":
        indptr = indptr.double()
    x = torch.randn(3, 32, dtype=torch.float64)
    message = {"bf16 cache": "cache pages must have the layer's dtype torch.float64",
               "cache window below the layer's": "releases keys outside a window of 4, but this layer's queries see 8",
               "windowed cache, no layer window": "releases keys outside a window of 4, but this layer's queries see "
                                                  "every earlier key",
               "unknown sequence": "no sequence 5", "float indptr": "indptr must be an int tensor"}[bad]
    for _ in range(2):  # a retry is refused alike: the cache never grew
        with pytest.raises(ValueError, match=message):
            layer.forward_paged(x, cache, seqs, indptr)
        assert cache.length(seq) == 0 and cache.pages_in_use == 0


def test_one_cache_of_several_layers_shares_pages_and_each_layer_keeps_its_own_keys():
    cache = PagedKVCache(6, 4, HKV, D, dtype=torch.float64, layers=3)
    a, b = cache.add(), cache.add()
    with pytest.raises(ValueError, match="this cache holds 3 layers: extend"):
        cache.append([a], *tokens(2, 0), offsets([2]))
    slots = cache.extend([a, b], offsets([5, 3]))  # one allocation for every layer
    assert cache.pages_in_use == 3 and cache.length(a) == 5 and slots.pages.shape == (8,)
    written = [tokens(8, layer) for layer in range(3)]
    for layer, (keys, values) in enumerate(written):
        cache.write(slots, keys, values, layer)
    table, lens = cache.tables([a, b])
    for layer, (keys, values) in enumerate(written):
        k_pages, v_pages = cache.layer(layer)
        for row, (seq, j) in enumerate([(0, j) for j in range(5)] + [(1, j) for j in range(3)]):
            assert torch.equal(k_pages[table[seq, j // 4], j % 4], keys[row])
            assert torch.equal(v_pages[table[seq, j // 4], j % 4], values[row])
    with pytest.raises(ValueError, match="this step made room for 8 rows, got 2"):
        cache.write(slots, *tokens(2, 0), 1)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 3\), got 3"):
        cache.write(slots, *tokens(8, 0), 3)
    child = cache.fork(a)  # copy on write copies the shared partial page in every layer
    child_slots = cache.extend([child], offsets([1]))
    for layer in range(3):
        cache.write(child_slots, *tokens(1, 9), layer)
        k_pages, _ = cache.layer(layer)
        own = cache.tables([child])[0][0, 1]
        assert torch.equal(k_pages[own, 0], written[layer][0][4])  # the copied key of the parent's page
    assert cache.nbytes == 3 * 2 * 6 * 4 * HKV * D * 8


def test_a_models_layers_share_one_step_and_its_plan():
    # TinyDecoder over one cache of every layer: one plan per step serves the three layers; tokens equal the
    # contiguous cache's greedy ones
    from engine.generate import TinyDecoder
    from engine.generate_paged import generate_paged
    from engine.paged import step as paged_step

    torch.manual_seed(0)
    model = TinyDecoder(vocab=50, hidden=32, layers=3, heads=4, kv_heads=2).eval()
    ids = torch.randint(0, 50, (3, 6))
    valid = torch.ones(3, 6, dtype=torch.bool)
    made = []
    plan_paged = paged_step.plan_paged

    def counted(*args, **kwargs):
        made.append(1)
        return plan_paged(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged_step, "plan_paged", counted)
        tokens_paged, cache, _ = generate_paged(model, ids, valid, 5, 4)
    assert len(made) == 5  # the prefill and four decode steps: one plan each, for the three layers
    assert cache.layers == 3
    with torch.no_grad():
        caches = model.new_caches(3, 16)
        logits = model(ids, caches=caches)
        token = logits[:, -1].argmax(-1)
        want = [token]
        for _ in range(4):
            token = model(token[:, None], caches=caches)[:, -1].argmax(-1)
            want.append(token)
    assert torch.equal(tokens_paged, torch.stack(want, dim=1))


def test_a_cache_of_several_layers_is_refused_without_a_step_and_a_stale_step_is_refused():
    from engine import MultiHeadAttention
    from engine.paged.step import begin_step

    layer = MultiHeadAttention(32, 4, 2).double()
    cache = PagedKVCache(8, 4, 2, 8, dtype=torch.float64, layers=2)
    seq = cache.add()
    x = torch.randn(3, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="this cache holds 2 layers: make the step once"):
        layer.forward_paged(x, cache, [seq], offsets([3]), layer=0)
    assert cache.length(seq) == 0 and cache.pages_in_use == 0
    step = begin_step(cache, [seq], offsets([3]))
    layer.forward_paged(x, cache, step=step, layer=0)
    layer.forward_paged(x, cache, step=step, layer=1)
    assert cache.length(seq) == 3
    newer = begin_step(cache, [seq], offsets([3]))
    with pytest.raises(ValueError, match="got a step made before the cache last grew"):
        layer.forward_paged(x, cache, step=step, layer=0)
    other = PagedKVCache(8, 4, 2, 8, dtype=torch.float64, layers=2)
    with pytest.raises(ValueError, match="got a step of another cache"):
        layer.forward_paged(x, other, step=newer, layer=0)


def test_a_refused_model_step_leaves_the_cache_as_it_was():
    from engine.generate import TinyDecoder

    torch.manual_seed(0)
    model = TinyDecoder(vocab=50, hidden=32, layers=2, heads=4, kv_heads=2)
    wrong = PagedKVCache(8, 4, 1, 8, layers=2)  # one KV head: not this model's
    seq = wrong.add()
    with pytest.raises(ValueError, match=r"cache must hold \[Hkv, D, Dv\]"):
        model.forward_paged(torch.tensor([1, 2, 3]), wrong, [seq], offsets([3]))
    assert wrong.length(seq) == 0 and wrong.pages_in_use == 0


# --- compaction ---------------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "append", "fork", "free"]), st.integers(0, 5), st.integers(1, 9)),
                min_size=1, max_size=25), st.sampled_from([1, 3, 4]), st.sampled_from([None, 6]),
       st.sampled_from([torch.float64, torch.int8]), st.integers(1, 2))
def test_compact_makes_each_sequences_own_pages_one_run_and_keeps_every_key(ops, page_size, window, dtype, layers):
    cache = PagedKVCache(48, page_size, HKV, D, dtype=dtype, window=window, layers=layers)
    seqs, step = [], 0
    for op, pick, count in ops:  # a churn: sequences added, grown, forked and freed in any order
        step += 1
        if op == "add" or not seqs:
            seqs.append(cache.add())
        elif op == "fork":
            seqs.append(cache.fork(seqs[pick % len(seqs)]))
        elif op == "free" and len(seqs) > 1:
            cache.free(seqs.pop(pick % len(seqs)))
        elif op == "append" and cache.num_pages - cache.pages_in_use > count:
            seq = seqs[pick % len(seqs)]
            slots = cache.extend([seq], offsets([count]))
            for layer in range(layers):
                cache.write(slots, *tokens(count, 100 * step + layer), layer)
    before = {seq: [read_back(cache, seq, layer=layer) for layer in range(layers)] for seq in seqs}
    in_use, lengths = cache.pages_in_use, {seq: cache.length(seq) for seq in seqs}
    cache.compact()
    assert cache.pages_in_use == in_use and {seq: cache.length(seq) for seq in seqs} == lengths
    owned = set()
    for seq in sorted(seqs):
        for layer in range(layers):  # every key and value as it was, bitwise (a released one: NaN both times)
            for got, want in zip(read_back(cache, seq, layer=layer), before[seq][layer]):
                assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
        (row,), _ = cache.tables([seq])
        pages = [page for page in row.tolist()[:-(-cache.length(seq) // page_size)] if page >= 0]  # (-1: released)
        own = [page for page in pages if page not in owned]  # (a fork's shared prefix: its parent's run)
        assert own == list(range(own[0], own[0] + len(own))) if own else True  # its own pages: one run
        owned.update(pages)
    for seq in seqs:  # the pool's counts follow the pages: freeing every sequence frees every page
        cache.free(seq)
    assert cache.pages_in_use == 0


def test_compact_places_sequences_in_order_with_the_free_pages_as_gaps_and_moves_the_rows():
    cache = PagedKVCache(13, 1, HKV, D, dtype=torch.float64)  # 10 pages held, 3 free: a gap of 1 after each
    a, b, c = cache.add(), cache.add(), cache.add()
    for seq, count in ((a, 2), (b, 1), (c, 2), (b, 2), (a, 2), (c, 1)):
        cache.append([seq], *tokens(count, seq * 10 + count), offsets([count]))
    keys = {seq: read_back(cache, seq)[0] for seq in (a, b, c)}
    assert cache.compact() > 0
    assert cache.tables([a, b, c])[0].tolist() == [[0, 1, 2, 3], [5, 6, 7, 0], [9, 10, 11, 0]]  # gaps of 1
    assert all(torch.equal(read_back(cache, seq)[0], keys[seq]) for seq in (a, b, c))
    assert cache.compact() == 0  # already one run each
    cache.append([a, b, c], *tokens(3, 99), offsets([1, 1, 1]))  # each grows into its gap
    assert cache.tables([a, b, c])[0].tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 0], [9, 10, 11, 12, 0]]
