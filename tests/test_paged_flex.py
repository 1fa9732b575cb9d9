"""The paged Flex path (engine.kernels.flex.paged: K/V read in place from the pools) against a float64 oracle written
here: each sequence's keys gathered with a Python loop, then one softmax per query. Shuffled and shared pages,
partial last pages, a mixed batch (decode, chunked prefill, prefill), windows, softcap, sinks, GQA, NHD and HND
pools, NaN in every slot no sequence owns, released pages (-1), fp32 and bf16; its BlockMask against the dense
mask; the reasons it does not fit.

On CPU a call that wants the lse runs Flex's unfused implementation (no compile); the compiled kernel (one per shape,
~6 s the first time, then torch's disk cache) is tested without the lse, on few shapes.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

import engine
from engine.kernels.flex.paged import _plan, flex_paged_attention, flex_paged_fits
from engine.paged import paged_attention
from engine.paged.tables import PagedBatch
from tests.precision import assert_within_precision

GARBAGE = 10**6  # page-table entries past a sequence's pages: never read


def oracle(q, k_pages, v_pages, page_table, kv_lens, starts, positions, window=None, softcap=None, sinks=None,
           scale=None, dtype=torch.float64):
    """``(out [Nq, Hq, Dv], lse [Nq, Hq])`` in ``dtype``: per sequence its keys ``pool[page_table[b, j // P], j % P]``
    gathered one by one, then per query and head a softmax over the visible ones (0 and -inf if none)."""
    nq, q_heads, d = q.shape
    page_size, kv_heads, dv = k_pages.shape[1], k_pages.shape[2], v_pages.shape[3]
    group = q_heads // kv_heads
    out = torch.zeros(nq, q_heads, dv, dtype=dtype)
    lse = torch.full((nq, q_heads), -math.inf, dtype=dtype)
    for b, length in enumerate(kv_lens):
        slots = [(int(page_table[b][j // page_size]), j % page_size) for j in range(length)]
        keys = torch.stack([k_pages[p, s] for p, s in slots]).to(dtype) if slots else None  # [S, Hkv, D]
        values = torch.stack([v_pages[p, s] for p, s in slots]).to(dtype) if slots else None  # [S, Hkv, Dv]
        for row in range(starts[b], starts[b + 1]):
            pos = int(positions[row])
            seen = [j for j in range(length) if j <= pos and (window is None or pos - j < window)]
            for h in range(q_heads):
                scores = keys[seen, h // group] @ q[row, h].to(dtype) * (scale or d**-0.5) if seen else None
                if seen and softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                logits = scores if sinks is None else torch.cat([*([scores] if seen else []), sinks[h:h + 1].to(dtype)])
                if logits is None:
                    continue
                lse[row, h] = torch.logsumexp(logits, 0)
                if seen:
                    out[row, h] = torch.exp(scores - lse[row, h]) @ values[seen, h // group]
    return out, lse


def paged_case(kv_lens, q_lens, page_size=4, kv_heads=2, group=2, d=8, dtype=torch.float32, head_major=False,
               share=True, spare=2, released=(), seed=0):
    """A batch over a pool of shuffled pages: sequence 1 shares sequence 0's first page (when both fill it), NaN in
    every slot no sequence owns, ``released`` ``(b, column)`` entries -1 (their page NaN unless still shared). Returns
    ``(q, k_pages, v_pages, tables, positions)`` with each sequence's queries at its last positions."""
    g = torch.Generator().manual_seed(seed)
    owned = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(owned) + spare
    order = torch.randperm(num_pages, generator=g).tolist()
    table = torch.full((len(kv_lens), max(owned) + 1), GARBAGE, dtype=torch.long)
    for b, n in enumerate(owned):
        table[b, :n] = torch.tensor(order[sum(owned[:b]):sum(owned[:b]) + n])
    if share and len(kv_lens) > 1 and min(kv_lens[:2]) >= page_size:
        table[1, 0] = table[0, 0]
    shape = (num_pages, kv_heads, page_size) if head_major else (num_pages, page_size, kv_heads)
    pools = [torch.full((*shape, width), math.nan, dtype=dtype) for width in (d, d + 1)]  # Dv = D + 1
    if head_major:  # storage [pages, Hkv, P, E] seen as [pages, P, Hkv, E], as engine.paged.pool keeps it
        pools = [x.permute(0, 2, 1, 3) for x in pools]
    k_pages, v_pages = pools
    for b, n in enumerate(kv_lens):
        for j in range(n):
            page, slot = int(table[b, j // page_size]), j % page_size
            k_pages[page, slot] = torch.randn(kv_heads, d, generator=g).to(dtype)
            v_pages[page, slot] = torch.randn(kv_heads, d + 1, generator=g).to(dtype)
    for b, column in released:
        table[b, column] = -1
    live = {int(p) for b, n in enumerate(owned) for p in table[b, :n] if p >= 0}
    for page in set(range(num_pages)) - live:  # released pages no other sequence holds: NaN (they may serve others)
        k_pages[page], v_pages[page] = math.nan, math.nan
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    q = torch.randn(starts[-1], kv_heads * group, d, generator=g).to(dtype)
    positions = torch.cat([torch.arange(n - t, n) for n, t in zip(kv_lens, q_lens)]).long()
    return q, k_pages, v_pages, PagedBatch(starts=starts, kv_lens=list(kv_lens), page_table=table,
                                           page_size=page_size), positions


def check(case, window=None, softcap=None, sinks=None, return_lse=True, device="cpu", scale=None):
    """The path's out (and lse) within its precision of the float64 oracle; no NaN from the unowned slots."""
    q, k_pages, v_pages, tables, positions = case
    on = [x.to(device) for x in (q, k_pages, v_pages)]
    sinks_on = None if sinks is None else sinks.to(device)
    assert flex_paged_fits(*on, tables, softcap, None, sinks_on, False, return_lse=return_lse) is None
    out, lse = flex_paged_attention(*on, tables, positions, window, softcap, scale, sinks_on, return_lse=return_lse)
    args = (q, k_pages, v_pages, tables.page_table.tolist(), tables.kv_lens, tables.starts, positions, window,
            softcap, sinks, scale)
    want, want_lse = oracle(*args)
    plain, _ = oracle(*args, dtype=q.dtype)  # the same sums done in q's dtype: the precision bar
    assert out.dtype == q.dtype and out.shape == want.shape and out.device.type == device
    assert_within_precision(out.cpu(), want, plain, q.dtype)
    if return_lse:  # scores and their sums in fp32 whatever q's dtype
        assert lse.dtype == torch.float32
        assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(want_lse))  # rows that see nothing: -inf
        torch.testing.assert_close(lse.cpu().double(), want_lse, rtol=1e-5, atol=1e-5)
    else:
        assert lse is None
    return out, lse


# A mixed batch: a decode (1 query, 9 keys: partial last page), a chunked prefill (5 new queries after 8 cached keys,
# sharing sequence 0's first page), a prefill (7 queries, 7 keys), a sequence without queries; GQA Hq 4, Hkv 2.
MIXED = ([9, 13, 7, 5], [1, 5, 7, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_major", [False, True], ids=["nhd", "hnd"])
def test_a_mixed_batch_equals_the_oracle(dtype, head_major):
    check(paged_case(*MIXED, dtype=dtype, head_major=head_major))


@pytest.mark.parametrize("page_size, kv_heads, group", [(1, 1, 4), (3, 2, 1), (16, 1, 2)], ids=["P1-mqa", "P3-mha",
                                                                                            "P16-mqa"])
def test_page_sizes_and_head_groups(page_size, kv_heads, group):
    # HND storage: with one KV head it is also an NHD pool (the plain view); a page of 16 outgrows a sequence.
    check(paged_case(*MIXED, page_size=page_size, kv_heads=kv_heads, group=group, head_major=True), window=7)


@pytest.mark.parametrize("head_major", [False, True], ids=["nhd", "hnd"])
def test_window_softcap_sinks_and_released_pages(head_major):
    # Window 5 over page size 4: sequence 0 (decode at 12) and sequence 2 (chunk at 18..20) released their first
    # page (-1, keys 0..3 wholly outside every window); sequence 1 still holds sequence 0's (shared), page 2's is NaN.
    case = paged_case([13, 6, 21], [1, 6, 3], head_major=head_major, released=[(0, 0), (2, 0)], seed=1)
    sinks = torch.tensor([0.5, -1.0, 0.0, 2.0])
    check(case, window=5, softcap=3.0, sinks=sinks, scale=0.7)
    check(case, window=5, return_lse=False, sinks=sinks)  # sinks still need the lse: out only, same path


def test_queries_that_see_nothing_give_zero_and_neg_inf():
    q, k_pages, v_pages, tables, positions = paged_case([6, 8], [2, 3], seed=2)
    positions = torch.tensor([-1, 3, -5, 0, 7])  # per-token positions: two before the sequence's first key
    out, lse = check((q, k_pages, v_pages, tables, positions), window=2)
    assert bool((out[[0, 2]] == 0).all()) and bool(torch.isneginf(lse[[0, 2]]).all())


def test_nan_in_owned_slots_poisons_as_the_gathered_path():
    # A visible owned key with a NaN poisons its rows (lse -inf), a visible owned value entry its channel; rows
    # for which the bad slot is a future key stay clean. The gathered path is the twin.
    q, k_pages, v_pages, tables, positions = paged_case([9, 13], [3, 4], seed=3)
    k_pages[tables.page_table[0, 1], 1, 0, 2] = math.nan  # sequence 0's key 5, KV head 0
    v_pages[tables.page_table[1, 2], 3, 1, 4] = math.inf  # sequence 1's key 11, KV head 1, channel 4
    out, lse = flex_paged_attention(q, k_pages, v_pages, tables, positions, 6, None, None, None)
    want, want_lse = paged_attention(q, k_pages, v_pages, tables.page_table, torch.tensor(tables.kv_lens),
                                     torch.tensor(tables.starts), positions, window=6, return_lse=True,
                                     kernel="reference")
    assert torch.equal(out.isnan(), want.isnan()) and bool(out.isnan().any())
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = ~want.isnan()
    torch.testing.assert_close(out[finite], want[finite], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("page_size, head_major", [(4, False), (4, True), (1, False), (3, True), (16, False)])
def test_the_block_mask_lists_every_visible_pair_and_only_owned_pages(page_size, head_major):
    # The dense mask (mask_mod at every pair) lies inside the listed blocks; a full block is visible at every
    # (real row, key) pair; a listed block holds a page of its rows' sequence.
    q, k_pages, v_pages, tables, positions = paged_case([40, 23, 9], [1, 20, 9], page_size=page_size, spare=6,
                                                        head_major=head_major, seed=4)
    plan = _plan(q, k_pages, v_pages, tables, positions, 11)
    mask = plan.block_mask
    heads, keys = q.shape[1], mask.seq_lengths[1]
    dense = create_mask(mask.mask_mod, 1, heads, plan.padded_rows, keys)[0]  # [Hq, rows, keys]
    q_block, kv_block = mask.BLOCK_SIZE
    listed = torch.zeros(heads, plan.padded_rows // q_block, -(-keys // kv_block), dtype=torch.int8)
    for num, indices, kind in ((mask.kv_num_blocks, mask.kv_indices, 1), (mask.full_kv_num_blocks,
                                                                          mask.full_kv_indices, 2)):
        for h in range(heads):
            for i in range(listed.shape[1]):
                hh = h if num.shape[1] > 1 else 0
                listed[h, i, indices[0, hh, i, :num[0, hh, i]].long()] = kind
    cells = listed.repeat_interleave(q_block, 1).repeat_interleave(kv_block, 2)[:, :, :keys]  # [Hq, rows, keys]
    real = torch.zeros(plan.padded_rows, dtype=torch.bool)
    real[plan.rows] = True
    assert not bool((dense & (cells == 0)).any())  # no visible pair in a skipped block
    assert bool(dense[:, real][cells[:, real] == 2].all())  # full blocks: every real pair visible
    pages_per_block = kv_block // tables.page_size if not head_major else 1
    for h, i, j in (listed > 0).nonzero().tolist():  # a listed block holds a page of its rows' sequence
        b = int(plan.row_seq[(plan.rows // q_block == i).nonzero()[0]])
        page = j // k_pages.shape[2] if head_major else j * pages_per_block
        assert set(tables.page_table[b].tolist()) & set(range(page, page + pages_per_block)), (h, i, j)
    if head_major:  # a block is one page of one head: each head skips the other heads' blocks, and most pages
        assert int((listed > 0).sum()) < listed.numel() // 4


def test_fits_says_why_not():
    q, k_pages, v_pages, tables, positions = paged_case(*MIXED)
    assert flex_paged_fits(q, k_pages, v_pages, tables, None, None, None, False) is None
    assert "gradients or ALiBi" in flex_paged_fits(q, k_pages, v_pages, tables, None, None, None, True)
    assert "gradients or ALiBi" in flex_paged_fits(q, k_pages, v_pages, tables, None, torch.ones(4), None, False)
    assert "sinks" in flex_paged_fits(q, k_pages, v_pages, tables, None, None, torch.ones(3), False)
    strided = k_pages.transpose(0, 1).contiguous().transpose(0, 1)  # stored [P, pages, Hkv, D]: no flat key axis
    assert "flat key axis" in flex_paged_fits(q, strided, v_pages, tables, None, None, None, False)
    twice = PagedBatch(tables.starts, tables.kv_lens, tables.page_table.clone(), tables.page_size)
    twice.page_table[2, 1] = twice.page_table[2, 0]
    assert "twice" in flex_paged_fits(q, k_pages, v_pages, twice, None, None, None, False)
    big = torch.zeros(1 << 17, 4, 2, 8)  # the lse's unfused path would hold Hq x rows x 2^19 scores
    assert "unfused" in flex_paged_fits(q, big, big, tables, None, None, None, False)
    assert flex_paged_fits(q, big, big, tables, None, None, None, False, return_lse=False) is None  # compiled


@pytest.fixture(scope="module")
def fresh_compiler():
    """Start the compiled cases from an empty torch.compile cache (8 kernels per function, then Flex unfused)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# (dtype, HND pools, a batch and the next step's: new tables, lengths and positions, the same pool and row bucket)
COMPILED = {"fp32-nhd-mixed": (torch.float32, False, MIXED, ([10, 14, 8, 5], [1, 6, 8, 0])),
            "bf16-hnd-mixed": (torch.bfloat16, True, MIXED, ([10, 14, 8, 5], [1, 6, 8, 0])),
            "fp32-hnd-decode": (torch.float32, True, ([9, 13, 7, 5], [1] * 4), ([10, 14, 8, 5], [1] * 4))}


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPILED)
def test_the_compiled_kernel_equals_the_oracle_and_reuses_its_shape(name, fresh_compiler):
    from torch._dynamo.utils import counters

    dtype, head_major, first, then = COMPILED[name]
    graphs = counters["stats"]["unique_graphs"]
    check(paged_case(*first, dtype=dtype, head_major=head_major), window=6, softcap=3.0, return_lse=False)
    compiled = counters["stats"]["unique_graphs"]
    assert compiled == graphs + 1  # compiled, not unfused
    check(paged_case(*then, dtype=dtype, head_major=head_major, seed=5), window=4, softcap=3.0, return_lse=False)
    assert counters["stats"]["unique_graphs"] == compiled  # the next step reuses the kernel


@st.composite
def decode_and_prefill_batches(draw):
    """Four sequences of 1..16 queries (the first 9 or more: blocks of 16 rows) over a pool of 24 pages of 4 (one
    compiled shape): random lengths, shared pages, a window or not, with it pages released (-1) or not, per-token
    positions or not, NaN in the unowned slots or not."""
    kv_lens = [draw(st.integers(9, 20)), *(draw(st.integers(1, 20)) for _ in range(3))]
    q_lens = [draw(st.integers(9 if b == 0 else 1, min(n, 16))) for b, n in enumerate(kv_lens)]
    window, released = draw(st.none() | st.integers(1, 8)), []
    if window is not None and draw(st.booleans()):  # the pages wholly before every query's window, as the cache
        released = [(b, c) for b, (n, t) in enumerate(zip(kv_lens, q_lens)) for c in range(-(-n // 4))
                    if (c + 1) * 4 <= n - t - window + 1]
    owned = sum(-(-n // 4) for n in kv_lens)
    q, k_pages, v_pages, tables, positions = paged_case(kv_lens, q_lens, share=draw(st.booleans()), spare=24 - owned,
                                                        released=released, seed=draw(st.integers(0, 99)))
    if not released and draw(st.booleans()):  # anywhere in the sequence, or before it
        g = torch.Generator().manual_seed(draw(st.integers(0, 99)))
        positions = torch.cat([torch.randint(-2, n + 2, (t,), generator=g) for n, t in zip(kv_lens, q_lens)])
    if not draw(st.booleans()):
        k_pages.nan_to_num_(0.0), v_pages.nan_to_num_(0.0)  # clean pools: the fast path
    return (q, k_pages, v_pages, tables, positions), window


@pytest.mark.slow
@settings(max_examples=25)
@given(decode_and_prefill_batches())
def test_random_batches_on_the_compiled_kernel_equal_the_oracle(problem):
    case, window = problem
    check(case, window=window, softcap=5.0, return_lse=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: run where torch.cuda.is_available()")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_the_compiled_kernel_with_its_lse_equals_the_oracle(dtype):
    # Triton's blocks: 128 query rows, key blocks of whole pages and a multiple of 128 keys; head dim >= 16.
    case = paged_case(*MIXED, page_size=16, d=16, dtype=dtype, spare=20)
    check(case, window=9, softcap=3.0, sinks=torch.tensor([0.5, -1.0, 0.0, 2.0]), device="cuda")
    check(case, device="cuda", return_lse=False)


def test_paged_attention_with_kernel_flex_runs_it_in_place_and_auto_on_cpu_does_not():
    q, k_pages, v_pages, tables, positions = paged_case([9, 13], [3, 4], seed=5)
    args = (q, k_pages, v_pages, tables.page_table, torch.tensor(tables.kv_lens), torch.tensor(tables.starts),
            positions)
    assert engine.explain_paged(*args, window=6, kernel="flex").startswith("paged: Flex reads K/V in place")
    assert "Flex" not in engine.explain_paged(*args, window=6)  # auto on the CPU: the native / fused paths
    out, lse = paged_attention(*args, window=6, kernel="flex", return_lse=True)  # (the lse: Flex unfused, no compile)
    want, want_lse = paged_attention(*args, window=6, kernel="reference", return_lse=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
