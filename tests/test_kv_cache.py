"""KVCache: one write path for prefill/chunks/decode, per-row positions, overflow, truncate, reset, memory."""

import pytest
import torch

from engine.kv_cache import KVCache, kv_cache_bytes
from engine.layer import MultiHeadAttention

B, HKV, D = 2, 2, 4


def new_kv(t, fill):
    """Keys/values ``[B, Hkv, t, D]`` whose every entry is ``fill`` (+0.5 for values): easy to spot in the cache."""
    keys = torch.full((B, HKV, t, D), float(fill))  # [B, Hkv, T, D]
    return keys, keys + 0.5


def snapshot(cache):
    return [x.clone() for x in (cache.keys, cache.values, cache.positions, cache.valid)] + [cache.length]


def assert_unchanged(cache, before):
    after = snapshot(cache)
    assert after[-1] == before[-1]
    assert all(torch.equal(a, b) for a, b in zip(after[:-1], before[:-1]))


def test_prefill_chunk_and_decode_are_one_call():
    cache = KVCache(B, HKV, capacity=8, head_dim=D)
    cache.update(*new_kv(3, 1))  # prefill 3
    cache.update(*new_kv(2, 2))  # a chunk of 2
    keys, values, positions, valid = cache.update(*new_kv(1, 3))  # decode 1
    assert cache.length == 6 and keys.shape == (B, HKV, 6, D) and values.shape == (B, HKV, 6, D)
    assert torch.equal(keys[0, 0, :, 0], torch.tensor([1.0, 1, 1, 2, 2, 3]))
    assert torch.equal(values[1, 1, :, 3], torch.tensor([1.5, 1.5, 1.5, 2.5, 2.5, 3.5]))
    assert torch.equal(positions, torch.arange(6).expand(B, 6))  # default positions continue each row
    assert bool(valid.all())
    assert keys.data_ptr() == cache.keys.data_ptr()  # a view of the preallocated storage, not a copy


def test_per_row_positions_and_padding():
    # Left padding: row 0 has 1 pad slot; decode continues each row at its own next position.
    cache = KVCache(B, HKV, capacity=6, head_dim=D)
    positions = torch.tensor([[0, 0, 1], [0, 1, 2]])
    valid = torch.tensor([[False, True, True], [True, True, True]])
    cache.update(*new_kv(3, 1), positions=positions, valid=valid)
    assert cache.next_positions.tolist() == [2, 3]
    _, _, key_positions, key_valid = cache.update(*new_kv(1, 2))
    assert torch.equal(key_positions, torch.tensor([[0, 0, 1, 2], [0, 1, 2, 3]]))
    assert torch.equal(key_valid, torch.tensor([[False, True, True, True], [True] * 4]))


def test_overflow_raises_and_leaves_the_cache_unchanged():
    cache = KVCache(B, HKV, capacity=5, head_dim=D)
    cache.update(*new_kv(4, 1))
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"overflow.*holds 4 of 5 slots.*cannot take 2"):
        cache.update(*new_kv(2, 9))
    assert_unchanged(cache, before)
    cache.update(*new_kv(1, 2))  # exactly full is fine
    assert cache.length == 5


@pytest.mark.parametrize("bad,match", [
    (dict(keys=torch.zeros(B, HKV, 1, D + 1)), r"keys must have shape \[2, 2, T, 4\].*got \[2, 2, 1, 5\]"),
    (dict(keys=torch.zeros(B + 1, HKV, 1, D)), r"keys must have shape \[2, 2, T, 4\].*got \[3, 2, 1, 4\]"),
    (dict(keys=torch.zeros(B, HKV, 1, D, dtype=torch.float64)), "keys must have the cache's dtype torch.float32"),
    (dict(values=torch.zeros(B, HKV, 2, D)), "keys and values must have the same T, got 1 and 2"),
    (dict(positions=torch.tensor([0.0])), "positions must be an integer tensor, got dtype torch.float32"),
    (dict(positions=torch.tensor([[0], [1], [2]])), r"positions must have shape \[1\] or \[2, 1\]"),
    (dict(positions=[0]), "positions must be an integer tensor .* got list"),
    (dict(valid=torch.ones(B, 1)), "valid must be a bool tensor, got dtype torch.float32"),
])
def test_bad_writes_raise_and_leave_the_cache_unchanged(bad, match):
    cache = KVCache(B, HKV, capacity=4, head_dim=D)
    cache.update(*new_kv(2, 1))
    before = snapshot(cache)
    args = dict(keys=torch.zeros(B, HKV, 1, D), values=torch.zeros(B, HKV, 1, D)) | bad
    with pytest.raises(ValueError, match=match):
        cache.update(**args)
    assert_unchanged(cache, before)


def test_truncate_rolls_back_and_reset_empties():
    cache = KVCache(B, HKV, capacity=6, head_dim=D)
    cache.update(*new_kv(4, 1))
    cache.truncate(2)
    keys, _, positions, _ = cache.update(*new_kv(1, 7))
    assert torch.equal(keys[0, 0, :, 0], torch.tensor([1.0, 1.0, 7.0]))  # slot 2 overwritten
    assert positions[0].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        cache.truncate(4)  # cannot grow by truncating
    cache.reset()
    assert cache.length == 0 and cache.next_positions.tolist() == [0, 0]
    keys, *_ = cache.update(*new_kv(1, 5))
    assert torch.equal(keys[..., 0], torch.full((B, HKV, 1), 5.0))


def test_truncated_layer_decodes_like_a_fresh_run():
    # Speculative decoding: decode 3 draft tokens, reject 2, decode others; equals a run that never saw them.
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4, 2).double()
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    drafts, accepted = torch.randn(1, 3, 16, dtype=torch.float64), torch.randn(1, 2, 16, dtype=torch.float64)
    with torch.no_grad():
        cache = layer.new_cache(1, 10)
        layer(x, cache=cache)
        layer(drafts, cache=cache)
        cache.truncate(6)  # keep the prompt and the first draft token
        out = layer(accepted, cache=cache)
        expected = layer(torch.cat([x, drafts[:, :1], accepted], dim=1))[:, 6:]
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_nbytes_matches_the_seed_formula():
    layers, batch, kv_heads, capacity, head_dim = 3, 2, 4, 16, 8
    caches = [KVCache(batch, kv_heads, capacity, head_dim, dtype=torch.float16) for _ in range(layers)]
    assert sum(c.nbytes for c in caches) == kv_cache_bytes(layers, batch, kv_heads, capacity, head_dim, 2)
    assert caches[0].bookkeeping_nbytes == batch * capacity * (8 + 1)  # int64 position + bool per slot


def test_llama3_8b_at_128k_tokens_is_17_2_gb():
    # Seed 003: 2 * 32 layers * 8 KV heads * 128 dims * 2 bytes * 131072 tokens = 17.2 GB per sequence.
    assert kv_cache_bytes(32, 1, 8, 131072, 128, 2) == 17_179_869_184
    assert round(kv_cache_bytes(32, 1, 8, 131072, 128, 2) / 1e9, 1) == 17.2
    one_layer = KVCache(1, 8, 131072, 128, dtype=torch.float16, device="meta")  # no memory allocated
    assert 32 * one_layer.nbytes == 17_179_869_184


@pytest.mark.parametrize("kwargs,match", [
    (dict(capacity=0), "capacity must be a positive int, got 0"),
    (dict(batch_size=-1), "batch_size must be a positive int, got -1"),
    (dict(kv_heads=True), "kv_heads must be a positive int, got True"),
    (dict(head_dim=2.5), "head_dim must be a positive int, got 2.5"),
    (dict(value_dim=0), "value_dim must be a positive int, got 0"),
    (dict(dtype=torch.int64), r"dtype must be a floating-point torch.dtype .*got torch.int64"),
    (dict(dtype=torch.float8_e5m2), r"dtype must be .*\(torch.float16, torch.bfloat16, torch.float32, "
                                    r"torch.float64\) or a quantized one \(torch.int8, torch.float8_e4m3fn\), "
                                    r"got torch.float8_e5m2"),
    (dict(dtype=torch.complex64), r"dtype must be a floating-point torch.dtype .*got torch.complex64"),
    (dict(dtype="float32"), r"dtype must be a floating-point torch.dtype .*got 'float32' \(str\)"),
    (dict(dtype=float), r"dtype must be a floating-point torch.dtype .*got <class 'float'> \(type\)"),
    (dict(device="gpu0"), r"device must be a torch.device, a device string .*got 'gpu0'"),
    (dict(device=2.5), r"device must be a torch.device, a device string .*got 2.5"),
])
def test_rejects_bad_construction(kwargs, match):
    args = dict(batch_size=1, kv_heads=1, capacity=4, head_dim=4) | kwargs
    with pytest.raises(ValueError, match=match):
        KVCache(**args)


def test_construction_accepts_a_device_string_and_a_value_dim():
    cache = KVCache(1, 2, 4, 4, value_dim=6, dtype=torch.float64, device="cpu")
    assert cache.keys.shape == (1, 2, 4, 4) and cache.values.shape == (1, 2, 4, 6)
    assert cache.keys.dtype == cache.values.dtype == torch.float64 and cache.keys.device == torch.device("cpu")


def test_memory_formula_rejects_negative_sizes():
    with pytest.raises(ValueError, match="tokens"):
        kv_cache_bytes(32, 1, 8, -1, 128, 2)
