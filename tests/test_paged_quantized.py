"""paged_attention over int8 / fp8 pages (QuantizedKV pools, per-token scales) and over page tables with released
pages (-1, a sliding-window cache's), against the float64 oracle of tests.paged_cases: the quantized oracle reads
the dequantized pools, so each kernel is checked exactly (up to fp32 rounding) and the quantization error apart."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine import paged_attention
from engine.kernels.decode.native_build import native_unavailable
from engine.quantized import QUANTIZED_DTYPES, QuantizedKV, quantize
from tests.paged_cases import oracle, paged_batches

QUANTIZED = list(QUANTIZED_DTYPES)


def quantized_pool(pool: torch.Tensor, dtype: torch.dtype) -> QuantizedKV:
    """``pool [num_pages, page_size, Hkv, E]`` quantized per token and head (NaN slots read back as NaN)."""
    stored = quantize(pool.permute(0, 2, 1, 3), dtype)  # [num_pages, Hkv, page_size, E]
    return QuantizedKV(stored.data.permute(0, 2, 1, 3), stored.scale.permute(0, 2, 1))


def dequantized_pool(pool: QuantizedKV) -> torch.Tensor:
    return pool.data.double() * pool.scale[..., None].double()  # [num_pages, page_size, Hkv, E]


def released_table(page_table, kv_lens, query_indptr, positions, window, page_size) -> torch.Tensor:
    """``page_table`` with -1 for every owned page whose keys no query of its sequence can see (the pages a
    sliding-window cache gives back)."""
    table = page_table.clone()
    for b in range(table.shape[0]):
        start, stop, length = int(query_indptr[b]), int(query_indptr[b + 1]), int(kv_lens[b])
        pos = positions[start:stop] if positions is not None else torch.arange(length - (stop - start), length)
        for column in range(-(-length // page_size)):
            j0, j1 = column * page_size, min((column + 1) * page_size, length) - 1
            if bool(((pos < j0) | (pos - j1 >= window)).all()):
                table[b, column] = -1
    return table


def options_of(options: dict) -> dict:
    ours = dict(options)
    if "alibi" in ours:
        ours["alibi_slopes"] = ours.pop("alibi")
    return ours


@settings(max_examples=40, deadline=None)
@given(paged_batches(dtype=torch.float32), st.sampled_from(QUANTIZED))
def test_quantized_pages_equal_the_oracle_on_their_dequantized_values(problem, dtype):
    (q, k_pages, v_pages, *tables), options = problem
    k_q, v_q = quantized_pool(k_pages, dtype), quantized_pool(v_pages, dtype)
    out, lse = paged_attention(q, k_q, v_q, *tables, return_lse=True, **options_of(options))
    want, want_lse = oracle(q, dequantized_pool(k_q), dequantized_pool(v_q), *tables, **options)
    assert not bool(out.isnan().any())  # unowned slots read back as NaN (a NaN scale): never in an output
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    torch.testing.assert_close(lse.double(), want_lse, rtol=2e-5, atol=2e-5)


@settings(max_examples=40, deadline=None)
@given(paged_batches(uniform=True, dtype=torch.float32), st.sampled_from(QUANTIZED))
def test_a_quantized_decode_step_is_read_in_place_and_equals_the_oracle(problem, dtype):
    if native_unavailable() is not None:
        pytest.skip(native_unavailable())
    (q, k_pages, v_pages, *tables), options = problem
    k_q, v_q = quantized_pool(k_pages, dtype), quantized_pool(v_pages, dtype)
    text = engine.explain_paged(q, k_q, v_q, *tables, window=options.get("window"))
    assert "decode_native reads K/V in place" in text, text
    out, lse = paged_attention(q, k_q, v_q, *tables, return_lse=True, **options_of(options))
    want, want_lse = oracle(q, dequantized_pool(k_q), dequantized_pool(v_q), *tables, **options)
    assert not bool(out.isnan().any())
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("page_size", [48, 96])
@pytest.mark.parametrize("dtype", QUANTIZED, ids=str)
def test_quantized_pages_whose_runs_split_a_block_equal_the_oracle(dtype, page_size):
    # A block of 64 keys over pages of 48 or 96 is read as two runs of keys, each its own page (48 + 16, 32 + 32):
    # each run's scales must land at its own keys (runs of 32 or more are filled in a loop of their own). Keys of
    # very different sizes make every scale count.
    g = torch.Generator().manual_seed(11)
    hkv, d, lens = 2, 32, torch.tensor([300, 217])
    per_sequence = -(-300 // page_size)
    sizes = torch.exp(3 * torch.randn(2 * per_sequence, page_size, hkv, 1, generator=g))  # per key and head
    k_pages = torch.randn(2 * per_sequence, page_size, hkv, d, generator=g) * sizes
    v_pages = torch.randn(2 * per_sequence, page_size, hkv, d, generator=g) * sizes.flip(1)
    table = torch.randperm(2 * per_sequence, generator=g).view(2, per_sequence)
    q, indptr = torch.randn(2, 8, d, generator=g) / 8, torch.arange(3)
    k_q, v_q = quantized_pool(k_pages, dtype), quantized_pool(v_pages, dtype)
    out, lse = paged_attention(q, k_q, v_q, table, lens, indptr, return_lse=True)
    want, want_lse = oracle(q, dequantized_pool(k_q), dequantized_pool(v_q), table, lens, indptr)
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", QUANTIZED, ids=str)
def test_quantized_pages_stay_within_the_quantization_bound_of_full_precision(dtype):
    # the error against the unquantized pools is the cache's, not the kernel's: int8 and fp8 both well under 0.1
    g = torch.Generator().manual_seed(3)
    k_pages, v_pages = torch.randn(40, 16, 2, 64, generator=g), torch.randn(40, 16, 2, 64, generator=g)
    table, lens = torch.randperm(40, generator=g)[:36].view(4, 9), torch.tensor([144, 100, 7, 130])
    q, indptr = torch.randn(4, 8, 64, generator=g), torch.arange(5)
    exact = paged_attention(q, k_pages, v_pages, table, lens, indptr)
    approx = paged_attention(q, quantized_pool(k_pages, dtype), quantized_pool(v_pages, dtype), table, lens, indptr)
    error = (approx - exact).abs().max().item()
    assert 0 < error < {torch.int8: 0.01}.get(dtype, 0.1), error


@settings(max_examples=50, deadline=None)
@given(paged_batches(), st.integers(1, 8))
def test_released_pages_outside_every_window_are_never_read(problem, window):
    (q, k_pages, v_pages, page_table, kv_lens, indptr, positions), options = problem
    options["window"] = window
    page_size = k_pages.shape[1]
    table = released_table(page_table, kv_lens, indptr, positions, window, page_size)
    poisoned_k, poisoned_v = k_pages.clone(), v_pages.clone()
    for page in set(page_table[page_table != 10**6].tolist()) - set(table[table >= 0].tolist()) - {10**6}:
        if 0 <= page < poisoned_k.shape[0]:
            poisoned_k[page], poisoned_v[page] = float("nan"), float("inf")  # a page given back and reused
    out, lse = paged_attention(q, poisoned_k, poisoned_v, table, kv_lens, indptr, positions, return_lse=True,
                               **options_of(options))
    want, want_lse = oracle(q, k_pages, v_pages, page_table, kv_lens, indptr, positions, **options)
    assert not bool(out.isnan().any())
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse, want_lse, rtol=1e-9, atol=1e-9)


def test_a_released_page_a_query_can_see_is_refused_naming_the_query():
    q, pool = torch.randn(1, 2, 8), torch.randn(4, 4, 2, 8)
    table, lens, indptr = torch.tensor([[-1, 1, 2]]), torch.tensor([12]), torch.tensor([0, 1])
    paged_attention(q, pool, pool, table, lens, indptr, window=8)  # query at 11 sees keys 4..11: page 0 unseen
    with pytest.raises(ValueError, match=r"page_table\[0, 0\] is -1 .* query at position 11 sees its keys 0..3 "
                                         r"\(window=9\)"):
        paged_attention(q, pool, pool, table, lens, indptr, window=9)
