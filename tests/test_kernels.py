"""Every fast kernel against the reference kernel and the float64 per-query loop, over the awkward cases."""

from __future__ import annotations

import pytest
import torch

from engine.attention import causal_attention
from engine.masks import document_mask, key_padding_mask, padding_mask, padding_positions, window_mask
from engine.reference.loops import per_query_attention
from tests.kernel_matrix import FAST


def qkv(b, hq, hkv, t, s, d, dv=None, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, s, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, s, dv or d, generator=g, dtype=dtype)
    return q, k, v


def _rising_positions(b, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 4, (b, n), generator=g).cumsum(dim=-1)  # [B, n], gaps of 1..3


def _case(name):
    """``(shape (B, Hq, Hkv, T, S, D, Dv), kwargs of causal_attention)`` for one awkward case."""
    pos300 = torch.arange(300)
    if name == "square_odd":  # T = S = 113: no tile size divides it
        return (2, 4, 2, 113, 113, 16, 16), {}
    if name == "chunked_prefill":  # T < S, default positions: queries at the last 37 of 203
        return (1, 4, 2, 37, 203, 16, 16), {}
    if name == "more_queries_than_keys":  # T > S: the first 90 queries sit at negative positions
        return (1, 2, 1, 203, 113, 8, 8), {}
    if name == "one_query":  # T = 1 against a long cache (the decode kernel's shape)
        return (2, 8, 2, 1, 1037, 16, 16), {}
    if name == "few_queries":  # T = 5 new tokens, S = 2050: decode with a causal corner
        return (2, 8, 2, 5, 2050, 16, 16), {}
    if name == "mqa":  # every query head reads the one KV head
        return (1, 6, 1, 70, 70, 8, 8), {}
    if name == "mha_odd_head_dim":  # Hq = Hkv = 3, D = 12
        return (1, 3, 3, 65, 65, 12, 12), {}
    if name == "dv_differs":  # Dv != D
        return (1, 4, 2, 90, 100, 16, 8), {}
    if name == "per_row_positions":  # every row has its own rising positions with gaps
        qp, kp = _rising_positions(3, 120, 1)[:, -40:], _rising_positions(3, 120, 1)
        return (3, 4, 2, 40, 120, 8, 8), {"query_positions": qp, "key_positions": kp}
    if name == "window":  # a sliding window of 37 keys
        return (1, 4, 2, 300, 300, 16, 16), {"allowed": window_mask(pos300, pos300, 37)}
    if name == "window_chunk":  # a window of 50 for 64 queries after 236 cached keys
        return (1, 4, 2, 64, 300, 16, 16), {"allowed": window_mask(pos300[-64:], pos300, 50)}
    if name == "documents":  # packed documents of lengths 70, 1, 129, 100
        ids = torch.repeat_interleave(torch.arange(4), torch.tensor([70, 1, 129, 100]))
        return (1, 4, 4, 300, 300, 16, 16), {"allowed": document_mask(ids)}
    if name == "padding_left":  # left-padded rows of lengths 0, 50, 130 (row 0 sees nothing)
        lengths = torch.tensor([0, 50, 130])
        return (3, 2, 1, 130, 130, 8, 8), {"allowed": padding_mask(lengths, 130, "left"),
                                            "query_positions": padding_positions(lengths, 130, "left"),
                                            "key_positions": padding_positions(lengths, 130, "left")}
    if name == "key_padding_decode":  # one query per row, caches of 0, 700 and 1300 real keys
        return (3, 8, 2, 1, 1300, 16, 16), {"allowed": key_padding_mask(torch.tensor([0, 700, 1300]), 1300)}
    if name == "dense_per_head":  # a random dense mask that differs per batch row and head
        g = torch.Generator().manual_seed(3)
        return (2, 4, 2, 77, 150, 8, 8), {"allowed": torch.rand(2, 4, 77, 150, generator=g) < 0.3}
    if name == "dense_per_key":  # a plain bool [S] mask (keys 0..59 only)
        return (1, 4, 2, 50, 180, 8, 8), {"allowed": torch.arange(180) < 60}
    if name == "composed":  # (window | first 16 keys) & documents: masks compose with & and |
        ids = torch.arange(300) // 150
        sink = torch.arange(300)[None, :] < 16
        return (1, 4, 2, 300, 300, 8, 8), {"allowed": (window_mask(pos300, pos300, 40) | sink) & document_mask(ids)}
    if name == "bidirectional":  # causal=False: only the padding mask restricts
        lengths = torch.tensor([90, 33])
        return (2, 4, 2, 90, 90, 8, 8), {"causal": False, "allowed": padding_mask(lengths, 90)}
    if name == "cross_attention":  # causal=False, T != S, no mask
        return (2, 4, 1, 33, 140, 16, 16), {"causal": False}
    if name == "softcap":  # scores capped by 5 * tanh(s / 5)
        return (1, 4, 2, 100, 130, 16, 16), {"softcap": 5.0}
    if name == "empty_rows":  # a mask that hides every key from rows 10..19
        allowed = torch.ones(80, 80, dtype=torch.bool)
        allowed[10:20] = False
        return (1, 2, 1, 80, 80, 8, 8), {"allowed": allowed}
    raise KeyError(name)


CASES = ["square_odd", "chunked_prefill", "more_queries_than_keys", "one_query", "few_queries", "mqa",
         "mha_odd_head_dim", "dv_differs", "per_row_positions", "window", "window_chunk", "documents",
         "padding_left", "key_padding_decode", "dense_per_head", "dense_per_key", "composed", "bidirectional",
         "cross_attention", "softcap", "empty_rows"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kernel", FAST)
def test_kernel_equals_the_reference_in_float64(kernel, case):
    shape, kwargs = _case(case)
    q, k, v = qkv(*shape)
    ref, ref_lse = causal_attention(q, k, v, kernel="reference", return_lse=True, **kwargs)
    out, lse = causal_attention(q, k, v, kernel=kernel, return_lse=True, **kwargs)
    assert out.dtype == q.dtype and lse.dtype == torch.float64  # fp64 stays fp64, lse included
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))  # -inf exactly where the reference's is
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", ["square_odd", "chunked_prefill", "few_queries", "per_row_positions", "window_chunk",
                                  "padding_left", "dense_per_head", "softcap", "dv_differs"])
def test_reference_equals_the_per_query_loop(case):
    # The oracle of the test above is itself checked against the independent float64 loop (one head, to
    # keep the Python loop short; GQA is checked against MHA below).
    shape, kwargs = _case(case)
    shape = (shape[0], 1, 1, *shape[3:])
    if isinstance(kwargs.get("allowed"), torch.Tensor) and kwargs["allowed"].dim() == 4:
        kwargs = {**kwargs, "allowed": kwargs["allowed"][:, :1]}
    q, k, v = qkv(*shape)
    ref = causal_attention(q, k, v, kernel="reference", **kwargs)
    dense = {key: (val.to_dense() if hasattr(val, "to_dense") else val) for key, val in kwargs.items()}
    torch.testing.assert_close(ref, per_query_attention(q, k, v, **dense), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("kernel", FAST)
def test_rows_that_see_nothing_give_zero_output_and_minus_infinity_lse(kernel):
    shape, kwargs = _case("empty_rows")
    q, k, v = qkv(*shape, dtype=torch.float32)
    out, lse = causal_attention(q, k, v, kernel=kernel, return_lse=True, **kwargs)
    assert torch.equal(out[:, :, 10:20], torch.zeros_like(out[:, :, 10:20]))
    assert bool(torch.isneginf(lse[:, :, 10:20]).all())
    assert bool(torch.isfinite(lse[:, :, :10]).all()) and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("kernel", FAST)
def test_a_cache_with_no_visible_key_gives_zeros(kernel):
    # Row 0 of key_padding_decode has 0 real keys: its whole output is 0, never NaN.
    shape, kwargs = _case("key_padding_decode")
    q, k, v = qkv(*shape, dtype=torch.float32)
    out = causal_attention(q, k, v, kernel=kernel, **kwargs)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert bool((out[1:].abs().sum(-1) > 0).all())


@pytest.mark.parametrize("kernel", FAST)
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_masked_keys_and_values_never_leak(kernel, poison):
    # Keys 150..199 hold NaN/inf; a window of 20 keeps them out of rows < 150, which must equal the clean run.
    pos = torch.arange(220)
    q, k, v = qkv(1, 4, 2, 220, 220, 16, dtype=torch.float32)
    allowed = window_mask(pos, pos, 20)
    clean = causal_attention(q, k, v, allowed=allowed, kernel=kernel)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 150:200, 3], v2[:, :, 150:200, 5] = poison, poison
    out = causal_attention(q, k2, v2, allowed=allowed, kernel=kernel)
    assert torch.equal(out[:, :, :150], clean[:, :, :150])  # bit for bit: nothing leaked
    ref = causal_attention(q, k2, v2, allowed=allowed, kernel="reference")
    assert torch.equal(torch.isnan(out), torch.isnan(ref))  # visible poison: the reference's NaN pattern
    assert bool(torch.isnan(out[:, :, 150:219]).all())  # rows 150..218 see a poisoned key
    torch.testing.assert_close(out[:, :, 219:], ref[:, :, 219:])  # row 219 sees keys 200..219 only


@pytest.mark.parametrize("kernel", FAST)
def test_a_visible_non_finite_value_poisons_only_its_channel(kernel):
    q, k, v = qkv(1, 2, 1, 40, 40, 8, dtype=torch.float32)
    v[0, 0, 30, 2] = float("inf")
    out = causal_attention(q, k, v, kernel=kernel)
    ref = causal_attention(q, k, v, kernel="reference")
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert bool(torch.isnan(out[0, :, 30:, 2]).all()) and bool(torch.isfinite(out[0, :, 30:, :2]).all())
    torch.testing.assert_close(out.nan_to_num(0.0), ref.nan_to_num(0.0))


@pytest.mark.parametrize("kernel", FAST)
def test_changing_a_future_token_leaves_past_outputs_bit_for_bit(kernel):
    q, k, v = qkv(1, 4, 2, 150, 150, 16, dtype=torch.float32)
    out = causal_attention(q, k, v, kernel=kernel)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 140:], v2[:, :, 140:] = 7.0, -7.0
    out2 = causal_attention(q, k2, v2, kernel=kernel)
    assert torch.equal(out[:, :, :140], out2[:, :, :140])
    assert not torch.equal(out[:, :, 140:], out2[:, :, 140:])


@pytest.mark.parametrize("kernel", FAST)
def test_gqa_equals_mha_with_repeated_kv_heads(kernel):
    q, k, v = qkv(2, 6, 2, 60, 600, 8, dtype=torch.float64)
    for t in (60, 3):  # prefill-like and decode-like shapes
        gqa = causal_attention(q[:, :, :t], k, v, kernel=kernel)
        mha = causal_attention(q[:, :, :t], k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1),
                               kernel=kernel)
        torch.testing.assert_close(gqa, mha, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", FAST)
def test_kernels_on_a_bigger_window_with_every_kind_of_tile(kernel):
    # A size with many tiles of every kind (empty, full, partial) and a tile-crossing window, in fp32.
    pos = torch.arange(1100)
    q, k, v = qkv(1, 4, 1, 1100, 1100, 32, dtype=torch.float32)
    allowed = window_mask(pos, pos, 300)
    out = causal_attention(q, k, v, allowed=allowed, kernel=kernel)
    ref = causal_attention(q, k, v, allowed=allowed, kernel="reference")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)


def test_a_window_plan_reads_only_the_band():
    # Every fused call stays within [i0 - w, i1); all calls together cover 1.5x the visible pairs (the two
    # half-empty 256 x 256 triangles at the band's edges), not T x S.
    from engine.inputs import prepare_inputs
    from engine.kernels.sdpa.calls import BLOCK_K, BLOCK_Q, plan_calls

    t, w = 4096, 512
    pos = torch.arange(t)
    q, k, v = qkv(1, 2, 1, t, t, 8, dtype=torch.float32)
    groups = plan_calls(prepare_inputs(q, k, v, None, None, window_mask(pos, pos, w), None), BLOCK_Q, BLOCK_K)
    calls = [call for group in groups for call in group]
    assert all(j0 >= i0 - w - BLOCK_K and j1 <= i1 for _, i0, i1, j0, j1, _ in calls)
    area = sum((i1 - i0) * (j1 - j0) for _, i0, i1, j0, j1, _ in calls)
    visible = sum(min(i + 1, w) for i in range(t))
    assert visible <= area < 1.55 * visible
    assert {kind for *_, kind in calls} == {"full", "partial", "causal"}  # the diagonal needs no mask


def test_decode_splits_the_keys_when_few_heads_would_leave_cores_idle(monkeypatch):
    # B * Hkv = 1: the cache is cut into 4 chunks of 2,048 keys merged by lse. Head 0 sees only keys < 100,
    # so three of its chunks see nothing (lse -inf parts); head 1 sees only the last chunk.
    import engine.kernels.sdpa.fused_op as flash

    shapes, fused = [], flash.FLASH

    def spy(q, k, v, *args, **kwargs):
        shapes.append(tuple(k.shape))
        return fused(q, k, v, *args, **kwargs)

    monkeypatch.setattr(flash, "FLASH", spy)
    s = 8192
    q, k, v = qkv(1, 4, 1, 1, s, 16, dtype=torch.float32)
    allowed = torch.ones(1, 4, 1, s, dtype=torch.bool)
    allowed[0, 0, 0, 100:] = False
    allowed[0, 1, 0, :6144] = False
    for mask in (None, allowed):
        out, lse = causal_attention(q, k, v, allowed=mask, kernel="decode", return_lse=True)
        ref, ref_lse = causal_attention(q, k, v, allowed=mask, kernel="reference", return_lse=True)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert shapes == [(1, 4, 2048, 16)] * 2  # one fused call over 4 chunks seen as heads, both times


def test_finiteness_check_reads_a_kv_cache_view_by_contiguous_blocks():
    # KVCache.view() is a strided slice of a longer buffer: the check runs per [L, D] head block (a strided
    # reduction is ~10x slower) and still finds a NaN/inf in any block, and ignores the unused capacity.
    from engine.kernels.nonfinite import all_finite, contiguous_blocks

    buffer = torch.zeros(2, 3, 50, 4)  # [B, Hkv, capacity, D]
    view = buffer[:, :, :40]  # [B, Hkv, L, D], not contiguous
    assert len(contiguous_blocks(view)) == 6 and all(b.is_contiguous() for b in contiguous_blocks(view))
    buffer[1, 2, 45] = float("nan")  # beyond L: not part of the view
    assert all_finite(view)
    for value in (float("nan"), float("inf"), float("-inf")):
        bad = view.clone()[:, :, :40]
        view[1, 2, 39, 3] = value
        assert not all_finite(view) and all_finite(bad)
        view[1, 2, 39, 3] = 0.0
    assert not all_finite(torch.tensor([1e38, -3e38]), torch.tensor([float("nan")]))  # overflow, then a NaN
