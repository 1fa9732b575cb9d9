"""Structured masks: the same values as the dense definitions, and per-tile bounds kernels can trust."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from engine.attention import causal_attention
from engine.inputs import prepare_inputs
from engine.kernels.sdpa.sdpa_tiles import sdpa_tiles_attention
from engine.kernels.tiled.tiled import tiled_attention
from engine.kernels.tiles import EMPTY, plan_tiles
from engine.masks import (
    PairwiseMask,
    StructuredMask,
    as_structured,
    causal_mask,
    document_mask,
    document_positions,
    key_padding_mask,
    padding_mask,
    window_mask,
)


def _dense_window(qp, kp, w):
    return (kp[None, :] <= qp[:, None]) & (qp[:, None] - kp[None, :] < w)


def test_helpers_return_structured_masks_equal_to_the_dense_definitions():
    qp, kp = torch.arange(3, 9), torch.arange(9)
    mask = window_mask(qp, kp, 3)
    assert isinstance(mask, StructuredMask)
    assert mask.shape == (6, 9) and mask.dtype == torch.bool and mask.dim() == 2
    assert torch.equal(mask, _dense_window(qp, kp, 3))  # torch.equal materialises
    assert torch.equal(mask.to_dense(), _dense_window(qp, kp, 3))
    assert torch.equal(causal_mask(qp, kp), kp[None, :] <= qp[:, None])
    ids = torch.tensor([0, 0, 1, 1, 1, 2])
    assert torch.equal(document_mask(ids), ids[:, None] == ids[None, :])
    lengths = torch.tensor([2, 4])
    valid = torch.arange(4)[None, :] < lengths[:, None]  # [B, L]
    assert torch.equal(padding_mask(lengths, 4), valid[:, None, :, None] & valid[:, None, None, :])
    assert torch.equal(key_padding_mask(lengths, 4), valid[:, None, None, :])


def test_structured_masks_behave_as_bool_tensors():
    qp = torch.arange(6)
    mask = window_mask(qp, qp, 2)
    dense = mask.to_dense()
    assert torch.equal(mask[1], dense[1]) and int(mask.sum()) == int(dense.sum())
    assert bool((mask == dense).all()) and not bool((mask != dense).any())
    assert torch.equal(torch.where(mask, 1, 0), dense.long())
    tril = torch.ones(6, 6, dtype=torch.bool).tril()
    for combined, expected in ((mask & tril, dense & tril), (tril & mask, tril & dense), (mask | ~tril, dense | ~tril),
                               (~tril | mask, ~tril | dense), (~mask, ~dense), (torch.logical_not(mask), ~dense)):
        assert isinstance(combined, StructuredMask)  # composing keeps the structure for kernels
        assert torch.equal(combined, expected)
    assert mask.tolist() == dense.tolist()


def test_per_row_values_give_batch_masks():
    qp = torch.tensor([[0, 1], [5, 6]])
    kp = torch.tensor([[0, 1, 2], [4, 5, 6]])
    mask = causal_mask(qp, kp)
    assert mask.shape == (2, 1, 2, 3) and mask.batched()
    assert torch.equal(mask[1, 0], torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    shared = causal_mask(torch.arange(2).expand(3, 2), torch.arange(3))  # one row expanded: planned once
    assert shared.shape == (3, 1, 2, 3) and not shared.batched()


def test_the_causal_structured_mask_summarises_tiles_without_a_dense_tensor():
    pos = torch.arange(8)
    some, every = causal_mask(pos, pos).tile_bounds(0, 4, 4, 8, 8)
    assert torch.equal(some, torch.tensor([[True, False], [True, True]]))  # upper right tile skipped
    assert torch.equal(every, torch.tensor([[False, False], [True, False]]))  # lower left needs no mask


def _check_bounds(mask, batch, t, s, block_q, block_k):
    dense = mask.to_dense()
    dense = dense.reshape((1,) * (4 - dense.dim()) + tuple(dense.shape)).expand(batch, -1, t, s)  # [B, H|1, T, S]
    for b in range(batch):
        some, every = mask.tile_bounds(b, block_q, block_k, t, s)
        assert some.shape == every.shape == (-(-t // block_q), -(-s // block_k))
        for i in range(some.shape[0]):
            for j in range(some.shape[1]):
                i0, j0 = i * block_q, j * block_k
                i1, j1 = min(i0 + block_q, t), min(j0 + block_k, s)
                tile = dense[b, :, i0:i1, j0:j1]
                block = mask.block(b, i0, i1, j0, j1)
                assert torch.equal(block.expand(tile.shape[0], i1 - i0, j1 - j0), tile)  # exact tile values
                if not bool(some[i, j]):
                    assert not bool(tile.any())  # "no True here" must be true
                if bool(every[i, j]):
                    assert bool(tile.all())  # "no False here" must be true


MASK_KINDS = ["causal", "window", "document", "padding", "key_padding", "dense", "combo"]


def _sorted_values(draw, rows: int, length: int, low: int, high: int) -> torch.Tensor:
    """Int64 ``[rows, length]`` of values sorted along each row (positions, or ids of contiguous documents)."""
    return torch.tensor([sorted(draw(st.lists(st.integers(low, high), min_size=length, max_size=length)))
                         for _ in range(rows)])


@st.composite
def masks(draw, kind: str):
    """``(mask, batch, T, S)`` of one kind; T, S, batch, positions, ids and lengths drawn."""
    t, s = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    batch = draw(st.integers(1, 2))
    rows = batch if draw(st.booleans()) else 1  # [B, L] values that differ by row, or one [L] row for all
    qp = _sorted_values(draw, rows, t, -3, 30).squeeze(0)  # [T] or [B, T]
    kp = _sorted_values(draw, rows, s, 0, 30).squeeze(0)  # [S] or [B, S]
    if kind == "causal":
        return causal_mask(qp, kp), batch, t, s
    if kind == "window":
        return window_mask(qp, kp, draw(st.integers(1, 8))), batch, t, s
    if kind == "document":
        if draw(st.booleans()):  # packed documents: contiguous ids, the same for queries and keys (T = S)
            ids = _sorted_values(draw, rows, s, 0, 4).squeeze(0)  # [S] or [B, S]
            return document_mask(ids), batch, s, s
        ids_q = torch.tensor(draw(st.lists(st.integers(0, 3), min_size=t, max_size=t)))  # not even sorted
        ids_k = torch.tensor(draw(st.lists(st.integers(0, 3), min_size=s, max_size=s)))
        return document_mask(ids_q, ids_k), batch, t, s
    lengths = torch.tensor(draw(st.lists(st.integers(0, s), min_size=batch, max_size=batch)))
    side = draw(st.sampled_from(["left", "right"]))
    if kind == "key_padding":
        return key_padding_mask(lengths, s, side), batch, t, s
    if kind == "padding":
        return padding_mask(lengths, s, side), batch, s, s
    g = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
    dense = torch.rand(batch, draw(st.sampled_from([1, 3])), t, s, generator=g) < draw(st.floats(0.0, 1.0))
    if kind == "dense":
        return as_structured(dense), batch, t, s
    return (window_mask(qp, kp, 4) | ~causal_mask(qp, kp)) & dense, batch, t, s


@pytest.mark.parametrize("kind", MASK_KINDS)  # every kind is drawn; the rest of each mask is up to hypothesis
@given(data=st.data(), block_q=st.integers(1, 9), block_k=st.integers(1, 9))
def test_tile_bounds_are_sound_and_blocks_exact(kind, data, block_q, block_k):
    mask, batch, t, s = data.draw(masks(kind))
    _check_bounds(mask, batch, t, s, block_q, block_k)


@given(lengths=st.lists(st.integers(1, 30), min_size=2, max_size=5), block_q=st.integers(4, 16),
       block_k=st.integers(4, 16), kernel=st.sampled_from(["tiled", "sdpa_tiles"]),
       rule=st.sampled_from(["causal", "restart", "bidirectional"]), seed=st.integers(0, 1000))
def test_kernels_with_tiles_straddling_documents_equal_the_reference(lengths, block_q, block_k, kernel, rule, seed):
    # Packed documents in small tiles, so query and key tiles straddle document boundaries: a tile that mixes
    # documents must be masked (a too-generous "every" bound would run it unmasked), and row 1 has the mirrored
    # boundaries of row 0 (per-row plans). rule: causal with global positions; causal with positions that
    # restart at 0 in each document; or no causal rule (a packed encoder: only the documents mask tiles).
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # [L]
    ids = torch.stack([ids, ids.max() - ids.flip(0)])  # [B, L]: row 1 mirrored
    length = ids.shape[1]
    assume(any(len(set(ids[0, i0:i0 + block_q].tolist())) > 1 for i0 in range(0, length, block_q)))
    pos = document_positions(ids) if rule == "restart" else None  # [B, L] or default 0..L-1
    causal = rule != "bidirectional"
    allowed = document_mask(ids)  # [B, 1, L, L]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, length, 8, generator=g, dtype=torch.float64)  # [B, Hq, T, D]
    k, v = (torch.randn(2, 2, length, 8, generator=g, dtype=torch.float64) for _ in range(2))  # [B, Hkv, S, D]
    grad_out = torch.randn(2, 4, length, 8, generator=g, dtype=torch.float64)  # [B, Hq, T, Dv]
    results = []
    for run in ("reference", kernel):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        if run == "reference":
            out, lse = causal_attention(*leaves, pos, pos, allowed, causal=causal, kernel="reference",
                                        return_lse=True)
        else:
            inputs = prepare_inputs(*leaves, pos, pos, allowed, None, causal=causal)
            out, lse = {"tiled": tiled_attention, "sdpa_tiles": sdpa_tiles_attention}[run](inputs, True, block_q,
                                                                                             block_k)
        results.append([out, lse, *torch.autograd.grad(out, leaves, grad_out)])
    expected, got = results
    for name, a, e in zip(["out", "lse", "dq", "dk", "dv"], got, expected):
        if name == "lse":  # fp32 or fp64 lse: compare within fp32 rounding
            torch.testing.assert_close(a.double(), e.double(), rtol=1e-6, atol=1e-6, msg=name)
        else:
            torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=name)


def test_sorted_structures_skip_most_tiles():
    # A window of 16 over 256 tokens in 16 x 16 tiles: only the diagonal band of tiles is computed.
    pos = torch.arange(256)
    some, every = window_mask(pos, pos, 16).tile_bounds(0, 16, 16, 256, 256)
    assert int(some.sum()) == 16 + 15  # diagonal tiles and the ones just left of them
    assert int(every.sum()) == 0  # every visible tile is cut by the band
    some, every = document_mask(pos // 64).tile_bounds(0, 16, 16, 256, 256)
    assert int(some.sum()) == int(every.sum()) == 4 * 16  # whole 64-token documents: full or empty tiles


def test_a_non_bool_mask_is_rejected():
    with pytest.raises(ValueError, match="bool tensor"):
        as_structured(torch.ones(3, 3))


class BandMask(PairwiseMask):
    """A family the engine has never seen, defined here only: keys within ``radius`` on either side."""

    name = "band"

    def __init__(self, query_positions, key_positions, radius):
        super().__init__(query_positions, key_positions)
        self.radius = radius

    def relate(self, q, k):
        return (q - k).abs() < self.radius

    def bounds(self, q_lo, q_hi, k_lo, k_hi):
        some = (k_lo - q_hi < self.radius) & (q_lo - k_hi < self.radius)
        every = (k_hi - q_lo < self.radius) & (q_hi - k_lo < self.radius)
        return some, every


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", ["auto", "decode", "sdpa", "sdpa_tiles", "tiled"])
def test_a_new_mask_family_is_one_subclass_and_every_kernel_runs_it(kernel, causal):
    # Nothing but the subclass above: the kernels plan its tiles from its bounds (skipping the empty ones)
    # and mask partial tiles from its relation; the result equals the reference on its dense form.
    pos = torch.arange(600)
    band = BandMask(pos, pos, 40)
    dense = (pos[:, None] - pos[None, :]).abs() < 40  # [T, S], written out independently
    assert torch.equal(band.to_dense(), dense)
    plan = plan_tiles(band, 0, 600, 600, 128, 128)
    assert any(kind == EMPTY for row in plan.kinds for kind in row)  # tiles far from the band are skipped
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, 600, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    out, lse = causal_attention(q, k, v, allowed=band, causal=causal, kernel=kernel, return_lse=True)
    ref, ref_lse = causal_attention(q, k, v, allowed=dense, causal=causal, kernel="reference", return_lse=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
