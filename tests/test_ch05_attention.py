"""Seed 000's milestone tests for causal_attention: the position rule in every situation it serves."""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention import causal_attention, merge_heads, split_heads
from engine.kernels.dispatch import KERNELS
from engine.reference.loops import per_query_attention


def rand_qkv(b=1, hq=4, hkv=4, t=6, s=6, d=8, dv=None, dtype=torch.float32):
    q = torch.randn(b, hq, t, d, dtype=dtype)
    k = torch.randn(b, hkv, s, d, dtype=dtype)
    v = torch.randn(b, hkv, s, d if dv is None else dv, dtype=dtype)
    return q, k, v


def weights(q, k, **kwargs):
    """Attention weights ``[B, Hq, T, S]``: attend over one-hot values ``v = I_S`` for every KV head."""
    b, hkv, s, _ = k.shape
    eye = torch.eye(s, dtype=q.dtype).expand(b, hkv, s, s)  # [B, Hkv, S, S]
    return causal_attention(q, k, eye, **kwargs)


def test_changing_the_last_token_leaves_every_earlier_output_bit_identical():
    x = torch.randn(1, 10, 32)  # [B, T, D_model]
    wq, wk, wv = (torch.randn(32, 32) / math.sqrt(32) for _ in range(3))

    def forward(x):
        q, k, v = (split_heads(x @ w, 4) for w in (wq, wk, wv))  # [B, 4, T, 8]
        return merge_heads(causal_attention(q, k, v))  # [B, T, 32]

    x2 = x.clone()
    x2[:, -1] += 5.0
    out, out2 = forward(x), forward(x2)
    assert torch.equal(out[:, :-1], out2[:, :-1])
    assert not torch.equal(out[:, -1], out2[:, -1])


def test_an_off_by_one_mask_would_be_caught_by_the_same_check():
    # Same probe with the rule shifted by one (query i sees key i+1): earlier outputs change.
    q, k, v = rand_qkv(t=6, s=6)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 5.0
    v2[:, :, -1] += 5.0
    leaky = torch.arange(6) + 1
    out = causal_attention(q, k, v, query_positions=leaky)
    out2 = causal_attention(q, k2, v2, query_positions=leaky)
    assert not torch.equal(out[:, :, -2], out2[:, :, -2])


def test_rows_sum_to_one_and_future_weights_are_zero():
    q, k, _ = rand_qkv(b=2, hq=3, hkv=3, t=7, s=7)
    w = weights(q, k)  # [B, Hq, T, S]
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 7), rtol=0, atol=1e-6)
    future = torch.triu(torch.ones(7, 7, dtype=torch.bool), diagonal=1)
    assert torch.equal(w[..., future], torch.zeros_like(w[..., future]))


def test_chunked_prefill_queries_40_to_47_against_keys_0_to_47_equal_the_full_rows():
    q, k, v = rand_qkv(b=1, hq=2, hkv=2, t=48, s=48, d=16)
    full = causal_attention(q, k, v)  # [1, 2, 48, 16]
    chunk = causal_attention(q[:, :, 40:], k, v)  # default positions 40..47
    torch.testing.assert_close(chunk, full[:, :, 40:], rtol=1e-5, atol=1e-6)
    explicit = causal_attention(q[:, :, 40:], k, v, query_positions=torch.arange(40, 48))
    assert torch.equal(explicit, chunk)


def test_a_square_triangle_would_get_chunked_prefill_wrong():
    # Queries 40-47 placed at positions 0-7 (a square triangle's view) see only keys 0..i: different rows.
    q, k, v = rand_qkv(b=1, hq=1, hkv=1, t=48, s=48, d=16)
    full = causal_attention(q, k, v)
    wrong = causal_attention(q[:, :, 40:], k, v, query_positions=torch.arange(8))
    assert not torch.allclose(wrong, full[:, :, 40:])


def test_one_query_at_position_57_against_58_cached_keys_equals_row_57():
    q, k, v = rand_qkv(b=1, hq=4, hkv=2, t=58, s=58, d=16)
    full = causal_attention(q, k, v)
    decode = causal_attention(q[:, :, 57:58], k, v)
    torch.testing.assert_close(decode, full[:, :, 57:58], rtol=1e-5, atol=1e-6)


def test_per_row_positions_in_a_batch_equal_running_each_row_alone():
    # Row 0: 5 queries after 3 cached keys (positions 3..7); row 1: decode-like, positions 0..4 with an
    # offset key layout. Each row alone must give the same answer as the batch.
    q, k, v = rand_qkv(b=2, hq=4, hkv=2, t=5, s=8, d=8)
    qpos = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]])
    kpos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 100, 100, 100]])
    batch = causal_attention(q, k, v, qpos, kpos)
    for b in range(2):
        alone = causal_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], qpos[b], kpos[b])
        torch.testing.assert_close(batch[b:b + 1], alone, rtol=1e-6, atol=1e-6)
    oracle = per_query_attention(q, k, v, qpos, kpos)
    torch.testing.assert_close(batch.double(), oracle, rtol=1e-5, atol=1e-5)


def test_gqa_equals_mha_with_repeated_kv_heads():
    q, k, v = rand_qkv(b=2, hq=16, hkv=8, t=9, s=9, d=8)
    gqa = causal_attention(q, k, v)
    mha = causal_attention(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1))
    torch.testing.assert_close(gqa, mha, rtol=1e-6, atol=1e-6)


def test_query_head_11_of_16_reads_kv_head_5_of_8():
    q, k, v = rand_qkv(b=1, hq=16, hkv=8, t=4, s=4, d=8)
    v = torch.arange(8.0).view(1, 8, 1, 1).expand(1, 8, 4, 8).contiguous()  # KV head h holds value h
    out = causal_attention(q, k, v)  # [1, 16, 4, 8]
    assert torch.allclose(out[0, 11], torch.full((4, 8), 5.0))
    assert torch.allclose(out[0, :, 0, 0], torch.arange(16.0) // 2)


def test_value_head_dim_may_differ_from_key_head_dim():
    q, k, v = rand_qkv(b=2, hq=4, hkv=2, t=5, s=7, d=8, dv=3)
    out = causal_attention(q, k, v)
    assert out.shape == (2, 4, 5, 3)
    torch.testing.assert_close(out.double(), per_query_attention(q, k, v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_output_keeps_the_dtype_of_q(dtype):
    q, k, v = rand_qkv(dtype=dtype)
    assert causal_attention(q, k, v).dtype == dtype


def test_scores_are_computed_in_fp32_for_half_inputs():
    # q.k = 256 * 256 = 65536 overflows fp16 (max 65504) before the scale is applied; in fp32 the
    # scaled scores are 256 and 255, so the weights are softmax([1, 0]) = [0.7311, 0.2689].
    q = torch.tensor([[[[256.0, 0.0]]]], dtype=torch.float16)
    k = torch.tensor([[[[256.0, 0.0], [255.0, 0.0]]]], dtype=torch.float16)
    v = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]], dtype=torch.float16)
    plain = torch.softmax((q @ k.transpose(-2, -1)) / 256, dim=-1)
    assert not bool(torch.isfinite(plain).all())  # the fp16 product really overflows
    out = causal_attention(q, k, v, scale=1 / 256, causal=False)
    expected = torch.softmax(torch.tensor([1.0, 0.0]), 0)
    torch.testing.assert_close(out[0, 0, 0].float(), expected, rtol=0, atol=1e-3)


def test_default_scale_is_one_over_sqrt_d():
    q, k, v = rand_qkv(d=16)
    torch.testing.assert_close(causal_attention(q, k, v), causal_attention(q, k, v, scale=0.25))
    assert not torch.allclose(causal_attention(q, k, v), causal_attention(q, k, v, scale=1.0))


# --- rows that see nothing, and masked values that must not leak ------------------------------------


def test_fully_masked_rows_give_zeros_and_zero_gradients():
    q, k, v = rand_qkv(b=1, hq=2, hkv=1, t=4, s=4)
    allowed = torch.ones(4, 4, dtype=torch.bool)
    allowed[2] = False  # query 2 may attend to nothing
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    out = causal_attention(q, k, v, allowed=allowed)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    assert bool(torch.isfinite(out).all())
    out.sum().backward()
    for grad in (q.grad, k.grad, v.grad):
        assert bool(torch.isfinite(grad).all())
    assert torch.equal(q.grad[:, :, 2], torch.zeros_like(q.grad[:, :, 2]))


def test_a_query_before_every_key_sees_nothing_and_returns_zeros():
    q, k, v = rand_qkv(t=2, s=3)
    out, lse = causal_attention(q, k, v, query_positions=torch.tensor([-1, 0]), return_lse=True)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert bool(torch.isneginf(lse[:, :, 0]).all())
    torch.testing.assert_close(out[:, :, 1], v[:, :, 0])  # position 0 sees only key 0


def test_padding_queries_give_zeros_not_nan():
    q, k, v = rand_qkv(b=2, t=5, s=5)
    valid = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)  # [B, L]
    allowed = valid[:, None, :, None] & valid[:, None, None, :]  # [B, 1, T, S]
    out = causal_attention(q, k, v, allowed=allowed)
    assert torch.equal(out[0, :, 3:], torch.zeros_like(out[0, :, 3:]))
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("where", ["k", "v", "kv"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_in_masked_keys_do_not_leak(poison, where, kernel):
    q, k, v = rand_qkv(b=1, hq=2, hkv=1, t=6, s=6)
    clean = causal_attention(q, k, v, kernel="reference")
    k2, v2 = k.clone(), v.clone()
    if "k" in where:
        k2[:, :, 5] = poison  # the last key is visible only to the last query
    if "v" in where:
        v2[:, :, 5] = poison
    out = causal_attention(q, k2, v2, kernel=kernel)
    torch.testing.assert_close(out[:, :, :5], clean[:, :, :5], rtol=1e-5, atol=1e-6)
    # a padded key (masked for everyone) poisons nothing, forward or backward
    allowed = torch.arange(6) < 5
    q.requires_grad_(True)
    out = causal_attention(q, k2, v2, allowed=allowed, kernel=kernel)
    assert bool(torch.isfinite(out).all())
    out.sum().backward()
    assert bool(torch.isfinite(q.grad).all())


def test_a_visible_nan_key_still_shows_up_as_nan():
    # Masking must not hide real damage: a NaN in a key the query does see gives NaN.
    q, k, v = rand_qkv(t=3, s=3)
    k[:, :, 0] = float("nan")
    assert bool(torch.isnan(causal_attention(q, k, v)).all())
    q, k, v = rand_qkv(t=3, s=3)
    v[:, :, 1, 0] = float("nan")  # key 1 is visible to queries 1 and 2, in feature 0 only
    out = causal_attention(q, k, v)
    assert bool(torch.isnan(out[:, :, 1:, 0]).all())
    assert bool(torch.isfinite(out[:, :, 0]).all()) and bool(torch.isfinite(out[..., 1:]).all())


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: rand_qkv(hq=6, hkv=4), r"Query heads \(6\) must be a multiple of KV heads \(4\)"),
        (lambda: (torch.randn(4, 6, 8), *rand_qkv()[1:]), r"q must be 4-D \[B, Hq, T, D\], got shape \(4, 6, 8\)"),
        (lambda: (rand_qkv()[0], torch.randn(1, 4, 6), rand_qkv()[2]), r"k must be 4-D"),
        (lambda: (*rand_qkv(d=8)[:2], torch.randn(1, 4, 5, 8)), r"key length mismatch: k has S=6, v has S=5"),
        (lambda: (rand_qkv(b=2)[0], *rand_qkv(b=1)[1:]), r"batch size mismatch: q has B=2, k has B=1"),
        (lambda: (rand_qkv(d=8)[0], *rand_qkv(d=4)[1:]), r"head dim mismatch: q has D=8, k has D=4"),
        (lambda: (rand_qkv()[0], rand_qkv()[1], torch.randn(1, 2, 6, 8)), r"same number of heads"),
        (lambda: tuple(x.long() for x in rand_qkv()),
         r"q must have dtype float16, bfloat16, float32, float64, got torch.int64"),
        (lambda: tuple(x.to(torch.float8_e4m3fn) for x in rand_qkv()),
         r"q must have dtype float16, bfloat16, float32, float64, got torch.float8_e4m3fn"),
        (lambda: (rand_qkv()[0].double(), *rand_qkv()[1:]), r"q, k, v must share one dtype"),
        (lambda: tuple(x.to("meta") for x in rand_qkv()), r"q is a meta tensor: attention needs its values"),
        (lambda: (torch.randn(1, 4, 6, 0), torch.randn(1, 2, 6, 0), torch.randn(1, 2, 6, 3)),
         r"head dim D = 0: the default scale 1 / sqrt\(D\) is undefined; pass scale explicitly"),
    ],
    ids=["heads", "q-3d", "k-3d", "s-mismatch", "batch", "head-dim", "kv-heads", "int-dtype", "fp8", "mixed-dtype",
         "meta", "d0-no-scale"],
)
def test_bad_tensors_raise_a_clear_value_error(make, message):
    with pytest.raises(ValueError, match=message):
        causal_attention(*make())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"query_positions": torch.arange(5)}, r"query_positions must have shape \[6\] or \[1, 6\], got \(5,\)"),
        ({"key_positions": torch.zeros(2, 6, dtype=torch.long)}, r"key_positions must have shape \[6\] or \[1, 6\]"),
        ({"query_positions": torch.arange(6.0)}, r"query_positions must have an integer dtype, got torch.float32"),
        ({"query_positions": [0, 1, 2, 3, 4, 5]}, r"query_positions must be an integer tensor"),
        ({"allowed": torch.ones(6, 6)}, r"allowed must be a bool tensor .* got torch.float32"),
        ({"allowed": torch.ones(5, 6, dtype=torch.bool)}, r"allowed must be broadcastable to \[B, Hq, T, S\] = "
                                                           r"\[1, 4, 6, 6\], got shape \[5, 6\]"),
        ({"allowed": torch.ones(1, 1, 1, 6, 6, dtype=torch.bool)}, r"allowed must be broadcastable"),
        ({"allowed": torch.ones(6, 6, dtype=torch.bool, device="meta")},
         r"allowed must be on q's device cpu, got meta"),  # a dense mask elsewhere than q (a CUDA/CPU mix)
        ({"key_positions": torch.arange(6, device="meta")}, r"key_positions is a meta tensor: positions need values"),
        ({"scale": float("nan")}, r"scale must be a finite number"),
        ({"softcap": -1.0}, r"softcap must be a positive finite number"),
        ({"softcap": float("inf")}, r"softcap must be a positive finite number"),
        ({"scale": True}, r"scale must be a real number, got True \(bool\)"),
        ({"scale": "0.5"}, r"scale must be a real number"),
        ({"scale": torch.tensor(0.5, requires_grad=True)}, r"scale is a tensor that requires grad"),
        ({"causal": "no"}, r"causal must be a bool \(True: the position rule applies\), got 'no' \(str\)"),
        ({"causal": 0}, r"causal must be a bool"),
    ],
    ids=["qpos-len", "kpos-batch", "qpos-float", "qpos-list", "allowed-float", "allowed-shape", "allowed-5d",
         "allowed-device", "kpos-meta",
         "scale-nan", "softcap-neg", "softcap-inf", "scale-bool", "scale-str", "scale-grad", "causal-str",
         "causal-int"],
)
def test_bad_arguments_raise_a_clear_value_error(kwargs, message):
    q, k, v = rand_qkv()
    with pytest.raises(ValueError, match=message):
        causal_attention(q, k, v, **kwargs)


def test_unknown_kernel_name_is_an_error():
    with pytest.raises(ValueError, match=r"kernel must be 'auto' or one of"):
        causal_attention(*rand_qkv(), kernel="no-such-kernel")


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_non_contiguous_inputs_as_models_pass_them(softcap, kernel):
    # Models produce q, k, v as transposes of [B, T, H, D]; every path must accept strided views.
    q = torch.randn(1, 5, 4, 8).transpose(1, 2)  # [1, 4, 5, 8], not contiguous
    k, v = torch.randn(1, 5, 2, 8).transpose(1, 2), torch.randn(1, 5, 2, 8).transpose(1, 2)
    out = causal_attention(q, k, v, softcap=softcap, kernel=kernel)
    oracle = per_query_attention(q, k, v, softcap=softcap)
    torch.testing.assert_close(out.double(), oracle, rtol=1e-5, atol=1e-5)


def test_scale_accepts_numpy_scalars_and_zero_dim_tensors():
    import numpy as np

    q, k, v = rand_qkv()
    expected = causal_attention(q, k, v, scale=0.5)
    assert torch.equal(causal_attention(q, k, v, scale=np.float32(0.5)), expected)
    assert torch.equal(causal_attention(q, k, v, scale=torch.tensor(0.5)), expected)


@pytest.mark.parametrize("kernel", [*sorted(KERNELS), "auto"])
def test_empty_batches_queries_and_caches(kernel):
    # S = 0: every row sees nothing (zeros, lse -inf); B = 0 or T = 0: an empty output of the right shape.
    out, lse = causal_attention(torch.randn(1, 2, 3, 4), torch.randn(1, 1, 0, 4), torch.randn(1, 1, 0, 5),
                                kernel=kernel, return_lse=True)
    assert torch.equal(out, torch.zeros(1, 2, 3, 5)) and bool(torch.isneginf(lse).all())
    assert causal_attention(*(torch.randn(0, 2, 3, 4),) * 3, kernel=kernel).shape == (0, 2, 3, 4)
    empty_t = causal_attention(torch.randn(1, 2, 0, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), kernel=kernel)
    assert empty_t.shape == (1, 2, 0, 4)
