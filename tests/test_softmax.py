"""Stable, naive and online softmax (seed 002: overflow, fully masked rows, 'Try it' 3)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.softmax import naive_softmax, online_softmax, stable_softmax


def test_stable_softmax_survives_what_overflows_the_naive_one():
    big = torch.tensor([1000.0, 999.0, 0.0])
    assert not bool(torch.isfinite(naive_softmax(big)).all())
    torch.testing.assert_close(stable_softmax(big), torch.tensor([0.7311, 0.2689, 0.0]), rtol=0, atol=1e-4)


def test_fully_masked_rows_give_zeros():
    row = torch.full((2, 4), float("-inf"))
    row[1, 2] = 0.0
    for fn in (stable_softmax, online_softmax):
        out = fn(row)
        assert torch.equal(out[0], torch.zeros(4))
        assert torch.equal(out[1], torch.tensor([0.0, 0.0, 1.0, 0.0]))


@pytest.mark.parametrize("block_size", [1, 2, 3, 7, 100])
def test_online_softmax_in_blocks_equals_the_full_softmax(block_size):
    scores = torch.randn(5, 13, dtype=torch.float64) * 10
    scores[0, 5:] = float("-inf")
    torch.testing.assert_close(online_softmax(scores, block_size), torch.softmax(scores, -1))


@given(st.lists(st.floats(-80, 80), min_size=1, max_size=20), st.integers(1, 6))
def test_online_equals_stable_and_rows_sum_to_one(values, block):
    scores = torch.tensor(values, dtype=torch.float64)
    a, b = online_softmax(scores, block), stable_softmax(scores)
    torch.testing.assert_close(a, b)
    assert abs(a.sum().item() - 1.0) < 1e-12


def test_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        online_softmax(torch.zeros(3), 0)
