"""The decode kernels' view of the rule (engine.kernels.visibility.decode_rows): the span of keys some row sees and
each row's visibility, by both of its routes (the mask made dense whole, for calls of up to DENSE_ROWS entries, and
tile bounds row by row beyond), against the rule computed from its definition."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine import document_mask, key_padding_mask, window_mask
from engine.kernels import visibility


def truth(b, hq, t, s, qpos, kpos, allowed, causal):
    """Bool ``[B, Hq, T, S]``: key j visible to query i of head h, from the rule's definition."""
    qpos = torch.arange(s - t, s) if qpos is None else qpos
    kpos = torch.arange(s) if kpos is None else kpos
    qpos, kpos = qpos.long().expand(b, t), kpos.long().expand(b, s)
    seen = torch.ones(b, hq, t, s, dtype=torch.bool)
    if causal:
        seen &= (kpos[:, None, None, :] <= qpos[:, None, :, None])
    if allowed is not None:
        dense = torch.as_tensor(allowed.to_dense() if hasattr(allowed, "to_dense") else allowed)
        seen &= dense
    return seen


def as_rows(j0, j1, visible, b, hkv, group, t, s):
    """decode_rows' answer as bool ``[B, Hq, T, S]`` (keys outside the span hidden)."""
    whole = torch.zeros(b, hkv, group * t, s, dtype=torch.bool)
    if j1 > j0:
        whole[..., j0:j1] = True if visible is None else visible.expand(b, hkv, group * t, j1 - j0)
    return whole.reshape(b, hkv, group, t, s).reshape(b, hkv * group, t, s)  # head h * G + g, row g * T + i


@pytest.mark.parametrize("family", ["positions", "window", "padding", "documents", "heads", "query rows", "none"])
@settings(deadline=None, max_examples=30)
@given(st.integers(1, 3), st.sampled_from([(2, 1), (4, 2), (3, 3), (8, 2)]), st.integers(1, 16),
       st.integers(1, 700), st.booleans(), st.integers(0, 10**6))
def test_property_both_routes_give_the_rule(family, b, heads, t, s, causal, seed):
    hq, hkv = heads
    g = torch.Generator().manual_seed(seed)
    kpos = torch.arange(s).expand(b, s).clone()
    qpos = torch.arange(s - t, s).expand(b, t).clone() + torch.randint(-3, 3, (b, 1), generator=g)
    lengths = torch.randint(0, s + 1, (b,), generator=g)
    allowed = None
    if family == "positions":  # a row's first keys pushed past its queries (left padding by position)
        kpos[:, : int(torch.randint(0, s, (1,), generator=g))] = 10**6
    elif family == "window":
        allowed = window_mask(qpos, kpos, int(torch.randint(1, s + 2, (1,), generator=g)))
    elif family == "padding":
        allowed = key_padding_mask(lengths, s)
    elif family == "documents":
        ids = torch.randint(0, 3, (b, s), generator=g).sort(-1).values
        allowed = document_mask(ids[:, -t:] if t <= s else torch.zeros(b, t, dtype=torch.long), ids)
    elif family == "heads":  # a dense mask per head
        allowed = torch.rand(b, hq, t, s, generator=g) < 0.3
    elif family == "query rows":  # every key alike for a query ([.., T, 1]): some rows, or none, see them all
        allowed = torch.rand(b, 1, t, 1, generator=g) < (0.5 if seed % 2 else 0.0)
    q = torch.zeros(b, hq, t, 8)
    k = torch.zeros(b, hkv, s, 8)
    want = truth(b, hq, t, s, qpos, kpos, allowed, causal)
    for limit in (1 << 40, 0):  # dense whole, then tile bounds
        inputs = engine.plan(q, k, k, qpos, kpos, allowed, causal=causal).inputs
        saved, visibility.DENSE_ROWS = visibility.DENSE_ROWS, limit
        try:
            j0, j1, visible = visibility._decode_rows(inputs)
        finally:
            visibility.DENSE_ROWS = saved
        got = as_rows(j0, j1, visible, b, hkv, hq // hkv, t, s)
        assert torch.equal(got, want), f"route with DENSE_ROWS = {limit}"
        assert j0 % 256 == 0 and (j1 % 256 == 0 or j1 == s) and 0 <= j0 <= j1 <= s
        assert (j1 > j0) == bool(want.any())  # no key read where no row sees one
        if visible is not None:
            assert visible.shape[-1] == j1 - j0 and visible.shape[-2] in (1, (hq // hkv) * t)


def test_a_padded_row_cuts_the_span_to_whole_blocks_of_the_keys_seen():
    b, t, s = 2, 1, 1000
    kpos = torch.arange(s).expand(b, s).clone()
    kpos[:, :600] = 10**6  # keys 0 .. 599 hidden in both rows: the span starts at block 512
    q, k = torch.zeros(b, 4, t, 8), torch.zeros(b, 2, s, 8)
    inputs = engine.plan(q, k, k, torch.full((b, t), s - 1), kpos).inputs
    j0, j1, visible = visibility._decode_rows(inputs)
    assert (j0, j1) == (512, 1000)
    assert visible.shape == (b, 1, 1, 488) and not visible[..., :88].any() and visible[..., 88:].all()


@pytest.mark.parametrize("limit", [1 << 40, 0])
def test_no_row_sees_a_key_gives_an_empty_span(limit, monkeypatch):
    monkeypatch.setattr(visibility, "DENSE_ROWS", limit)
    q, k = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 40, 8)
    inputs = engine.plan(q, k, k, torch.tensor([-5]), None).inputs
    j0, j1, visible = visibility._decode_rows(inputs)
    assert j1 == j0 and visible is None
