"""MultiHeadAttention: the nine steps against the seed's listing, cached decoding == the full forward pass,
masks passing through (window, padding, documents, bidirectional), MHA/GQA/MQA."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.attention import merge_heads, split_heads
from engine.kv_cache import KVCache
from engine.layer import MultiHeadAttention
from engine.masks.documents import document_mask, document_positions
from engine.masks.padding import key_padding_mask, padding_positions
from engine.rope import apply_rope
from tests.precision import assert_within_precision  # tests/precision.py: the 2 x plain-error rule

E = 32  # model width for every test layer
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}  # (Hq, Hkv)


def make_layer(kind="gqa", dtype=torch.float32, seed=0, **kwargs) -> MultiHeadAttention:
    torch.manual_seed(seed)
    hq, hkv = HEADS[kind]
    return MultiHeadAttention(E, hq, hkv, **kwargs).to(dtype)


def seed_listing(layer, x, positions, window=None, valid=None, causal=True, scale=None, softcap=None):
    """Seed 003's listing in fp64 with an explicit visibility loop: the oracle for the layer.

    ``scale`` (default 1 / sqrt(D)) and ``softcap`` are taken as given, never read from the layer."""
    layer = layer.double()
    x = x.double()
    b, t, _ = x.shape
    hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = (x @ layer.q_proj.weight.T).view(b, t, hq, d).transpose(1, 2)  # [B, Hq, T, D]
    k = (x @ layer.k_proj.weight.T).view(b, t, hkv, d).transpose(1, 2)  # [B, Hkv, T, D]
    v = (x @ layer.v_proj.weight.T).view(b, t, hkv, d).transpose(1, 2)  # [B, Hkv, T, D]
    if layer.rope_base is not None:
        q, k = apply_rope(q, positions, layer.rope_base), apply_rope(k, positions, layer.rope_base)
    k = k.repeat_interleave(hq // hkv, dim=1)  # [B, Hq, T, D]
    v = v.repeat_interleave(hq // hkv, dim=1)  # [B, Hq, T, D]
    scores = q @ k.transpose(-2, -1) * (1 / math.sqrt(d) if scale is None else scale)  # [B, Hq, T, T]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)  # after scaling (Gemma-2)
    visible = torch.zeros(b, 1, t, t, dtype=torch.bool)
    for row in range(b):
        for i in range(t):
            for j in range(t):
                ok = (not causal) or positions[row, j] <= positions[row, i]
                if window is not None:
                    ok = ok and positions[row, i] - positions[row, j] < window
                if valid is not None:
                    ok = ok and bool(valid[row, i]) and bool(valid[row, j])
                visible[row, 0, i, j] = ok
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)  # empty rows -> 0
    out = (weights @ v).transpose(1, 2).reshape(b, t, hq * d)  # [B, T, Hq*D]
    return out @ layer.o_proj.weight.T  # [B, T, E]


def run_cached(layer, x, prompt_len, chunk, positions=None, valid=None):
    """Prefill ``prompt_len`` tokens in chunks of ``chunk``, then decode one token at a time; concatenate outputs."""
    b, t, _ = x.shape
    cache = layer.new_cache(b, t + 3)
    bounds = list(range(0, prompt_len, chunk)) + list(range(prompt_len, t))
    outs = []
    for start, end in zip(bounds, bounds[1:] + [t]):
        pos = None if positions is None else positions[:, start:end]
        val = None if valid is None else valid[:, start:end]
        outs.append(layer(x[:, start:end], positions=pos, cache=cache, valid=val))
    assert cache.length == t
    return torch.cat(outs, dim=1)  # [B, T, E]


@pytest.mark.parametrize("kind", sorted(HEADS))
@pytest.mark.parametrize("window", [None, 3])
def test_layer_matches_seed_listing(kind, window):
    layer = make_layer(kind, torch.float64, window=window)
    x = torch.randn(2, 9, E, dtype=torch.float64)
    positions = torch.arange(9).expand(2, 9)
    expected = seed_listing(layer, x, positions, window=window)
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-12)


def test_heads_are_split_then_transposed():
    # Head 1 of token 2 holds features 4..8 of token 2 (H = 2, Dh = 4); merge undoes split exactly.
    x = torch.arange(2 * 3 * 8, dtype=torch.float32).view(2, 3, 8)
    heads = split_heads(x, 2)  # [B, H, T, Dh]
    assert torch.equal(heads[:, 1, 2], x[:, 2, 4:8])
    assert torch.equal(merge_heads(heads), x)


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(1, 7), h=st.integers(1, 4), dh=st.integers(1, 5))
def test_property_split_merge_round_trip(b, t, h, dh):
    x = torch.randn(b, t, h * dh)
    assert torch.equal(merge_heads(split_heads(x, h)), x)
    heads = torch.randn(b, h, t, dh)
    assert torch.equal(split_heads(merge_heads(heads), h), heads)


# Cached step-by-step decoding == the full forward pass. Cases: batch 1 and 3; prompt of 1 token (decode
# from the start), odd lengths 5 and 13; chunks of 1 (token by token), 4 (does not divide 13) and the whole
# prompt; MHA/GQA/MQA; no window and a window of 4 (shorter than the sequence).
CACHED_CASES = [
    (batch, prompt, chunk, kind, window)
    for batch, prompt, chunk in [(1, 1, 1), (3, 5, 5), (1, 13, 4), (3, 13, 1), (2, 13, 13)]
    for kind in sorted(HEADS)
    for window in (None, 4)
]


@pytest.mark.parametrize("batch,prompt,chunk,kind,window", CACHED_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_decoding_equals_full_forward(batch, prompt, chunk, kind, window, dtype):
    layer = make_layer(kind, dtype, window=window)
    x = torch.randn(batch, prompt + 6, E)
    with torch.no_grad():
        full = layer(x.to(dtype))
        cached = run_cached(layer, x.to(dtype), prompt, chunk)
        reference = make_layer(kind, torch.float64, window=window)(x.double())
    assert_within_precision(cached, reference.double(), full, dtype)


def test_future_tokens_do_not_change_past_outputs():
    layer = make_layer("gqa")
    x = torch.randn(2, 7, E)
    y = x.clone()
    y[:, -1] = torch.randn(2, E)
    with torch.no_grad():
        a, b = layer(x), layer(y)
    assert torch.equal(a[:, :-1], b[:, :-1])  # bit for bit
    assert not torch.equal(a[:, -1], b[:, -1])


def _ragged_batch(side):
    """Three rows of lengths 3, 6, 4 padded to 6 on ``side``; returns (x, positions, valid, lengths)."""
    lengths = torch.tensor([3, 6, 4])
    x = torch.randn(3, 6, E, dtype=torch.float64)
    valid = key_padding_mask(lengths, 6, side)[:, 0, 0]  # [B, L]: True at real tokens
    return x, padding_positions(lengths, 6, side), valid, lengths.tolist()


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("kind,window", [("gqa", None), ("mqa", 2)])
def test_padded_batch_equals_each_row_alone(side, kind, window):
    layer = make_layer(kind, torch.float64, window=window)
    x, positions, valid, lengths = _ragged_batch(side)
    with torch.no_grad():
        out = layer(x, positions=positions, valid=valid)
        cached = run_cached(layer, x, prompt_len=2, chunk=2, positions=positions, valid=valid)
        for row, n in enumerate(lengths):
            alone = layer(x[row:row + 1][valid[row:row + 1]].view(1, n, E))  # the row without padding
            torch.testing.assert_close(out[row][valid[row]], alone[0], rtol=0, atol=1e-12)
            torch.testing.assert_close(cached[row][valid[row]], alone[0], rtol=0, atol=1e-12)
    assert torch.equal(out[~valid], torch.zeros_like(out[~valid]))  # pad queries see nothing: output 0


@pytest.mark.parametrize("side", ["left", "right"])
def test_ragged_decode_continues_each_row_at_its_own_position(side):
    # After a padded prefill, decode steps without explicit positions continue each row at its length.
    layer = make_layer("gqa", torch.float64)
    x, positions, valid, lengths = _ragged_batch(side)
    steps = torch.randn(3, 2, E, dtype=torch.float64)  # two decode tokens per row
    with torch.no_grad():
        cache = layer.new_cache(3, 10)
        layer(x, positions=positions, cache=cache, valid=valid)
        assert cache.next_positions.tolist() == lengths
        decoded = torch.cat([layer(steps[:, i:i + 1], cache=cache) for i in range(2)], dim=1)  # [3, 2, E]
        for row, n in enumerate(lengths):
            alone = torch.cat([x[row][valid[row]], steps[row]])[None]  # [1, n + 2, E]
            torch.testing.assert_close(decoded[row], layer(alone)[0, n:], rtol=0, atol=1e-12)


def test_bidirectional_sees_the_future():
    layer = make_layer("gqa", torch.float64, causal=False)
    x = torch.randn(2, 5, E, dtype=torch.float64)
    positions = torch.arange(5).expand(2, 5)
    valid = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    expected = seed_listing(layer, x, positions, valid=valid, causal=False)
    torch.testing.assert_close(layer(x, valid=valid), expected, rtol=0, atol=1e-12)
    y = x.clone()
    y[0, -1] += 1.0
    assert not torch.allclose(layer(x)[0, 0], layer(y)[0, 0])  # position 0 reads position 4


def test_packed_documents_equal_separate_documents():
    # Two documents packed in one row: document_mask keeps them apart, document_positions restarts RoPE.
    layer = make_layer("gqa", torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    x = torch.randn(1, 7, E, dtype=torch.float64)
    packed = layer(x, positions=document_positions(ids), allowed=document_mask(ids))
    torch.testing.assert_close(packed[:, :3], layer(x[:, :3]), rtol=0, atol=1e-12)
    torch.testing.assert_close(packed[:, 3:], layer(x[:, 3:]), rtol=0, atol=1e-12)


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = make_layer("gqa", torch.float64)
    mha = make_layer("mha", torch.float64)
    d, group = gqa.head_dim, gqa.num_heads // gqa.num_kv_heads
    with torch.no_grad():
        mha.q_proj.weight.copy_(gqa.q_proj.weight)
        mha.o_proj.weight.copy_(gqa.o_proj.weight)
        for name in ("k_proj", "v_proj"):  # KV head j serves query heads j*G .. j*G+G-1: [K0, K0, K1, K1]
            w = getattr(gqa, name).weight.view(gqa.num_kv_heads, d, E).repeat_interleave(group, dim=0)
            getattr(mha, name).weight.copy_(w.reshape(-1, E))
    x = torch.randn(2, 6, E, dtype=torch.float64)
    torch.testing.assert_close(gqa(x), mha(x), rtol=0, atol=1e-12)


# A custom scale alone, a custom scale with a cap, a cap with the default scale. Scores of this layer are
# O(1) at scale 1.5, so a cap of 1.0 or 0.5 bends them well beyond rounding.
@pytest.mark.parametrize("scale,softcap", [(1.5, None), (1.5, 1.0), (None, 0.5)])
def test_layer_hands_its_scale_and_softcap_to_attention(scale, softcap):
    layer = make_layer("gqa", torch.float64, scale=scale, softcap=softcap)
    x = torch.randn(2, 6, E, dtype=torch.float64)
    positions = torch.arange(6).expand(2, 6)
    expected = seed_listing(layer, x, positions, scale=scale, softcap=softcap)  # projections, RoPE, loop mask
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-12)
    # The case can tell: the default scale without a cap gives a clearly different output.
    assert (expected - seed_listing(layer, x, positions)).abs().max() > 1e-3


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_heads=4, num_kv_heads=3), r"num_heads \(4\) must be a positive multiple of num_kv_heads \(3\)"),
    (dict(num_heads=3, num_kv_heads=3), r"hidden_size \(32\) must be a multiple of num_heads \(3\)"),
    (dict(num_heads=4, head_dim=5), "RoPE needs an even head_dim, got 5"),
    (dict(num_heads=4, window=0), "window must be a positive int"),  # a window sees at least its own token
    (dict(num_heads=4, window=3, causal=False), "window needs causal=True"),  # it counts keys before the query
    (dict(num_heads=4, rope_pairing="gptj"), "rope_pairing must be one of"),
    (dict(num_heads="4"), "num_heads must be a positive int, got '4'"),
    (dict(num_heads=4, num_kv_heads=0), "num_kv_heads must be a positive int, got 0"),
    (dict(num_heads=4, head_dim=0), "head_dim must be a positive int, got 0"),
    (dict(num_heads=4, head_dim=-2), "head_dim must be a positive int, got -2"),
    (dict(hidden_size=32.0, num_heads=4), r"hidden_size must be a positive int, got 32.0"),
    (dict(hidden_size=0, num_heads=4), "hidden_size must be a positive int, got 0"),
    (dict(num_heads=4, rope_base=1.0), r"rope_base must be a finite number > 1 .*got 1.0"),  # theta_i = 1: no rotation
    (dict(num_heads=4, rope_base="1e4"), r"rope_base must be a finite number > 1 .*got '1e4'"),
    (dict(num_heads=4, causal="no"), r"causal must be a bool, got 'no' \(str\)"),  # truthy: would stay causal
    (dict(num_heads=4, bias=None), "bias must be a bool, got None"),
    (dict(num_heads=4, scale="0.5"), r"scale must be a finite number or None .*got '0.5'"),
    (dict(num_heads=4, scale=float("nan")), r"scale must be a finite number or None .*got nan"),
    (dict(num_heads=4, softcap=0.0), r"softcap must be a positive finite number or None .*got 0.0"),
    (dict(num_heads=4, softcap=float("inf")), r"softcap must be a positive finite number or None .*got inf"),
])
def test_rejects_bad_configuration(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(**(dict(hidden_size=E) | kwargs))


X = torch.zeros(2, 4, E)  # [B, T, E] for the call checks below


@pytest.mark.parametrize("kwargs,match", [
    (dict(positions=torch.arange(5)), r"positions must have shape \[4\] or \[2, 4\], got \(5,\)"),
    (dict(positions=[0, 1, 2, 3]), r"positions must be an integer tensor of shape \[4\] or \[2, 4\], got list"),
    (dict(positions=torch.arange(4.0)), "positions must have an integer dtype, got torch.float32"),
    (dict(positions=torch.ones(4, dtype=torch.bool)), "positions must have an integer dtype, got torch.bool"),
    (dict(valid=torch.ones(2, 4)), r"valid must be a bool tensor \[2, 4\], got torch.float32 \[2, 4\]"),
    (dict(valid=[[True] * 4] * 2), r"valid must be a bool tensor \[2, 4\], got list"),
    (dict(x=X[0]), r"x must be a tensor \[B, T, E\] with E = 32, got \(4, 32\)"),
    (dict(x=X[..., :16]), r"x must be a tensor \[B, T, E\] with E = 32, got \(2, 4, 16\)"),
    (dict(x=X.tolist()), r"x must be a tensor \[B, T, E\] with E = 32, got list"),
    (dict(x=X.double()), "x must have the layer's dtype torch.float32 .*got torch.float64"),
    (dict(x=X.long()), "x must have the layer's dtype torch.float32 .*got torch.int64"),
    (dict(x=X.to("meta")), "x must be on the layer's device cpu, got meta"),
    (dict(cache="cache"), "cache must be a KVCache .*got str"),
    (dict(cache=KVCache(3, 2, 8, 8)), r"cache must hold \[B, Hkv, D, Dv\] = \[2, 2, 8, 8\] .*got \[3, 2, 8, 8\]"),
    (dict(cache=KVCache(2, 4, 8, 8)), r"cache must hold .*got \[2, 4, 8, 8\]"),  # an MHA cache for a GQA layer
    (dict(cache=KVCache(2, 2, 8, 8, device="meta")), "cache must be on x's device cpu, got meta"),
    (dict(allowed=torch.ones(4, 4)), r"allowed must be a bool tensor .*\[2, 4, 4, 4\], got torch.float32"),
    (dict(allowed=torch.ones(4, 5, dtype=torch.bool)), r"allowed must be broadcastable to .*got shape \[4, 5\]"),
])
def test_rejects_bad_call_arguments(kwargs, match):
    layer = make_layer("gqa")  # E = 32, Hq = 4, Hkv = 2, D = 8
    with pytest.raises(ValueError, match=match):
        layer(**(dict(x=X) | kwargs))


@pytest.mark.parametrize("bad,match", [
    (dict(allowed=torch.ones(4, 4, dtype=torch.bool)), r"\[2, 4, 4, 7\], got shape \[4, 4\]"),  # S = 3 + 4
    (dict(positions=torch.arange(4.0)), "positions must have an integer dtype"),
    (dict(valid=torch.ones(2, 4, dtype=torch.int64)), "valid must be a bool tensor"),
])
def test_a_refused_call_leaves_the_cache_unchanged(bad, match):
    layer = make_layer("gqa", torch.float64)
    cache = layer.new_cache(2, 10)
    with torch.no_grad():
        layer(torch.randn(2, 3, E, dtype=torch.float64), cache=cache)
        before = [x.clone() for x in cache.view()]
        with pytest.raises(ValueError, match=match):
            layer(torch.randn(2, 4, E, dtype=torch.float64), cache=cache, **bad)
    assert cache.length == 3 and all(torch.equal(a, b) for a, b in zip(cache.view(), before))


@pytest.mark.parametrize("window", [None, 2])
def test_zero_new_tokens_give_an_empty_output_and_leave_the_cache_alone(window):
    layer = make_layer("gqa", torch.float64, window=window)
    cache = layer.new_cache(2, 4)
    with torch.no_grad():
        out = layer(torch.zeros(2, 0, E, dtype=torch.float64), cache=cache)
        assert out.shape == (2, 0, E) and out.dtype == torch.float64 and cache.length == 0
        assert layer(torch.zeros(2, 0, E, dtype=torch.float64)).shape == (2, 0, E)


def test_under_autocast_a_bf16_input_is_accepted_like_its_fp32_copy():
    # Autocast casts x and the weights to bf16 inside each projection, so x in bf16 and the same values in
    # fp32 run the same bf16 computation.
    layer = make_layer("gqa")
    x = torch.randn(2, 4, E).bfloat16()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layer(x), layer(x.float()))


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 3), prompt=st.integers(1, 9), extra=st.integers(0, 4), chunk=st.integers(1, 9),
       kind=st.sampled_from(sorted(HEADS)), window=st.sampled_from([None, 1, 2, 5]), seed=st.integers(0, 2**16))
def test_property_cached_equals_uncached(batch, prompt, extra, chunk, kind, window, seed):
    layer = make_layer(kind, torch.float64, seed=seed % 7, window=window)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, prompt + extra, E, generator=g, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(run_cached(layer, x, prompt, chunk), layer(x), rtol=0, atol=1e-12)
