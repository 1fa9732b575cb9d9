"""Attention dropout: reproducible from the generator, the same pattern on every kernel and in the backward
(regenerated from the seed), exact against the float64 oracle given that pattern, and unbiased in the mean."""

from __future__ import annotations

import pytest
import torch

from engine import causal_attention, window_mask
from engine.kernels.dropout import keep_scale
from tests.modifier_oracle import oracle

B, HQ, HKV, T, S, D = 2, 4, 2, 9, 30, 8


def qkv(seed=0, t=T, s=S):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, D, generator=g, dtype=torch.float64) for h, n in ((HQ, t), (HKV, s), (HKV, s))]


def pattern(seed_generator: torch.Generator, p: float, t=T, s=S, b=B, hq=HQ) -> torch.Tensor:
    """The keep / (1 - p) pattern a call with this generator state uses, ``[B, Hq, T, S]``, from its definition:
    the call draws one seed, then hashes (seed, b, h, query index, key index)."""
    seed = int(torch.randint(0, 2**62, (), generator=seed_generator))
    index = [torch.arange(n).reshape([-1 if axis == i else 1 for axis in range(4)]) for i, n in
             enumerate((b, hq, t, s))]
    return keep_scale(seed, p, *index, torch.float64)


@pytest.mark.parametrize("kernel", ["reference", "tiled", "auto"])
@pytest.mark.parametrize("t, s", [(T, S), (140, 150)], ids=["short", "two_query_tiles"])
def test_dropout_equals_the_oracle_with_the_same_pattern_forward_and_backward(kernel, t, s):
    # T = 140: the backward's query tiles are 128 rows, so the second tile regenerates the pattern of rows
    # 128..139 (global query indices, not tile-local ones)
    q, k, v = (x.requires_grad_() for x in qkv(t=t, s=s))
    allowed = window_mask(torch.arange(s - t, s), torch.arange(s), 12)
    out, lse = causal_attention(q, k, v, allowed=allowed, dropout_p=0.3, generator=torch.Generator().manual_seed(5),
                                kernel=kernel, return_lse=True)
    keep = pattern(torch.Generator().manual_seed(5), 0.3, t=t, s=s)
    want, want_lse = oracle(q, k, v, allowed=allowed, keep=keep)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)  # the lse is of the weights before dropout
    g = torch.Generator().manual_seed(6)
    w_out, w_lse = torch.randn(out.shape, generator=g, dtype=torch.float64), torch.randn(lse.shape, generator=g,
                                                                                       dtype=torch.float64)
    grads = torch.autograd.grad((out * w_out).sum() + (lse * w_lse).sum(), [q, k, v])
    want_grads = torch.autograd.grad((want * w_out).sum() + (want_lse * w_lse).sum(), [q, k, v])
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


def test_the_same_generator_state_gives_the_same_output_and_another_does_not():
    q, k, v = qkv()
    runs = [causal_attention(q, k, v, dropout_p=0.2, generator=torch.Generator().manual_seed(seed), kernel=kernel)
            for seed, kernel in ((1, "tiled"), (1, "reference"), (2, "tiled"))]
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-12, atol=1e-12)  # a pure function of the seed: any tiles
    assert not torch.allclose(runs[0], runs[2])
    g = torch.Generator().manual_seed(1)
    first, second = (causal_attention(q, k, v, dropout_p=0.2, generator=g) for _ in range(2))
    assert not torch.allclose(first, second)  # each call draws its own seed: the generator moves on


def test_tiles_do_not_change_the_pattern():
    q, k, v = qkv(t=40, s=70)
    from engine.inputs import prepare_inputs
    from engine.kernels.tiled.tiled import tiled_attention

    inputs = prepare_inputs(q, k, v, None, None, None, None, dropout_p=0.4, generator=torch.Generator().manual_seed(3))
    small, _ = tiled_attention(inputs, block_q=7, block_k=11)
    large, _ = tiled_attention(inputs, block_q=64, block_k=256)
    torch.testing.assert_close(small, large, rtol=1e-12, atol=1e-12)


def test_the_kept_fraction_is_one_minus_p():
    keep = pattern(torch.Generator().manual_seed(0), 0.25, t=256, s=256)  # [B, Hq, 256, 256]: 524288 weights
    kept = (keep > 0).double().mean().item()
    n = keep.numel()
    assert abs(kept - 0.75) < 5 * (0.75 * 0.25 / n) ** 0.5  # within 5 binomial standard deviations
    assert bool((keep[keep > 0] == 1 / 0.75).all())


@pytest.mark.slow
def test_the_mean_output_is_unbiased():
    """Over N seeds the mean output converges to the output without dropout. Each output's variance is known
    exactly: ``Var = p / (1 - p) * sum_j w_j^2 v_j^2`` (independent keeps), so the squared z-scores of the mean
    over every output average ~1; a wrong scale (no ``1 / (1 - p)``, or a kept fraction off) is many standard
    deviations away, so the bound cannot pass by chance on it."""
    p, n = 0.5, 400
    q, k, v = (x[:1] for x in qkv(seed=3))
    full = causal_attention(q, k, v, kernel="reference")  # [1, Hq, T, D]
    weights = causal_attention(q, k, torch.eye(S, dtype=torch.float64).expand(1, HKV, S, S), kernel="reference")
    vr = v.repeat_interleave(HQ // HKV, dim=1)  # [1, Hq, S, D]
    variance = p / (1 - p) * (weights ** 2) @ (vr ** 2)  # [1, Hq, T, D]
    g = torch.Generator().manual_seed(11)
    mean = sum(causal_attention(q, k, v, dropout_p=p, generator=g, kernel="tiled") for _ in range(n)) / n
    z2 = ((mean - full) ** 2 / (variance / n)).mean().item()
    assert 0.25 < z2 < 4.0, z2  # the mean of 288 squared standard normals (8 channels of a row correlated)
    wrong = ((mean * (1 - p) - full) ** 2 / (variance / n)).mean().item()  # what an unscaled dropout would give
    assert wrong > 10 * 4.0, (wrong, z2)  # the test's power: the wrong scale lands 10x past the bound (~81 here)
