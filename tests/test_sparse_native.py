"""A decode step or a prefill with ``key_indices`` on the native kernel (engine.kernels.decode.native_listed): only
each query's listed keys read, through a page table of one-key pages (any T: every query its own sequence; one list
for every head read as a pool of Hkv heads, a list per head as pools of one). Checked against the per-query float64
oracle of tests/test_sparse.py (written from the definition), in fp32 / bf16 and on an int8 cache, on a KVCache's
strided views, with repeats, -1, rows listing nothing visible, a window, NaN in unlisted keys, per-row positions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine.kernels.decode.native_build import native_unavailable
from engine.kv_cache import KVCache
from engine.masks.window import window_mask
from tests.test_sparse import index_oracle

pytestmark = pytest.mark.skipif(native_unavailable() is not None, reason=f"{native_unavailable()}")


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 2), kv_heads=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 3, 4]),
       t=st.sampled_from([1, 2, 4, 17, 40]), s=st.integers(5, 300), top=st.integers(1, 40), shared_list=st.booleans(),
       window=st.sampled_from([None, 7, 50]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int8]),
       seed=st.integers(0, 2**16))
def test_listed_decode_equals_the_oracle(batch, kv_heads, group, t, s, top, shared_list, window, dtype, seed):
    t = min(t, s)
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(batch, kv_heads, s + 9, 32, dtype=dtype)  # capacity > length: strided views
    keys, values = torch.randn(2, batch, kv_heads, s, 32, generator=g)
    if dtype == torch.bfloat16:
        keys, values = keys.bfloat16(), values.bfloat16()
    k, v, _, _ = cache.update(keys, values)
    q = torch.randn(batch, kv_heads * group, t, 32, generator=g)
    if dtype == torch.bfloat16:
        q = q.bfloat16()
    listed = torch.randint(-1, s, (batch, 1 if shared_list else kv_heads, t, top), generator=g)
    listed[..., -1] = listed[..., 0]  # a repeat counts once
    qpos, kpos = torch.arange(s - t, s), torch.arange(s)
    allowed = None if window is None else window_mask(qpos, kpos, window)
    step = engine.plan(q, k, v, qpos, kpos, allowed, key_indices=listed)
    assert step.kernel == "decode_native" and "only each query's listed keys" in str(step), str(step)
    out = step.run(q, k, v)
    full_k, full_v = (x.dequantize() if dtype == torch.int8 else x for x in (k, v))
    dense = None if window is None else (qpos[:, None] - kpos[None, :]) < window  # [T, S]: the window's rule
    want, _ = index_oracle(q, full_k, full_v, listed, qpos, kpos, dense)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert (out.double() - want).abs().max().item() <= tolerance


def test_nan_in_unlisted_keys_never_leaks_and_a_row_that_sees_nothing_gives_zero():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 1, 64, generator=g)
    k, v = (torch.randn(2, 2, 4000, 64, generator=g) for _ in range(2))
    listed = torch.randint(0, 4000, (2, 2, 1, 50), generator=g)
    listed[1, 0] = -1  # KV head 0 of row 1 lists nothing
    seen = torch.zeros(2, 2, 4000, dtype=torch.bool)
    for b in range(2):
        for h in range(2):
            seen[b, h, listed[b, h, 0].clamp(min=0)] = listed[b, h, 0] >= 0
    k_nan = torch.where(seen[..., None], k, float("nan"))
    v_nan = torch.where(seen[..., None], v, float("inf"))
    step = engine.plan(q, k_nan, v_nan, key_indices=listed)
    assert step.kernel == "decode_native"
    out, lse = engine.causal_attention(q, k_nan, v_nan, key_indices=listed, return_lse=True)
    want, want_lse = index_oracle(q, k, v, listed)
    assert torch.isfinite(out).all() and (out.double() - want).abs().max().item() <= 1e-5
    assert torch.equal(out[1, :4], torch.zeros_like(out[1, :4])) and lse[1, :4].isneginf().all()
    assert torch.equal(lse.isneginf(), want_lse.isneginf())


def test_per_row_positions_and_strides_changed_after_planning():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 2, 16, generator=g)
    k, v = (torch.randn(2, 1, 200, 16, generator=g) for _ in range(2))
    qpos = torch.tensor([[150, 151], [198, 199]])  # row 0's queries sit at 150: its later keys are hidden
    kpos = torch.arange(200).expand(2, 200)
    listed = torch.randint(0, 200, (2, 1, 2, 30), generator=g)
    step = engine.plan(q, k, v, qpos, kpos, key_indices=listed)
    want = torch.cat([index_oracle(q[b:b + 1], k[b:b + 1], v[b:b + 1], listed[b:b + 1], qpos[b], kpos[b])[0]
                      for b in range(2)])  # (the oracle takes one row's positions)
    assert step.kernel == "decode_native" and (step.run(q, k, v).double() - want).abs().max().item() <= 1e-5
    wide = torch.zeros(2, 1, 200, 48)
    wide[..., :16] = k  # the same keys in a buffer of other strides: still read right (the dense path takes it)
    assert (step.run(q, wide[..., :16], v).double() - want).abs().max().item() <= 1e-5
