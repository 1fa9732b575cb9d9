"""Property tests: random shapes, masks and tile sizes; the tiled kernels equal the reference."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.attention import causal_attention
from engine.inputs import prepare_inputs
from engine.kernels.merge import merge_attention_states
from engine.kernels.sdpa.sdpa_tiles import sdpa_tiles_attention
from engine.kernels.tiled.tiled import tiled_attention
from engine.masks import StructuredMask, document_mask, key_padding_mask, window_mask


@st.composite
def problems(draw):
    b, hkv, g = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3]))
    t, s, d = draw(st.integers(1, 40)), draw(st.integers(1, 40)), draw(st.sampled_from([4, 8]))
    family = draw(st.sampled_from(["none", "window", "documents", "key_padding", "dense"]))
    causal = draw(st.booleans())
    seed = draw(st.integers(0, 10_000))
    kpos = torch.arange(s)
    qpos = torch.arange(s - t, s)
    if family == "window":
        allowed = window_mask(qpos, kpos, draw(st.integers(1, 12)))
    elif family == "documents":
        ids = torch.tensor(sorted(draw(st.lists(st.integers(0, 4), min_size=s, max_size=s))))
        allowed = document_mask(ids[-t:] if t <= s else torch.cat([ids[:1].expand(t - s), ids]), ids)
    elif family == "key_padding":
        allowed = key_padding_mask(torch.tensor(draw(st.lists(st.integers(0, s), min_size=b, max_size=b))), s)
    elif family == "dense":
        allowed = torch.rand(b, hkv * g, t, s, generator=torch.Generator().manual_seed(seed)) < 0.5
    else:
        allowed = None
    return (b, hkv * g, hkv, t, s, d), allowed, causal, seed


@given(problems(), st.integers(1, 17), st.integers(1, 17), st.booleans())
def test_tiled_kernels_equal_the_reference_for_any_tile_size(problem, block_q, block_k, fused):
    (b, hq, hkv, t, s, d), allowed, causal, seed = problem
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for h, n in ((hq, t), (hkv, s), (hkv, s)))
    inputs = prepare_inputs(q, k, v, None, None, allowed, None, causal=causal)
    kernel = sdpa_tiles_attention if fused else tiled_attention
    out, lse = kernel(inputs, True, block_q, block_k)
    ref, ref_lse = causal_attention(q, k, v, allowed=allowed, causal=causal, kernel="reference", return_lse=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    # lse values, against the reference and an independent float64 logsumexp; the lse may be fp32 or fp64,
    # so both are compared within fp32 rounding.
    exact = _float64_lse(q, k, allowed, causal)  # [B, Hq, T]
    torch.testing.assert_close(lse.double(), exact, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ref_lse.double(), exact, rtol=1e-6, atol=1e-6)


def _float64_lse(q, k, allowed, causal):
    """``[B, Hq, T]`` logsumexp of each row's visible scores (default positions), -inf where none is visible."""
    t, s, d = q.shape[2], k.shape[2], q.shape[3]
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [B, Hq, S, D]
    scores = (q.double() @ k.transpose(-2, -1)) / d ** 0.5  # [B, Hq, T, S]
    visible = torch.ones(t, s, dtype=torch.bool)  # [T, S]
    if causal:  # queries at positions S-T .. S-1, keys at 0 .. S-1
        visible = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
    if allowed is not None:
        visible = visible & (allowed.to_dense() if isinstance(allowed, StructuredMask) else allowed)
    return scores.masked_fill(~visible, float("-inf")).logsumexp(dim=-1)


@given(st.integers(2, 60), st.integers(1, 4), st.integers(0, 1000))
def test_rows_of_weights_sum_to_one_and_split_keys_merge_back(s, parts, seed):
    # Attend over one-hot values: the output rows are the weights; they sum to 1 for every row that sees a key.
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, 2, s, 4, generator=g), torch.randn(1, 1, s, 4, generator=g)
    eye = torch.eye(s)[None, None]  # [1, 1, S, S]
    weights = causal_attention(q, k, eye, kernel="tiled")  # [1, 2, S, S]
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, 2, s), rtol=0, atol=1e-5)
    assert bool((weights.triu(1) == 0).all())  # nothing from the future
    cuts = sorted(torch.randint(0, s + 1, (parts - 1,), generator=g).tolist())
    outs, lses = [], []
    for j0, j1 in zip([0, *cuts], [*cuts, s]):
        part = (torch.arange(s) >= j0) & (torch.arange(s) < j1)
        out, lse = causal_attention(q, k, eye, allowed=part, kernel="tiled", return_lse=True)
        outs.append(out)
        lses.append(lse)
    merged, _ = merge_attention_states(outs, lses)
    torch.testing.assert_close(merged, weights, rtol=1e-5, atol=1e-6)
