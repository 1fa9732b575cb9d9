"""RoPE: the pairing convention, norm preservation and relative-position dependence."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.rope import apply_rope, rope_frequencies


def complex_rope_oracle(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Independent oracle for the "half" pairing: pair (x_i, x_{i+D/2}) is the complex number x_i + i x_{i+D/2},
    multiplied by exp(i * position * base^(-2i/D)). fp64 throughout."""
    d = x.shape[-1]
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double())  # [B, H, T, D/2]
    theta = torch.tensor([base ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)  # [D/2]
    angle = positions.double()[..., None] * theta  # [..., T, D/2]
    if angle.dim() == 3:
        angle = angle[:, None]  # [B, 1, T, D/2]
    rotated = z * torch.polar(torch.ones_like(angle), angle)  # [B, H, T, D/2]
    return torch.cat((rotated.real, rotated.imag), dim=-1)  # [B, H, T, D]


def test_worked_example_two_dims():
    # D = 2: theta_0 = 1, so position p turns (1, 0) by p radians.
    x = torch.tensor([[[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]]], dtype=torch.float64)  # [1, 1, 3, 2]
    out = apply_rope(x, torch.tensor([0, 1, 2]))
    expected = torch.tensor([[[[1.0, 0.0], [math.cos(1), math.sin(1)], [-math.sin(2), math.cos(2)]]]],
                            dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-15)


def test_half_pairing_matches_the_complex_oracle():
    # Feature i pairs with feature i + D/2 (not with its neighbour); per-row positions of a ragged batch.
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 100, 131071]])
    torch.testing.assert_close(apply_rope(x, positions, base=500000.0),
                               complex_rope_oracle(x, positions, 500000.0), rtol=0, atol=1e-12)


def test_interleaved_is_the_half_rotation_on_permuted_features():
    # interleaved pairs (x0, x1) (x2, x3) ...: de-interleave, rotate with "half", re-interleave.
    torch.manual_seed(1)
    x = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    pos = torch.arange(6) * 3
    to_half = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # [x0 x2 x4 x6 | x1 x3 x5 x7]
    back = torch.argsort(to_half)
    expected = apply_rope(x[..., to_half], pos, pairing="half")[..., back]
    torch.testing.assert_close(apply_rope(x, pos, pairing="interleaved"), expected, rtol=0, atol=1e-14)
    assert not torch.allclose(apply_rope(x, pos, pairing="interleaved"), apply_rope(x, pos, pairing="half"))


def test_position_zero_is_identity_and_values_keep_dtype():
    x = torch.randn(2, 2, 3, 4, dtype=torch.bfloat16)
    out = apply_rope(x, torch.zeros(3, dtype=torch.long))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, x)  # cos 0 = 1, sin 0 = 0 exactly


def test_frequencies():
    freqs = rope_frequencies(8, base=10000.0)
    expected = torch.tensor([1.0, 10000 ** -0.25, 10000 ** -0.5, 10000 ** -0.75], dtype=torch.float64)
    torch.testing.assert_close(freqs, expected, rtol=1e-15, atol=0)


@pytest.mark.parametrize("bad", [
    dict(head_dim=7),  # odd head dim: features cannot be paired
    dict(pairing="neox"),  # unknown pairing name
    dict(positions=torch.arange(4.0)),  # float positions
    dict(positions=torch.arange(5)),  # wrong length
])
def test_rejects_bad_arguments(bad):
    d = bad.get("head_dim", 8)
    x = torch.randn(1, 1, 4, d)
    with pytest.raises(ValueError):
        apply_rope(x, bad.get("positions", torch.arange(4)), pairing=bad.get("pairing", "half"))


dims = st.sampled_from([2, 4, 6, 16, 64])
pairings = st.sampled_from(["half", "interleaved"])


@settings(max_examples=40, deadline=None)
@given(d=dims, pairing=pairings, pos=st.integers(0, 200_000), seed=st.integers(0, 2**16))
def test_property_rotation_preserves_norm(d, pairing, pos, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, 1, d, generator=g, dtype=torch.float64)
    out = apply_rope(x, torch.tensor([pos]), pairing=pairing)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)


@settings(max_examples=40, deadline=None)
@given(d=dims, pairing=pairings, m=st.integers(0, 5000), n=st.integers(0, 5000), shift=st.integers(-5000, 5000),
       seed=st.integers(0, 2**16))
def test_property_score_depends_only_on_relative_position(d, pairing, m, n, shift, seed):
    # rope(q, m) . rope(k, n) == rope(q, m + s) . rope(k, n + s) for every shift s (positions stay >= 0).
    shift = max(shift, -min(m, n))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 1, d, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 1, d, generator=g, dtype=torch.float64)

    def score(qpos, kpos):
        return (apply_rope(q, torch.tensor([qpos]), pairing=pairing)
                * apply_rope(k, torch.tensor([kpos]), pairing=pairing)).sum()

    scale = q.norm() * k.norm()
    assert abs(score(m, n) - score(m + shift, n + shift)) <= 1e-9 * scale
