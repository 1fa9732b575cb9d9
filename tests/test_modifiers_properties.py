"""Property test: random shapes, masks, tile sizes and any mix of modifiers (dropout too); the kernels that take
them equal the float64 oracle (tests/modifier_oracle.py), forward and backward."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.inputs import prepare_inputs
from engine.kernels.sdpa.sdpa_tiles import sdpa_tiles_attention
from engine.kernels.sinks import apply_sinks
from engine.kernels.tiled.tiled import tiled_attention
from engine.masks import document_mask, window_mask
from engine.relative_bias import RelativePositionBias
from tests.modifier_oracle import oracle
from tests.test_modifiers import dense_relative
from tests.test_modifiers_dropout import pattern

SCORE_MODS = {
    "none": None,
    "tanh_per_head": lambda s, b, h, i, j: (2.0 + h) * torch.tanh(s / (2.0 + h)),
    "distance": lambda s, b, h, i, j: s - 0.1 * (i - j).abs() + 0.2 * b,
    "square": lambda s, b, h, i, j: -(s * s) / 4,
}


@st.composite
def problems(draw):
    b, hkv, g = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3]))
    t, s, d = draw(st.integers(1, 40)), draw(st.integers(1, 40)), draw(st.sampled_from([4, 8]))
    family = draw(st.sampled_from(["none", "window", "documents", "dense"]))
    causal = draw(st.booleans())
    seed = draw(st.integers(0, 10_000))
    gen = torch.Generator().manual_seed(seed)
    kpos, qpos = torch.arange(s), torch.arange(s - t, s)
    if family == "window":
        allowed = window_mask(qpos, kpos, draw(st.integers(1, 12)))
    elif family == "documents":
        ids = torch.tensor(sorted(draw(st.lists(st.integers(0, 4), min_size=s, max_size=s))))
        allowed = document_mask(ids[-t:] if t <= s else torch.cat([ids[:1].expand(t - s), ids]), ids)
    elif family == "dense":
        allowed = torch.rand(b, hkv * g, t, s, generator=gen) < 0.5
    else:
        allowed = None
    hq = hkv * g
    f64 = dict(generator=gen, dtype=torch.float64)
    ours, theirs = {}, {}
    if draw(st.booleans()):
        ours["sinks"] = theirs["sinks"] = torch.randn(hq, **f64)
    alibi = draw(st.sampled_from(["none", "heads", "rows"]))
    if alibi != "none":
        slopes = torch.rand(*((hq,) if alibi == "heads" else (b, hq)), **f64)
        ours["alibi_slopes"], theirs["alibi"] = slopes, slopes
    bias = draw(st.sampled_from(["none", "dense", "broadcast", "relative"]))
    if bias == "dense":
        ours["bias"] = theirs["bias"] = torch.randn(b, hq, t, s, **f64)
    elif bias == "broadcast":
        ours["bias"] = theirs["bias"] = torch.randn(hq, 1, s, **f64)
    elif bias == "relative":
        table = torch.randn(hq, draw(st.sampled_from([4, 8, 16])), **f64)
        structured = RelativePositionBias(table, not causal, draw(st.integers(table.shape[1] // 2 + 1, 30)))
        ours["bias"] = structured
        theirs["bias"] = dense_relative(table, qpos.expand(b, t), kpos.expand(b, s), structured.bidirectional,
                                        structured.max_distance)
    score_mod = SCORE_MODS[draw(st.sampled_from(sorted(SCORE_MODS)))]
    if score_mod is not None:
        ours["score_mod"] = theirs["score_mod"] = score_mod
    if draw(st.booleans()):
        ours["softcap"] = theirs["softcap"] = 4.0
    if draw(st.booleans()):  # dropout: the pattern from its definition, for the seed the call draws
        p, drop_seed = draw(st.sampled_from([0.2, 0.5])), draw(st.integers(0, 10_000))
        ours["dropout_p"], ours["generator"] = p, torch.Generator().manual_seed(drop_seed)
        theirs["keep"] = pattern(torch.Generator().manual_seed(drop_seed), p, t=t, s=s, b=b, hq=hq)
    return (b, hq, hkv, t, s, d), allowed, causal, seed, ours, theirs


@given(problems(), st.integers(1, 17), st.integers(1, 17))
def test_kernels_with_any_modifiers_equal_the_oracle_for_any_tile_size(problem, block_q, block_k):
    (b, hq, hkv, t, s, d), allowed, causal, seed, ours, theirs = problem
    g = torch.Generator().manual_seed(seed + 1)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for h, n in ((hq, t), (hkv, s), (hkv, s)))
    sinks = ours.pop("sinks", None)
    softcap = ours.pop("softcap", None)
    inputs = prepare_inputs(q, k, v, None, None, allowed, None, causal=causal, softcap=softcap, **ours)
    want, want_lse = oracle(q, k, v, allowed=allowed, causal=causal, **theirs)
    kernels = [tiled_attention]
    if softcap is None and "score_mod" not in ours and "dropout_p" not in ours:  # sdpa_tiles: ALiBi, biases
        kernels.append(sdpa_tiles_attention)
    for kernel in kernels:
        out, lse = kernel(inputs, True, block_q=block_q, block_k=block_k)
        if sinks is not None:
            out, lse = apply_sinks(out, lse, sinks)
        torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
        torch.testing.assert_close(lse, want_lse, rtol=1e-9, atol=1e-9)


@settings(max_examples=15)
@given(problems(), st.integers(1, 17), st.integers(1, 17))
def test_tiled_gradients_with_any_modifiers_equal_the_oracles(problem, block_q, block_k):
    (b, hq, hkv, t, s, d), allowed, causal, seed, ours, theirs = problem
    g = torch.Generator().manual_seed(seed + 2)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64, requires_grad=True)
               for h, n in ((hq, t), (hkv, s), (hkv, s)))
    sinks, softcap = ours.pop("sinks", None), ours.pop("softcap", None)
    inputs = prepare_inputs(q, k, v, None, None, allowed, None, causal=causal, softcap=softcap, **ours)
    out, lse = tiled_attention(inputs, True, block_q=block_q, block_k=block_k)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    want, want_lse = oracle(q, k, v, allowed=allowed, causal=causal, **theirs)
    w_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    w_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)

    def loss(o, lse_):
        return (o * w_out).sum() + torch.where(torch.isfinite(lse_), lse_ * w_lse, 0.0).sum()

    for got, expected in zip(torch.autograd.grad(loss(out, lse), [q, k, v]),
                             torch.autograd.grad(loss(want, want_lse), [q, k, v])):
        torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-8)
