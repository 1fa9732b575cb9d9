"""Mask families: each a predicate with one stated convention, composed with & (seed 002's table)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import causal_attention
from engine.masks import (
    causal_mask,
    document_mask,
    document_positions,
    key_padding_mask,
    padding_mask,
    padding_positions,
    window_mask,
)
from engine.reference.loops import per_query_attention


def test_causal_mask_is_the_position_rule():
    qpos, kpos = torch.tensor([2, 3]), torch.arange(4)
    assert torch.equal(causal_mask(qpos, kpos), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool))


def test_per_row_positions_give_a_batch_mask():
    qpos = torch.tensor([[0, 1], [5, 6]])
    kpos = torch.tensor([[0, 1, 2], [4, 5, 6]])
    mask = causal_mask(qpos, kpos)
    assert mask.shape == (2, 1, 2, 3)
    assert torch.equal(mask[1, 0], torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    with pytest.raises(ValueError, match="batch sizes differ"):
        causal_mask(torch.zeros(2, 2, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long))


@pytest.mark.parametrize(
    "side, valid_row0, positions_row0",
    [("right", [1, 1, 1, 0, 0], [0, 1, 2, 0, 0]), ("left", [0, 0, 1, 1, 1], [0, 0, 0, 1, 2])],
)
def test_padding_left_and_right(side, valid_row0, positions_row0):
    lengths = torch.tensor([3, 5])
    keys = key_padding_mask(lengths, 5, side)
    assert keys.shape == (2, 1, 1, 5)
    assert torch.equal(keys[0, 0, 0], torch.tensor(valid_row0, dtype=torch.bool))
    assert bool(keys[1].all())
    assert torch.equal(padding_positions(lengths, 5, side)[0], torch.tensor(positions_row0))
    assert torch.equal(padding_positions(lengths, 5, side)[1], torch.arange(5))
    full = padding_mask(lengths, 5, side)  # [B, 1, T, T]
    valid = torch.tensor(valid_row0, dtype=torch.bool)
    assert torch.equal(full[0, 0], valid[:, None] & valid[None, :])


def test_left_and_right_padding_give_the_same_outputs_for_real_tokens():
    torch.manual_seed(1)
    lengths = torch.tensor([3, 5])
    q_real, k_real, v_real = torch.randn(2, 2, 5, 4), torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4)
    outs = {}
    for side in ("right", "left"):
        q, k, v = (x.clone() for x in (q_real, k_real, v_real))
        if side == "left":  # move row 0's 3 real tokens to the end, pads (NaN) in front
            for x in (q, k, v):
                x[0, :, 2:] = x[0, :, :3].clone()
                x[0, :, :2] = float("nan")
        else:
            for x in (q, k, v):
                x[0, :, 3:] = float("nan")
        pos = padding_positions(lengths, 5, side)
        out = causal_attention(q, k, v, pos, pos, allowed=padding_mask(lengths, 5, side))
        outs[side] = out
        assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(outs["left"][0, :, 2:], outs["right"][0, :, :3])
    assert torch.equal(outs["left"][0, :, :2], torch.zeros(2, 2, 4))
    torch.testing.assert_close(outs["left"][1], outs["right"][1])


def test_padding_rejects_bad_lengths_and_sides():
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 4\], got \[5\]"):
        key_padding_mask(torch.tensor([5]), 4)
    with pytest.raises(ValueError, match="side must be 'left' or 'right', got 'up'"):
        padding_mask(torch.tensor([2]), 4, side="up")
    with pytest.raises(ValueError, match="lengths must be an integer tensor"):
        padding_mask(torch.tensor([2.0]), 4)


def test_packed_documents_are_block_diagonal():
    ids = torch.tensor([0, 0, 1, 1, 1, 2])  # offsets [0, 2, 5, 6]
    pos = torch.arange(6)
    mask = document_mask(ids) & causal_mask(pos, pos)
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for start, end in ((0, 2), (2, 5), (5, 6)):
        expected[start:end, start:end] = torch.tril(torch.ones(end - start, end - start, dtype=torch.bool))
    assert torch.equal(mask, expected)
    assert torch.equal(document_positions(ids), torch.tensor([0, 1, 0, 1, 2, 0]))
    with pytest.raises(ValueError, match="non-decreasing"):
        document_positions(torch.tensor([0, 1, 0]))


def test_packed_documents_equal_each_document_alone():
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    q, k, v = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    packed = causal_attention(q, k, v, allowed=document_mask(ids))
    for start, end in ((0, 3), (3, 5), (5, 9)):
        alone = causal_attention(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end])
        torch.testing.assert_close(packed[:, :, start:end], alone)


def test_masks_compose_with_and_and_or():
    pos = torch.arange(8)
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    both = window_mask(pos, pos, 2) & document_mask(ids)
    assert torch.equal(both, window_mask(pos, pos, 2) & (ids[:, None] == ids[None, :]))
    either = window_mask(pos, pos, 2) | document_mask(ids)
    assert torch.equal(either, window_mask(pos, pos, 2) | (ids[:, None] == ids[None, :]))
    q, k, v = torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4)
    out = causal_attention(q, k, v, allowed=both)
    torch.testing.assert_close(out.double(), per_query_attention(q, k, v, allowed=both), rtol=1e-5, atol=1e-6)


def test_no_mask_is_bidirectional_attention_for_encoders_and_cross_attention():
    q, k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 7, 4), torch.randn(2, 2, 7, 4)
    out = causal_attention(q, k, v, causal=False)
    dense = torch.softmax(q @ k.transpose(-2, -1) / 2.0, dim=-1) @ v
    torch.testing.assert_close(out, dense)
    lengths = torch.tensor([7, 4])  # the second row's keys are padded after 4
    out = causal_attention(q, k, v, causal=False, allowed=key_padding_mask(lengths, 7))
    torch.testing.assert_close(out[1].double(), per_query_attention(q[1:], k[1:, :, :4], v[1:, :, :4],
                                                                     causal=False)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_narrow_and_unsigned_position_dtypes_give_the_same_attention(dtype):
    # q - k on uint8 wraps around; tile skipping must still see every visible key.
    pos = torch.arange(200)
    q, k, v = torch.randn(1, 2, 200, 8), torch.randn(1, 2, 200, 8), torch.randn(1, 2, 200, 8)
    expected = causal_attention(q, k, v, allowed=window_mask(pos, pos, 100).to_dense(), kernel="reference")
    mask = window_mask(pos.to(dtype), pos.to(dtype), 100)
    assert torch.equal(mask.to_dense(), window_mask(pos, pos, 100).to_dense())
    torch.testing.assert_close(causal_attention(q, k, v, allowed=mask), expected, rtol=1e-5, atol=1e-6)


def test_float_positions_in_a_mask_are_refused():
    with pytest.raises(ValueError, match="must be integers, got dtype torch.float32"):
        window_mask(torch.arange(4.0), torch.arange(4.0), 2)


def test_window_positions_near_the_int64_limits_are_exact_or_refused():
    # q - k < window on int64 would wrap around for positions 2^63 apart and mark a distant key visible.
    far = torch.tensor([2**62 - 1]), torch.tensor([-(2**62)])
    assert not bool(window_mask(*far, 4).to_dense().any())  # the largest allowed gap: exact, not visible
    near = torch.tensor([2**62 - 1]), torch.tensor([2**62 - 3, 2**62 - 1])
    assert torch.equal(window_mask(*near, 3).to_dense(), torch.tensor([[True, True]]))
    with pytest.raises(ValueError, match=r"window masks need positions in \[-2\^62, 2\^62\).*got positions from "
                                         r"4611686018427387904 to 4611686018427387904"):
        window_mask(torch.tensor([2**62]), torch.tensor([-(2**62)]), 4)
    with pytest.raises(ValueError, match=r"window masks need positions in \[-2\^62, 2\^62\)"):
        window_mask(torch.tensor([0]), torch.tensor([-(2**62) - 1]), 4)
    with pytest.raises(ValueError, match=r"window must be at most 2\^62"):
        window_mask(torch.tensor([0]), torch.tensor([0]), 2**62 + 1)


def test_composing_with_a_mask_of_too_many_dims_names_the_dims():
    with pytest.raises(ValueError, match=r"at most 4 dims \[B, Hq, T, S\].*got a 5-D bool tensor of shape "
                                         r"\[1, 1, 1, 3, 3\]"):
        causal_mask(torch.arange(3), torch.arange(3)) & torch.ones(1, 1, 1, 3, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"got dtype torch.float32"):
        causal_mask(torch.arange(3), torch.arange(3)) & torch.ones(3, 3)


@pytest.mark.parametrize("make", [window_mask, lambda q, k, w: causal_mask(q, k)], ids=["window", "causal"])
def test_masks_over_zero_queries_or_keys_have_empty_shapes(make):
    assert make(torch.arange(0), torch.arange(5), 2).to_dense().shape == (0, 5)
    assert make(torch.arange(3), torch.arange(0), 2).to_dense().shape == (3, 0)
    assert make(torch.zeros(2, 0, dtype=torch.long), torch.arange(4), 2).to_dense().shape == (2, 1, 0, 4)


def test_only_padding_masks_may_have_no_query_side():
    from engine.masks import CausalMask, DocumentMask, PaddingMask

    for family in (CausalMask, DocumentMask):
        with pytest.raises(ValueError, match="relates queries to keys: query_values must be given"):
            family(None, torch.arange(4))
    assert PaddingMask(None, torch.tensor([[True, False]])).shape == (1, 1, 1, 2)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_expanded_rows_stay_one_shared_row_whatever_the_position_dtype(dtype):
    # [B, L] positions that are one row expanded (stride 0) plan once, not once per batch row.
    pos = torch.arange(8, dtype=dtype).expand(3, 8)
    assert not window_mask(pos, pos, 3).batched() and not causal_mask(pos, pos).batched()
    plain = pos.long().contiguous()
    assert torch.equal(window_mask(pos, pos, 3).to_dense(), window_mask(plain, plain, 3).to_dense())
