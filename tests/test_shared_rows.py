"""Shared K/V rows (engine.shared_rows): v given as k[..., :Dv], read once by the kernels, stored once by the caches.

Every kernel that takes such a call is checked against the float64 oracle (tests/modifier_oracle.py, written from
the definition) on the same numbers held apart; the native kernel, whose only change is what it asks memory for,
must give bitwise the same result as with v's numbers in their own buffer.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import engine
from engine.kernels.decode.native_build import native_unavailable
from engine.kv_cache import KVCache
from engine.paged import PagedKVCache, paged_attention
from engine.quantized import QuantizedKV
from engine.shared_rows import shares_rows
from tests.modifier_oracle import oracle

NATIVE = pytest.mark.skipif(native_unavailable() is not None, reason=f"{native_unavailable()}")
KERNELS = ["reference", "tiled", "decode", "decode_native", "sdpa", "sdpa_tiles", "auto"]


def test_shares_rows_only_for_a_prefix_view_of_ks_rows():
    k = torch.randn(2, 3, 10, 12)
    assert shares_rows(k, k) and shares_rows(k, k[..., :8])
    assert not shares_rows(k, k[..., :8].clone())  # equal numbers, own bytes
    assert not shares_rows(k, k[..., 4:])  # not the first columns
    assert not shares_rows(k, k[:, :, :9, :8])  # another row count
    assert not shares_rows(k, k.transpose(1, 2)[:, :, :3].transpose(1, 2)[..., :8].contiguous())
    assert not shares_rows(k[:, :1], k[:, :1].expand(2, 3, 10, 12)[:, :1, :, :4].expand(2, 2, 10, 4))
    data = torch.randint(-127, 128, (1, 1, 5, 8), dtype=torch.int8)
    scale = torch.rand(1, 1, 5)
    assert shares_rows(QuantizedKV(data, scale), QuantizedKV(data[..., :4], scale))
    assert not shares_rows(QuantizedKV(data, scale), QuantizedKV(data[..., :4], scale.clone()))


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 2), kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 4]),
       t=st.integers(1, 5), s=st.integers(1, 40), d=st.sampled_from([16, 24]), dv=st.sampled_from([8, 16]),
       kernel=st.sampled_from(KERNELS), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_every_kernel_reads_a_prefix_view_as_the_oracle_reads_the_numbers(batch, kv_heads, group, t, s, d, dv,
                                                                        kernel, dtype, seed):
    t = min(t, s)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads * group, t, d, generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, s, d, generator=gen).to(dtype)
    v = k[..., :dv]
    try:
        planned = engine.plan(q, k, v, kernel=kernel).kernel
    except ValueError as error:  # a kernel that does not take the call says so (e.g. decode for T > 16)
        assert "kernel" in str(error)
        return
    # a forced kernel that does not take Dv < D hands the call to Flex, compiled once per shape on a CPU (seconds
    # each): Flex reads prefix views on fixed shapes below, not on every shape drawn here
    assume(planned != "flex")
    out = engine.causal_attention(q, k, v, kernel=kernel)
    want, _ = oracle(q, k, k[..., :dv].clone())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.shape == want.shape and (out.double() - want).abs().max().item() <= tolerance


@pytest.mark.parametrize("dtype", [torch.float32])  # (each dtype a Flex compile of seconds; bf16's: test_paged_flex)
def test_flex_reads_a_prefix_view_as_the_oracle_reads_the_numbers(dtype):
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 3, 24, generator=gen).to(dtype)
    k = torch.randn(2, 2, 37, 24, generator=gen).to(dtype)
    v = k[..., :8]
    assert engine.plan(q, k, v, kernel="flex").kernel == "flex"
    out = engine.causal_attention(q, k, v, kernel="flex")
    want, _ = oracle(q, k, k[..., :8].clone())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.shape == want.shape and (out.double() - want).abs().max().item() <= tolerance


@NATIVE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("dv", [512, 576])  # absorbed MLA's latent, DeepSeek V4's kv (v is k)
def test_native_decode_of_shared_rows_is_bitwise_the_same_as_of_rows_apart(dtype, dv):
    torch.manual_seed(0)
    q = torch.randn(2, 16, 1, 576)
    rows = torch.randn(2, 1, 300, 576)
    if dtype == torch.int8:
        cache = KVCache(2, 1, 300, 576, value_dim=dv, dtype=torch.int8, shared_values=True)
        k, v, _, _ = cache.update(rows, None)
        apart = QuantizedKV(v.data.clone(), v.scale.clone())
    else:
        q, k = q.to(dtype), rows.to(dtype)
        v = k[..., :dv]
        apart = v.clone()
    shared = engine.plan(q, k, v, scale=192 ** -0.5)
    assert shared.kernel == "decode_native" and shares_rows(k, v)
    separate = engine.plan(q, k, apart, scale=192 ** -0.5)
    assert torch.equal(shared.run(q, k, v), separate.run(q, k, apart))


@pytest.mark.parametrize("kernel", ["reference", "tiled", "decode_native", "auto"])
def test_nan_in_hidden_shared_rows_never_reaches_the_output(kernel):
    torch.manual_seed(1)
    q = torch.randn(1, 4, 2, 16)
    k = torch.randn(1, 1, 20, 16)
    k[:, :, 18:] = float("nan")  # the rows of the future: positions 18, 19 are hidden from queries at 16, 17
    qpos, kpos = torch.tensor([16, 17]), torch.arange(20)
    if kernel == "decode_native" and native_unavailable() is not None:
        pytest.skip(native_unavailable())
    out = engine.causal_attention(q, k, k[..., :8], qpos, kpos, kernel=kernel)
    want, _ = oracle(q, k[:, :, :18], k[:, :, :18, :8].clone(), qpos, kpos[:18])
    assert torch.isfinite(out).all() and (out.double() - want).abs().max().item() <= 1e-5


def test_sparse_kernel_gathers_shared_rows_once_and_equals_the_oracle():
    torch.manual_seed(2)
    q, k = torch.randn(1, 8, 3, 32), torch.randn(1, 1, 600, 32)
    listed = torch.randint(-1, 600, (1, 1, 3, 12))
    qpos, kpos = torch.tensor([597, 598, 599]), torch.arange(600)
    out = engine.causal_attention(q, k, k[..., :16], qpos, kpos, key_indices=listed, kernel="sparse")
    allowed = torch.zeros(1, 1, 3, 600, dtype=torch.bool)
    for i in range(3):
        allowed[0, 0, i, listed[0, 0, i][listed[0, 0, i] >= 0]] = True
    want, _ = oracle(q, k, k[..., :16].clone(), qpos, kpos, allowed=allowed)
    assert (out.double() - want).abs().max().item() <= 1e-5


def test_gradients_through_shared_rows_sum_the_key_and_value_parts():
    torch.manual_seed(3)
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 6, 8, dtype=torch.float64, requires_grad=True)
    out = engine.causal_attention(q, k, k[..., :5], kernel="tiled")
    out.square().sum().backward()
    k2 = k.detach().clone().requires_grad_()
    want, _ = oracle(q.detach(), k2, k2[..., :5])
    want.square().sum().backward()
    assert torch.allclose(k.grad, k2.grad, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_a_shared_rows_cache_stores_each_row_once(dtype):
    cache = KVCache(2, 1, 8, 12, value_dim=8, dtype=dtype, shared_values=True)
    plain = KVCache(2, 1, 8, 12, value_dim=8, dtype=dtype)
    rows = torch.randn(2, 1, 5, 12)
    k, v, _, _ = cache.update(rows, None)
    pk, pv, _, _ = plain.update(rows, rows[..., :8])
    assert shares_rows(k, v)
    for mine, theirs in ((k, pk), (v, pv)):
        if dtype == torch.int8:  # one scale per row: the value part keeps the whole row's scale
            assert torch.equal(mine.data, theirs.data[..., : mine.shape[-1]]) or mine is v
            assert torch.allclose(mine.dequantize(), rows[..., : mine.shape[-1]], atol=rows.abs().max() / 127)
        else:
            assert torch.equal(mine, theirs)
    per_token = 12 * (1 if dtype == torch.int8 else 4) + (4 if dtype == torch.int8 else 0)
    assert cache.nbytes == 2 * 8 * per_token  # [B, 1, capacity] rows, one scale each when quantized
    cache.update(rows[:, :, :1], rows[:, :, :1, :8])  # a prefix view of the new keys is accepted too
    with pytest.raises(ValueError, match="values=None"):
        cache.update(rows[:, :, :1], rows[:, :, :1, :8].clone())
    with pytest.raises(ValueError, match="value_dim must be <= head_dim"):
        KVCache(1, 1, 4, 8, value_dim=9, shared_values=True)


def test_a_shared_rows_paged_cache_reads_back_as_rows_apart():
    torch.manual_seed(4)
    shared = PagedKVCache(12, 4, 1, 24, value_dim=16, shared_values=True)
    apart = PagedKVCache(12, 4, 1, 24, value_dim=16)
    rows = torch.randn(11, 1, 24)
    for cache, values in ((shared, None), (apart, rows[..., :16])):
        a, b = cache.add(), cache.add()
        cache.append([a, b], rows, values, torch.tensor([0, 6, 11]))
        cache.fork(a)  # shares a's pages: a write after this copies its partial page first
    assert shared.nbytes * 5 == apart.nbytes * 3  # 24 numbers per token against 24 + 16
    k_pages, v_pages = shared.layer(0)
    assert shares_rows(k_pages, v_pages)
    q = torch.randn(2, 4, 24)
    table, lens = shared.tables([0, 1])
    args = (table, lens, torch.tensor([0, 1, 2]))
    got = paged_attention(q, k_pages, v_pages, *args)
    want = paged_attention(q, *apart.layer(0), *apart.tables([0, 1]), torch.tensor([0, 1, 2]))
    assert torch.allclose(got, want, atol=1e-6)
    with pytest.raises(ValueError, match="values=None"):
        shared.append([0], rows[:1], rows[:1, :, :16], torch.tensor([0, 1]))
