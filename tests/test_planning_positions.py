"""A call whose positions hide no key (engine.attention.hides_no_key) takes the plan of its shapes: the same results
as the call planned with its positions and as a float64 oracle, whatever the positions' layout and dtype; positions
that hide a key, and bad ones, are planned and named as before."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine import attention, causal_attention, object_plans, planning
from engine.attention import hides_no_key
from tests.modifier_oracle import oracle


def brute_hides_no_key(b, t, s, qpos, kpos) -> bool:
    """From the rule itself: every (query, key) pair of every row is visible."""
    qpos = torch.arange(s - t, s) if qpos is None else qpos
    kpos = torch.arange(s) if kpos is None else kpos
    qpos, kpos = qpos.long().expand(b, t), kpos.long().expand(b, s)
    return bool((kpos[:, None, :] <= qpos[:, :, None]).all())


def positions(layout, rows, length, start, shift, dtype):
    """None, ``[length]`` or ``[rows, length]`` positions from ``start`` (row b shifted by ``shift[b]``), in ``dtype``
    (int64 where ``dtype`` holds no negative value and one is negative)."""
    if layout == "none":
        return None
    base = torch.arange(start, start + length)
    made = base if layout == "1d" else torch.stack([base + shift[i] for i in range(rows)])
    return made if int(made.min()) < 0 and not dtype.is_signed else made.to(dtype)


@settings(deadline=None, max_examples=60)
@given(st.integers(1, 3), st.sampled_from([(2, 1), (4, 2), (3, 3)]), st.one_of(st.just(1), st.integers(1, 18)),
       st.integers(1, 40),
       st.sampled_from(["none", "1d", "2d"]), st.sampled_from(["none", "1d", "2d"]),
       st.integers(-3, 3), st.lists(st.integers(-1, 2), min_size=3, max_size=3),
       st.lists(st.integers(-3, 3), min_size=3, max_size=3),
       st.sampled_from([torch.int64, torch.int32, torch.uint8]),
       st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), st.integers(0, 1000))
def test_property_positions_route_equals_the_call_planned_with_them_and_the_oracle(b, heads, t, s, q_layout,
                                                                                   k_layout, gap, shift, rows,
                                                                                   pos_dtype, dtype, seed):
    hq, hkv = heads
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, 16, generator=g).to(dtype)  # [B, Hq, T, D]
    k, v = (torch.randn(b, hkv, s, 16, generator=g).to(dtype) for _ in range(2))  # [B, Hkv, S, D]
    # the last query gap positions past the last key; with [B, S] keys, row b's keys shifted by rows[b] and its
    # queries by as much (so rows may each hide nothing where all of them together would) and shift[b] more
    k_start = 0 if k_layout == "none" else 3
    kpos = positions(k_layout, b, s, k_start, rows, pos_dtype)
    q_rows = [r + x for r, x in zip(rows, shift)] if k_layout == "2d" else shift
    qpos = positions(q_layout, b, t, k_start + s + gap - t, q_rows, pos_dtype)
    assert hides_no_key(q, k, qpos, kpos) == brute_hides_no_key(b, t, s, qpos, kpos)
    out, lse = causal_attention(q, k, v, qpos, kpos, return_lse=True)
    planned_out, planned_lse = engine.plan(q, k, v, qpos, kpos).run(q, k, v, return_lse=True)
    want_out, want_lse = oracle(q, k, v, None if qpos is None else qpos.long(),
                                None if kpos is None else kpos.long())
    tolerance = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.double(), want_out, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(out, planned_out, rtol=tolerance, atol=tolerance)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    seen = ~torch.isneginf(want_lse)
    torch.testing.assert_close(lse.double()[seen], want_lse[seen], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, planned_lse, rtol=1e-5, atol=1e-5)


def decode_step(s=300, b=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, 8, 1, 64, generator=g).to(dtype)  # [B, Hq, 1, D]
    k, v = (torch.randn(b, 2, s, 64, generator=g).to(dtype) for _ in range(2))  # [B, Hkv, S, D]
    return q, k, v


@pytest.mark.parametrize("layout", ["1d", "2d", "rows apart", "int32"])
def test_a_decode_step_with_its_positions_passed_reuses_the_shapes_plan_bitwise(monkeypatch, layout):
    q, k, v = decode_step()
    kpos = torch.arange(300)
    qpos = torch.tensor([299])
    if layout == "2d":
        kpos, qpos = kpos.expand(2, 300).clone(), torch.tensor([[299], [305]])
    if layout == "rows apart":  # each row sees all its keys; row 1's keys lie past row 0's query
        kpos, qpos = torch.stack([kpos, kpos + 500]), torch.tensor([[299], [799]])
    if layout == "int32":
        kpos, qpos = kpos.int(), qpos.int()
    want = engine.plan(q, k, v, qpos, kpos).run(q, k, v)  # planned with its positions

    def refused(*args, **kwargs):
        raise AssertionError("a call whose positions hide no key was planned for its positions")

    monkeypatch.setattr(attention, "plan_for_call", refused)
    got = causal_attention(q, k, v, qpos, kpos)
    assert torch.equal(got, want)  # the same kernel on the same keys: bitwise
    assert torch.equal(got, causal_attention(q, k, v))  # and the default positions' call


@pytest.mark.parametrize("case", ["one key ahead", "a row behind", "negative query"])
def test_positions_that_hide_a_key_are_planned_with_them(monkeypatch, case):
    q, k, v = decode_step()
    kpos, qpos = torch.arange(300), torch.tensor([298])  # key 299 is ahead of the query
    if case == "a row behind":
        kpos, qpos = torch.stack([torch.arange(300), torch.arange(300) + 1]), torch.tensor([[299], [299]])
    if case == "negative query":
        qpos = torch.tensor([-1])
    assert not hides_no_key(q, k, qpos, kpos)
    calls = []
    monkeypatch.setattr(object_plans, "plan_for_call",  # (positions that decide: planned with them, then kept)
                        lambda *a, **kw: calls.append(1) or planning.plan_for_call(*a, **kw))
    monkeypatch.setattr(object_plans, "_kept", {})
    out, lse = causal_attention(q, k, v, qpos, kpos, return_lse=True)
    assert calls == [1]
    want_out, want_lse = oracle(q, k, v, qpos, kpos)
    torch.testing.assert_close(out.double(), want_out, rtol=2e-5, atol=2e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))


@pytest.mark.parametrize("qpos, kpos, message", [
    (torch.tensor([1.5]), None, "query_positions must have an integer dtype, got torch.float32"),
    (None, torch.arange(7), r"key_positions must have shape \[300\] or \[2, 300\], got \(7,\)"),
    ([299], None, "query_positions must be an integer tensor of shape"),
    (torch.tensor([True]), None, "query_positions must have an integer dtype, got torch.bool"),
    (None, torch.empty(300, dtype=torch.long, device="meta"), "key_positions is a meta tensor"),
])
def test_bad_positions_are_named_as_before(qpos, kpos, message):
    q, k, v = decode_step()
    with pytest.raises(ValueError, match=message):
        causal_attention(q, k, v, qpos, kpos)


def test_bad_tensors_with_positions_are_named_not_crashed():
    q, k, v = decode_step()
    qpos = torch.tensor([299])
    with pytest.raises(ValueError, match="q must be a torch.Tensor, got str"):
        causal_attention("q", k, v, qpos)
    with pytest.raises(ValueError, match="q must be a torch.Tensor, got str"):
        causal_attention("q", k, v)  # (the shapes' plan too: a clear error, not an AttributeError)
    with pytest.raises(ValueError, match=r"q must be 4-D"):
        causal_attention(q[0], k, v, qpos)
    with pytest.raises(ValueError, match="q, k, v must share one dtype"):
        causal_attention(q.double(), k, v, qpos)
