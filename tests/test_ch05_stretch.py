"""Seed 000's stretch exercises 2 and 3: the reshape-without-transpose bug, and a sliding window."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.attention import causal_attention, merge_heads, split_heads, window_mask
from engine.reference.loops import per_query_attention


def labelled_tokens(batch: int, t: int, heads: int, dh: int) -> torch.Tensor:
    """``[B, T, H*Dh]`` where feature f of token i in row b holds ``1000*b + 100*i + f``: every value unique."""
    b = torch.arange(batch).view(batch, 1, 1)
    i = torch.arange(t).view(1, t, 1)
    f = torch.arange(heads * dh).view(1, 1, heads * dh)
    return (1000 * b + 100 * i + f).float()


def test_head_1_of_token_2_holds_features_4_to_8_of_token_2():
    x = labelled_tokens(batch=1, t=5, heads=2, dh=4)  # [1, 5, 8]
    heads = split_heads(x, 2)  # [1, 2, 5, 4]
    assert heads.shape == (1, 2, 5, 4)
    assert torch.equal(heads[0, 1, 2], x[0, 2, 4:8])
    assert torch.equal(heads[0, 0, 2], x[0, 2, 0:4])


def test_merge_inverts_split_but_a_reshape_without_transpose_does_not():
    x = labelled_tokens(batch=2, t=5, heads=2, dh=4)  # [2, 5, 8]
    assert torch.equal(merge_heads(split_heads(x, 2)), x)
    wrong = x.reshape(2, 2, 5, 4)  # right shape, wrong data: interleaves tokens and heads
    assert wrong.shape == split_heads(x, 2).shape
    assert not torch.equal(wrong, split_heads(x, 2))
    assert not torch.equal(wrong[0, 1, 2], x[0, 2, 4:8])


@given(batch=st.integers(1, 3), t=st.integers(1, 9), heads=st.integers(1, 4), dh=st.integers(1, 5))
def test_split_merge_round_trip(batch, t, heads, dh):
    x = torch.randn(batch, t, heads * dh)
    assert torch.equal(merge_heads(split_heads(x, heads)), x)


def test_split_heads_rejects_a_width_that_heads_do_not_divide():
    with pytest.raises(ValueError, match=r"last dim \(10\) must be a multiple of num_heads \(4\)"):
        split_heads(torch.randn(1, 3, 10), 4)
    with pytest.raises(ValueError, match=r"split_heads expects \[B, T, H\*Dh\]"):
        split_heads(torch.randn(3, 10), 2)
    with pytest.raises(ValueError, match=r"merge_heads expects \[B, H, T, Dh\]"):
        merge_heads(torch.randn(3, 10))


def test_window_of_3_sees_exactly_the_last_3_keys_own_included():
    pos = torch.arange(6)
    mask = window_mask(pos, pos, 3)
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 0, 0, 0],
                             [0, 1, 1, 1, 0, 0],
                             [0, 0, 1, 1, 1, 0],
                             [0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)
    assert torch.equal(window_mask(pos, pos, 1), torch.eye(6, dtype=torch.bool))
    assert torch.equal(window_mask(pos, pos, 6), torch.tril(torch.ones(6, 6, dtype=torch.bool)))


def test_window_attention_equals_a_per_query_loop_and_ignores_keys_outside_the_window():
    q, k, v = torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    pos = torch.arange(12)
    allowed = window_mask(pos, pos, 4)
    out = causal_attention(q, k, v, allowed=allowed)
    torch.testing.assert_close(out.double(), per_query_attention(q, k, v, allowed=allowed), rtol=1e-5, atol=1e-6)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :4], v2[:, :, :4] = float("nan"), float("nan")  # outside every window from query 7 on
    out2 = causal_attention(q, k2, v2, allowed=allowed)
    assert torch.equal(out2[:, :, 7:], out[:, :, 7:])


def test_window_in_chunked_decode_uses_positions_not_indices():
    # Decode at position 20 with a window of 4 over a cache holding positions 0..20: sees keys 17..20.
    qpos, kpos = torch.tensor([20]), torch.arange(21)
    assert torch.equal(window_mask(qpos, kpos, 4)[0].nonzero().flatten(), torch.arange(17, 21))


def test_window_must_be_a_positive_int():
    pos = torch.arange(3)
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="window must be a positive int"):
            window_mask(pos, pos, bad)
