"""paged_attention against a float64 oracle that reads each key straight through the page table (a per-query loop
written here): shuffled and shared pages, page sizes 1 to 256, partial last pages, mixed batches of decodes and
prefills, windows, softcap, sinks, ALiBi, per-token positions, GQA/MQA, NaN in every slot no sequence owns; and the
bad-table errors."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine import paged_attention
from engine.kernels.decode.native_build import native_unavailable
from tests.kernel_matrix import MATRIX
from tests.paged_cases import LAYOUTS, oracle, paged_batches, stored


@settings(max_examples=60)
@given(paged_batches(), st.sampled_from(["auto", "tiled", "reference"]))
def test_paged_attention_equals_the_oracle_reading_through_the_page_table(problem, kernel):
    assert_equals_the_oracle(*problem, kernel=kernel)


def assert_equals_the_oracle(args, options, **call):
    """``paged_attention(*args, **call)`` with the drawn options equals the oracle (fp64: to rounding); the NaN in
    unowned slots never reach an output."""
    ours = dict(options)
    if "alibi" in ours:
        ours["alibi_slopes"] = ours.pop("alibi")
    out, lse = paged_attention(*args, return_lse=True, **call, **ours)
    want, want_lse = oracle(*args, **options)
    assert not bool(out.isnan().any())
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    torch.testing.assert_close(lse, want_lse, rtol=1e-9, atol=1e-9)


@settings(max_examples=60)
@given(paged_batches(uniform=True, dtype=torch.float32))
def test_a_decode_step_read_in_place_through_the_page_table_equals_the_oracle(problem):
    # every sequence the same 1..4 queries, fp32: the native kernel reads the pages in place (no gathered copy)
    args, options = problem
    if native_unavailable() is not None:
        pytest.skip(native_unavailable())
    ours = {"window": options.get("window"), "softcap": options.get("softcap"), "alibi_slopes": options.get("alibi")}
    text = engine.explain_paged(*args, **ours)
    assert "decode_native reads K/V in place" in text, text
    out, lse = paged_attention(*args, return_lse=True, sinks=options.get("sinks"), **ours)
    want, want_lse = oracle(*args, **options)
    assert not bool(out.isnan().any())  # the NaN in unowned slots (and past each sequence's length) never leak
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def test_pages_of_one_key_whose_numbers_follow_on_are_read_as_runs_and_equal_the_oracle():
    # a packed cache read as pages of one token (transformers' continuous batching through the engine's adapter:
    # [Hkv, N, D] viewed as [N, 1, Hkv, D]); the native kernel reads page numbers that follow on as one run. Runs of
    # 1 to 133 keys, breaks inside and across its 64-key blocks, a page read by two sequences, NaN in every page no
    # sequence owns; the decode step (read in place) against the oracle, and bitwise against the same keys contiguous
    if native_unavailable() is not None:
        pytest.skip(native_unavailable())
    g = torch.Generator().manual_seed(3)
    kv_heads, q_heads, d, n = 2, 4, 16, 700
    runs = [[(10, 64), (300, 3), (400, 133)], [(699, 1)], [(100, 70)],  # (first page, count), in sequence order
            [(500, 1), (502, 1), (30, 60), (90, 5), (150, 65)]]
    tables = [torch.cat([torch.arange(first, first + count) for first, count in seq]) for seq in runs]
    lengths = torch.tensor([len(t) for t in tables])  # [B]: 200, 1, 70, 132
    table = torch.zeros(len(tables), int(lengths.max()), dtype=torch.long)
    for b, t in enumerate(tables):
        table[b, :len(t)] = t
    owned = torch.zeros(n, dtype=torch.bool)
    owned[torch.cat(tables)] = True
    k_store, v_store = torch.randn(kv_heads, n, d, generator=g), torch.randn(kv_heads, n, d, generator=g)
    k_store[:, ~owned], v_store[:, ~owned] = float("nan"), float("nan")
    k_pages, v_pages = k_store.transpose(0, 1).unsqueeze(1), v_store.transpose(0, 1).unsqueeze(1)  # [N, 1, Hkv, D]
    q = torch.randn(len(tables), q_heads, d, generator=g)  # [Nq = B, Hq, D]: one query each
    indptr = torch.arange(len(tables) + 1)
    assert "decode_native reads K/V in place" in engine.explain_paged(q, k_pages, v_pages, table, lengths, indptr)
    out, lse = paged_attention(q, k_pages, v_pages, table, lengths, indptr, return_lse=True)
    want, want_lse = oracle(q, k_pages, v_pages, table, lengths, indptr)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    for b, t in enumerate(tables):  # each sequence alone, its keys gathered contiguous: bitwise the same
        keys, values = k_store[None, :, t], v_store[None, :, t]  # [1, Hkv, S_b, D]
        alone = engine.causal_attention(q[b, :, None][None], keys, values, kernel="decode_native")  # [1, Hq, 1, D]
        assert torch.equal(alone[0, :, 0], out[b])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_a_mixed_batch_in_low_precision_is_within_its_precision(dtype):
    # one decode against 600 cached keys (the native decode kernel's shape), a chunked prefill, a prefill
    g = torch.Generator().manual_seed(0)
    page_size, kv_lens = 16, [600, 70, 9]  # with 1, 6 and 9 queries (query_indptr below)
    pages = [-(-n // page_size) for n in kv_lens]
    order = torch.randperm(sum(pages) + 2, generator=g)
    table = torch.zeros(3, max(pages), dtype=torch.long)
    for b, (start, n) in enumerate(zip([0, pages[0], pages[0] + pages[1]], pages)):
        table[b, :n] = order[start:start + n]
    k_pages = torch.randn(len(order), page_size, 2, 64, generator=g)
    v_pages = torch.randn(len(order), page_size, 2, 64, generator=g)
    indptr = torch.tensor([0, 1, 7, 16])
    q = torch.randn(16, 8, 64, generator=g)
    want, _ = oracle(q, k_pages, v_pages, table, torch.tensor(kv_lens), indptr)
    out = paged_attention(q.to(dtype), k_pages.to(dtype), v_pages.to(dtype), table, torch.tensor(kv_lens), indptr)
    tolerance = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out.double(), want, rtol=tolerance, atol=tolerance)
    text = engine.explain_paged(q, k_pages, v_pages, table, torch.tensor(kv_lens), indptr)
    # the decode read in place by decode_native beside the prefills, or gathered for decode without a compiler
    from engine.kernels.decode.native_build import native_unavailable
    assert ("sequence 0 (1 queries, 600 keys): read in place by decode_native" if native_unavailable() is None
            else "sequence 0 (1 queries, 600 keys): gathered, kernel decode") in text
    assert "sequence 1 (6 queries, 70 keys): gathered, kernel " in text
    assert "sequence 2 (9 queries, 9 keys): gathered, kernel " in text


def bad_case():
    q = torch.randn(3, 4, 8)
    k_pages, v_pages = torch.randn(5, 4, 2, 8), torch.randn(5, 4, 2, 8)
    return dict(q=q, k_pages=k_pages, v_pages=v_pages, page_table=torch.tensor([[0, 1], [2, 3]]),
                kv_lens=torch.tensor([6, 2]), query_indptr=torch.tensor([0, 1, 3]))


BAD = [
    (dict(page_table=torch.tensor([[0, 5], [2, 3]])), "page_table[0] names page 5, out of range [0, 5)"),
    (dict(page_table=torch.tensor([[0, -2], [2, 3]])), "page_table[0] names page -2"),
    (dict(page_table=torch.tensor([[0, -1], [2, 3]])), "page_table[0, 1] is -1 (a released page), but sequence 0's"),
    (dict(query_indptr=torch.tensor([0, 2, 1])), "query_indptr must run from 0 to Nq = 3, got 0 .. 1"),
    (dict(query_indptr=torch.tensor([0, 3, 2, 3]), kv_lens=torch.tensor([6, 2, 1]),
          page_table=torch.tensor([[0, 1], [2, 3], [4, 4]])), "query_indptr must not decrease, got 3 then 2"),
    (dict(kv_lens=torch.tensor([6, 1])), "kv_lens[1] = 1 is shorter than sequence 1's 2 queries"),
    (dict(kv_lens=torch.tensor([9, 2])), "kv_lens[0] = 9 needs 3 pages of 4, but page_table has 2 columns"),
    (dict(kv_lens=torch.tensor([6, -1])), "kv_lens[1] must be >= 0, got -1"),
    (dict(v_pages=torch.randn(5, 4, 1, 8)), "k_pages and v_pages must be pools of the same pages"),
    (dict(k_pages=torch.randn(5, 4, 3, 8), v_pages=torch.randn(5, 4, 3, 8)), "Query heads (4) must be a multiple of "
                                                                            "KV heads (3)"),
    (dict(k_pages=torch.randn(5, 4, 2, 6), v_pages=torch.randn(5, 4, 2, 6)), "head dim mismatch: q has D=8"),
    (dict(page_table=torch.tensor([[0.0, 1.0], [2.0, 3.0]])), "page_table must be an integer tensor"),
    (dict(kv_lens=torch.tensor([6, 2, 0])), "kv_lens must have one entry per sequence of page_table, [2]"),
    (dict(query_indptr=torch.tensor([0, 3])), "query_indptr must have B + 1 = 3 entries, got 2"),
    (dict(q=torch.randn(3, 4, 8, dtype=torch.float64)), "q, k_pages, v_pages must share one dtype"),
    (dict(q=torch.randn(3, 8)), "q must be 3-D [Nq, Hq, D]"),
]


@pytest.mark.parametrize("bad, message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_tables_raise_value_errors_naming_what_was_expected(bad, message):
    args = bad_case() | bad
    with pytest.raises(ValueError) as error:
        paged_attention(**args)
    assert message in str(error.value)


def test_a_window_and_explicit_positions_follow_the_one_rule():
    # a chunk of 3 queries at positions 4..6 of a 7-key sequence, window 2: query at 6 sees keys 5 and 6 only
    g = torch.Generator().manual_seed(1)
    k_pages, v_pages = torch.randn(2, 4, 1, 4, generator=g), torch.randn(2, 4, 1, 4, generator=g)
    q = torch.randn(3, 1, 4, generator=g)
    table, lens, indptr = torch.tensor([[1, 0]]), torch.tensor([7]), torch.tensor([0, 3])
    out = paged_attention(q, k_pages, v_pages, table, lens, indptr, torch.tensor([4, 5, 6]), window=2)
    keys = torch.cat([k_pages[1], k_pages[0]])[:7, 0]  # [7, 4] in key order
    values = torch.cat([v_pages[1], v_pages[0]])[:7, 0]
    weights = torch.softmax(q[2, 0] @ keys[5:7].T / 2, dim=0)
    torch.testing.assert_close(out[2, 0], weights @ values[5:7])


def test_pools_with_a_strided_last_axis_take_the_gathered_path_and_stay_exact():
    g = torch.Generator().manual_seed(2)
    k_wide, v_wide = torch.randn(4, 4, 2, 16, generator=g), torch.randn(4, 4, 2, 16, generator=g)
    k_pages, v_pages = k_wide[..., ::2], v_wide[..., ::2]  # [4, 4, 2, 8], stride 2 on the last axis
    q = torch.randn(2, 4, 8, generator=g)
    table, lens, indptr = torch.tensor([[3, 1], [0, 2]]), torch.tensor([7, 5]), torch.arange(3)
    assert "gathered" in engine.explain_paged(q, k_pages, v_pages, table, lens, indptr)
    want, _ = oracle(q, k_pages, v_pages, table, lens, indptr)
    torch.testing.assert_close(paged_attention(q, k_pages, v_pages, table, lens, indptr).double(), want, rtol=1e-5,
                               atol=1e-5)



def test_gradients_flow_through_the_gathered_path_to_q_and_the_pools():
    # training over a paged cache: the gathered path runs (the in-place kernel has no backward; explain says which)
    # and autograd reaches q and every owned slot of the pools; unowned slots get 0
    g = torch.Generator().manual_seed(3)
    k_pages = torch.randn(5, 4, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v_pages = torch.randn(5, 4, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    q = torch.randn(3, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    table, lens, indptr = torch.tensor([[3, 0], [1, 4]]), torch.tensor([6, 3]), torch.tensor([0, 1, 3])
    assert "gathered" in engine.explain_paged(q, k_pages, v_pages, table, lens, indptr)
    out = paged_attention(q, k_pages, v_pages, table, lens, indptr)
    want, _ = oracle(q, k_pages, v_pages, table, lens, indptr)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum(), (q, k_pages, v_pages))
    expected = torch.autograd.grad((want * w).sum(), (q, k_pages, v_pages))
    for ours, theirs in zip(got, expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    assert torch.equal(got[1][2], torch.zeros_like(got[1][2]))  # page 2 is nobody's


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_low_precision_decode_step_read_in_place_is_within_its_precision(dtype):
    # one query per sequence, pools in bf16 / fp16 (converted in the kernel's registers), ragged lengths
    if native_unavailable() is not None:
        pytest.skip(native_unavailable())
    g = torch.Generator().manual_seed(4)
    page_size, lens = 16, [600, 37, 1]
    table = torch.randperm(3 * 38, generator=g).view(3, 38)  # 38 pages each: 600 keys need 38
    k_pages, v_pages = (torch.randn(3 * 38, page_size, 2, 64, generator=g) for _ in range(2))
    q = torch.randn(3, 8, 64, generator=g)
    args = (table, torch.tensor(lens), torch.arange(4))
    low = (q.to(dtype), k_pages.to(dtype), v_pages.to(dtype))
    assert "decode_native reads K/V in place" in engine.explain_paged(*low, *args)
    want, _ = oracle(*(x.double() for x in low), *args)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(paged_attention(*low, *args).double(), want, rtol=tolerance, atol=tolerance)


@contextlib.contextmanager
def small_runs(run_keys: int):
    """RUN_KEYS and CASCADE_MIN_KEYS made small, so short sequences take the paths long ones take."""
    import engine.paged.cascade as cascade_module
    import engine.paged.runs as runs_module
    saved = runs_module.RUN_KEYS, cascade_module.CASCADE_MIN_KEYS
    runs_module.RUN_KEYS, cascade_module.CASCADE_MIN_KEYS = run_keys, 2
    try:
        yield
    finally:
        runs_module.RUN_KEYS, cascade_module.CASCADE_MIN_KEYS = saved


@settings(max_examples=80, deadline=None)
@given(problem=paged_batches(), cascade=st.sampled_from([True, None, False]), run_keys=st.sampled_from([1, 3, 8]))
def test_runs_of_pages_and_shared_prefix_passes_equal_the_oracle(problem, cascade, run_keys):
    # keys a run of pages at a time (engine.paged.runs), and each shared prefix once for all its sequences
    # (engine.paged.cascade), against the oracle that reads every key through the page table
    with small_runs(run_keys):
        assert_equals_the_oracle(*problem, cascade=cascade)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_runs_of_several_pages_gather_each_heads_keys_in_order_in_every_pool_layout(layout):
    # runs of 4 keys over pages of 2, shuffled: each run gathers two pages (engine.paged.runs.run_keys, a path per
    # memory order); causal queries at every position, so a page read out of order or from the wrong place shows
    g = torch.Generator().manual_seed(11)
    k_pool, v_pool = torch.randn(9, 2, 2, 8, generator=g, dtype=torch.float64), torch.randn(9, 2, 2, 8, generator=g,
                                                                                               dtype=torch.float64)
    k_pool, v_pool = stored(k_pool, layout), stored(v_pool, layout)
    table, lens = torch.tensor([[7, 2, 5, 0, 8]]), torch.tensor([9])
    q, indptr = torch.randn(9, 4, 8, generator=g, dtype=torch.float64), torch.tensor([0, 9])
    with small_runs(4):
        assert "by runs of 4 keys" in engine.explain_paged(q, k_pool, v_pool, table, lens, indptr)
        out = paged_attention(q, k_pool, v_pool, table, lens, indptr)
    torch.testing.assert_close(out, oracle(q, k_pool, v_pool, table, lens, indptr)[0], rtol=1e-9, atol=1e-9)


def test_explain_names_the_shared_prefix_pass_and_the_runs_of_pages():
    g = torch.Generator().manual_seed(5)
    pool = torch.randn(12, 4, 2, 8, generator=g)
    table = torch.tensor([[0, 1, 2, 3], [0, 1, 4, 5], [6, 7, 8, 9]])  # sequences 0 and 1 share 8 keys
    lens, q, indptr = torch.tensor([14, 16, 13]), torch.randn(3, 4, 8, generator=g), torch.arange(4)
    slopes = torch.rand(4, generator=g)
    with small_runs(8):  # tiled forced: the prefix and the suffixes go by runs of pages
        text = engine.explain_paged(q, pool, pool, table, lens, indptr, alibi_slopes=slopes, kernel="tiled")
        out = paged_attention(q, pool, pool, table, lens, indptr, alibi_slopes=slopes, kernel="tiled")
    assert "sequences [0, 1] share their first 8 keys: read once for their 2 queries" in text, text
    assert "(kernel='tiled' forced)" in text, text
    assert "sequence 2 (1 queries, 13 keys): by runs of 8 keys" in text, text
    torch.testing.assert_close(out.double(), oracle(q, pool, pool, table, lens, indptr, alibi=slopes)[0], rtol=1e-5,
                               atol=1e-5)
    for options, oracle_options in (({"softcap": 5.0}, {"softcap": 5.0}), ({"alibi_slopes": slopes}, {"alibi": slopes}),
                                    ({"softcap": 5.0, "alibi_slopes": slopes}, {"softcap": 5.0, "alibi": slopes})):
        if native_unavailable() is not None:
            break
        with small_runs(8):  # the native kernel adds them itself: the prefix's pass and the suffixes alike
            text = engine.explain_paged(q, pool, pool, table, lens, indptr, **options)
            out = paged_attention(q, pool, pool, table, lens, indptr, **options)
        assert "for their 2 queries (decode_native in place)" in text and "runs of" not in text, text
        torch.testing.assert_close(out.double(), oracle(q, pool, pool, table, lens, indptr, **oracle_options)[0],
                                   rtol=1e-5, atol=1e-5)
    assert "share" not in engine.explain_paged(q, pool, pool, table, lens, indptr, cascade=False)


@pytest.mark.parametrize("kernel", MATRIX)
@settings(max_examples=15, deadline=None)
@given(problem=paged_batches(), run_keys=st.sampled_from([4, 4096]))
def test_every_kernel_of_the_matrix_serves_the_paged_paths(kernel, problem, run_keys):
    # each sequence's call forced to one kernel (one that does not fit passes the call on, as for any call), over
    # gathered sequences and runs of pages alike (run_keys 4: the runs path)
    with small_runs(run_keys):
        assert_equals_the_oracle(*problem, kernel=kernel, cascade=False)


@pytest.mark.parametrize("call", [dict(kernel="reference"), dict(kernel="tiled"), dict(softcap=5.0), {}], ids=str)
def test_queries_of_a_sequence_with_no_keys_give_zero_and_minus_inf(call):
    # sequence 0 has no keys yet two queries (explicit positions); sequence 1 is ordinary
    g = torch.Generator().manual_seed(7)
    k_pages, v_pages = torch.randn(4, 4, 2, 8, generator=g, dtype=torch.float64), \
        torch.randn(4, 4, 2, 8, generator=g, dtype=torch.float64)
    q = torch.randn(3, 4, 8, generator=g, dtype=torch.float64)
    args = (q, k_pages, v_pages, torch.tensor([[0, 1], [2, 3]]), torch.tensor([0, 6]), torch.tensor([0, 2, 3]),
            torch.tensor([0, 3, 5]))
    out, lse = paged_attention(*args, return_lse=True, **call)
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and bool(torch.isneginf(lse[:2]).all())
    want, want_lse = oracle(*args, softcap=call.get("softcap"))
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse[2], want_lse[2], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("call", [dict(softcap=5.0), dict(kernel="tiled"), {}], ids=str)
def test_a_fork_at_exactly_the_shared_prefix_length_equals_the_oracle_and_is_explained(call):
    # two forks of a 256-key prompt: one has 5 more keys, the other none past the prefix; the cascade forced
    g = torch.Generator().manual_seed(8)
    k_pages, v_pages = (torch.randn(18, 16, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    table = torch.tensor([list(range(17)), list(range(16)) + [17]])  # pages 0..15 shared
    args = (torch.randn(2, 4, 8, generator=g, dtype=torch.float64), k_pages, v_pages, table,
            torch.tensor([261, 256]), torch.tensor([0, 1, 2]))
    text = engine.explain_paged(*args, cascade=True, **call)
    assert "share their first 256 keys" in text, text
    out = paged_attention(*args, cascade=True, **call)
    torch.testing.assert_close(out, oracle(*args, softcap=call.get("softcap"))[0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out, paged_attention(*args, cascade=False, **call), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scale, message", [(True, "got True (bool)"), ("2", "got '2' (str)"),
                                            (torch.tensor(0.5, requires_grad=True), "requires grad"),
                                            (float("nan"), "finite number")], ids=str)
@pytest.mark.parametrize("path", ["in place", "gathered"])
def test_every_paged_path_refuses_a_bad_scale_alike(scale, message, path):
    g = torch.Generator().manual_seed(9)
    k_pages, v_pages = torch.randn(4, 4, 2, 8, generator=g), torch.randn(4, 4, 2, 8, generator=g)
    q = torch.randn(2, 4, 8, generator=g)
    args = (q, k_pages, v_pages, torch.tensor([[0], [1]]), torch.tensor([3, 4]), torch.tensor([0, 1, 2]))
    kernel = "auto" if path == "in place" else "reference"
    if path == "in place" and native_unavailable() is None:
        assert "decode_native reads K/V in place" in engine.explain_paged(*args)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        paged_attention(*args, scale=scale, kernel=kernel)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        engine.explain_paged(*args, scale=scale, kernel=kernel)
    torch.testing.assert_close(paged_attention(*args, scale=torch.tensor(0.5), kernel=kernel),
                               paged_attention(*args, scale=0.5, kernel="reference"))
