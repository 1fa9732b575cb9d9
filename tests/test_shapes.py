"""engine.shapes: broadcasting of shapes in plain Python, against torch.broadcast_shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.shapes import broadcast_shape, broadcasts_to

SHAPES = st.lists(st.integers(0, 3), min_size=0, max_size=4)


def torch_broadcast(*shapes):
    try:
        return torch.broadcast_shapes(*shapes)
    except RuntimeError:
        return None


@given(st.lists(SHAPES, min_size=1, max_size=3))
def test_property_broadcast_shape_is_torchs(shapes):
    want = torch_broadcast(*shapes)
    if want is None:
        with pytest.raises(RuntimeError, match="do not broadcast together"):
            broadcast_shape(*shapes)
    else:
        assert broadcast_shape(*shapes) == want and isinstance(broadcast_shape(*shapes), torch.Size)


@given(SHAPES, SHAPES)
def test_property_broadcasts_to_is_torchs_answer_with_no_more_dims(shape, full):
    want = len(shape) <= len(full) and torch_broadcast(shape, full) == torch.Size(full)
    assert broadcasts_to(shape, full) == want


def test_broadcasts_to_examples():
    assert broadcasts_to((4, 1, 1, 128), (4, 9, 1, 128))
    assert broadcasts_to((128,), (4, 9, 1, 128)) and broadcasts_to((), (2, 3))
    assert not broadcasts_to((4, 9, 1, 128), (4, 1, 1, 128))  # would need the full shape to grow
    assert not broadcasts_to((1, 4, 9, 1, 128), (4, 9, 1, 128))  # more dims
    assert not broadcasts_to((3, 128), (4, 9, 2, 128))
