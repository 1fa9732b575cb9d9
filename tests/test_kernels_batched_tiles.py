"""sdpa_tiles' forward: a tile's touching spans fold into one masked call, and translated copies of that
call (a sliding window's middle tiles) run as one batched call with a shared mask. Same results as the
reference, and the batching happens where it should (and only there)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import causal_attention
from engine.inputs import prepare_inputs
from engine.kernels.sdpa.calls import BLOCK_K, BLOCK_Q, batches, plan_calls
from engine.kernels.visibility import visibility_mask
from engine.masks import window_mask


def _qkv(b, hq, hkv, t, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, hq, t, 16, generator=g, dtype=dtype), torch.randn(b, hkv, t, 16, generator=g, dtype=dtype),
            torch.randn(b, hkv, t, 16, generator=g, dtype=dtype))


@pytest.mark.parametrize("t, w, batch, hq, hkv", [
    (2048, 512, 1, 2, 2),  # the benchmark's shape, small: 6 middle tiles batched
    (1000, 100, 1, 2, 2),  # T not a multiple of the tile; window narrower than a tile
    (1500, 300, 2, 4, 2),  # batch rows share the mask; GQA
    (1300, 256, 1, 3, 1),  # MQA; window = one tile
])
def test_batched_window_tiles_match_the_reference(t, w, batch, hq, hkv):
    q, k, v = _qkv(batch, hq, hkv, t)
    pos = torch.arange(t)
    allowed = window_mask(pos, pos, w)
    out, lse = causal_attention(q, k, v, allowed=allowed, kernel="sdpa_tiles", return_lse=True)
    ref, ref_lse = causal_attention(q, k, v, allowed=allowed, kernel="reference", return_lse=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_a_window_batches_its_middle_tiles_and_per_row_masks_do_not_mix():
    t, w = 2048, 512
    pos = torch.arange(t)
    q, k, v = _qkv(1, 2, 2, t)
    inputs = prepare_inputs(q, k, v, None, None, window_mask(pos, pos, w), None)
    joined = batches(visibility_mask(inputs), plan_calls(inputs, BLOCK_Q, BLOCK_K))
    assert [(batched, len(group)) for batched, group in joined] == [(False, 1), (True, 6)]  # tiles 2..7: one batch
    assert {call.kind for call in joined[1][1]} == {"partial"}
    assert {call[4] - call[3] for call in joined[1][1]} == {w + BLOCK_Q}  # band start .. tile end

    # Two batch rows with different positions: each row's tiles batch apart, and results stay exact.
    q, k, v = _qkv(2, 2, 2, 1024)
    positions = torch.stack([torch.arange(1024), torch.arange(1024) * 2])  # [B, T]
    allowed = window_mask(positions, positions, 300)
    out = causal_attention(q, k, v, positions, positions, allowed=allowed, kernel="sdpa_tiles")
    ref = causal_attention(q, k, v, positions, positions, allowed=allowed, kernel="reference")
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_groups_without_a_masked_span_are_not_folded_nor_batched():
    # Chunked prefill: one query tile group [full | causal] (no mask), run as two calls merged by lse.
    q, k, v = _qkv(1, 2, 2, 1024)
    query_positions = torch.arange(768, 1024)[None]  # [1, T]: 256 queries after 768 cached keys
    inputs = prepare_inputs(q[:, :, 768:], k, v, query_positions, None, None, None)
    joined = batches(visibility_mask(inputs), plan_calls(inputs, BLOCK_Q, BLOCK_K))
    assert [(batched, [call.kind for call in group]) for batched, group in joined] == [(False, ["full", "causal"])]
    out = causal_attention(q[:, :, 768:], k, v, query_positions, kernel="sdpa_tiles")
    ref = causal_attention(q[:, :, 768:], k, v, query_positions, kernel="reference")
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
