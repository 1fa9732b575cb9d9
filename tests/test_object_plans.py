"""A call given positions or a mask keeps its plan for those very objects (engine.object_plans): a model's later
layers, passed the same objects, run the first layer's plan; a tensor written in place since (the positions, a dense
mask, a structured mask's own tensors, a view's base, an inference tensor's values) is planned again, so every call
equals the float64 oracle of its values at the time of the call."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import causal_attention, object_plans
from engine.masks import key_padding_mask, padding_positions
from engine.object_plans import KEPT
from tests.modifier_oracle import oracle


@pytest.fixture
def plans_made(monkeypatch):
    """The number of plans made for calls with positions or a mask, counted from an empty store."""
    made = []
    planner = object_plans.plan_for_call

    def counted(*args, **kwargs):
        made.append(1)
        return planner(*args, **kwargs)

    monkeypatch.setattr(object_plans, "plan_for_call", counted)
    monkeypatch.setattr(object_plans, "_kept", {})
    return made


def padded_step(lengths, keys, t=1, seed=0):
    """q, k, v of a left-padded batch's step of t queries, its positions and key_padding_mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    b = lengths.shape[0]
    q = torch.randn(b, 6, t, 16, generator=g)  # [B, Hq, T, D]
    k, v = (torch.randn(b, 2, keys, 16, generator=g) for _ in range(2))  # [B, Hkv, S, D]
    qpos = (lengths - t)[:, None] + torch.arange(t)  # [B, T]
    return q, k, v, qpos, padding_positions(lengths, keys, "left"), key_padding_mask(lengths, keys, "left")


def assert_oracle(q, k, v, qpos, kpos, allowed, dense=None):
    out, lse = causal_attention(q, k, v, qpos, kpos, allowed, return_lse=True)
    mask = None if allowed is None else (allowed.to_dense() if dense is None else dense)
    want_out, want_lse = oracle(q, k, v, qpos, kpos, mask)
    assert (out.double() - want_out).abs().max().item() <= 1e-5
    seen = want_lse > float("-inf")
    assert torch.equal(lse == float("-inf"), ~seen) and torch.allclose(lse.double()[seen], want_lse[seen], 0, 1e-5)


@pytest.mark.parametrize("t", [1, 3])
def test_later_layers_given_the_same_objects_run_the_first_layers_plan(plans_made, t):
    q, k, v, qpos, kpos, allowed = padded_step([9, 6, 2], 12, t)
    for layer in range(4):  # each layer its own q, k, v; the step's positions and mask
        g = torch.Generator().manual_seed(layer)
        q, k, v = (torch.randn(x.shape, generator=g) for x in (q, k, v))
        assert_oracle(q, k, v, qpos, kpos, allowed)
    assert len(plans_made) == 1
    assert_oracle(q, k, v, qpos.clone(), kpos, allowed)  # other objects, the same values: planned for them
    assert len(plans_made) == 2


def write_positions(step):
    step["qpos"] -= 1  # (the last key now hidden from each query)


def write_dense_mask(step):
    step["allowed"][1, ..., -1] = False


def write_mask_tensor(step):
    step["allowed"].key_values[0, -2:] = False  # a structured mask's own flags


def write_base(step):
    step["base"][1] -= 2  # qpos is base[1:], a view


@pytest.mark.parametrize("write", [write_positions, write_dense_mask, write_mask_tensor, write_base])
@pytest.mark.parametrize("inference", [False, True])
def test_a_tensor_written_in_place_since_is_planned_again(plans_made, write, inference):
    with torch.inference_mode(inference):
        q, k, v, qpos, kpos, allowed = padded_step([9, 6, 2], 12)
        if write is write_dense_mask:
            allowed = allowed.to_dense().clone()
        base = torch.zeros(4, 1, dtype=torch.long)
        if write is write_base:
            base[1:] = qpos
            qpos = base[1:]
        step = {"qpos": qpos, "allowed": allowed, "base": base}
        assert_oracle(q, k, v, step["qpos"], kpos, step["allowed"])
        assert_oracle(q, k, v, step["qpos"], kpos, step["allowed"])
        assert len(plans_made) == 1
        write(step)
        assert_oracle(q, k, v, step["qpos"], kpos, step["allowed"])
        assert len(plans_made) == 2


@settings(deadline=None, max_examples=40)
@given(st.lists(st.integers(1, 10), min_size=1, max_size=3), st.integers(1, 2),
       st.lists(st.sampled_from(["call", "positions", "mask", "keys"]), min_size=2, max_size=8), st.booleans(),
       st.integers(0, 1000))
def test_property_every_call_equals_the_oracle_of_its_objects_values_then(lengths, t, steps, inference, seed):
    g = torch.Generator().manual_seed(seed)
    keys = max(lengths) + 2
    with torch.inference_mode(inference):
        q, k, v, qpos, kpos, allowed = padded_step(lengths, keys, t, seed)
        dense = allowed.to_dense().clone()
        for what in steps:
            if what == "positions":  # a row's queries moved back a key or forward one
                row, by = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((0, len(lengths)), (-1, 2)))
                qpos[row] += by
            elif what == "mask":  # a key hidden or shown again
                b, j = (int(torch.randint(n, (1,), generator=g)) for n in (len(lengths), keys))
                dense[b, 0, 0, j] = not bool(dense[b, 0, 0, j])
            elif what == "keys":  # new keys, the same shapes (the next layer)
                k.copy_(torch.randn(k.shape, generator=g))
            assert_oracle(q, k, v, qpos, kpos, dense)
            assert_oracle(q, k, v, qpos, kpos, allowed)


def test_at_most_kept_plans_are_kept_and_large_calls_not_at_all(plans_made, monkeypatch):
    q, k, v, qpos, kpos, allowed = padded_step([9, 6, 2], 12)
    for shift in range(KEPT + 3):
        assert_oracle(q, k, v, qpos - shift, kpos, allowed)
        assert len(object_plans._kept) <= KEPT
    monkeypatch.setattr(object_plans, "_kept", {})
    monkeypatch.setattr(object_plans, "SMALL_CALL", 3 * 12 - 1)  # (B * T * S = 36)
    for _ in range(2):
        assert_oracle(q, k, v, qpos, kpos, allowed)
    assert object_plans._kept == {} and len(plans_made) == KEPT + 3 + 2


def test_bad_positions_are_named_and_nothing_is_kept(plans_made):
    q, k, v, qpos, kpos, allowed = padded_step([9, 6, 2], 12)
    with pytest.raises(ValueError, match="query_positions"):
        causal_attention(q, k, v, qpos[:, :, None], kpos, allowed)
    with pytest.raises(ValueError, match="allowed"):
        causal_attention(q, k, v, qpos, kpos, torch.ones(3, 1, 1, 5, dtype=torch.bool))
    assert object_plans._kept == {}


@pytest.mark.parametrize("part", [0, 1])
def test_a_part_of_a_combined_mask_written_in_place_is_planned_again(plans_made, part):
    from engine import window_mask

    q, k, v, qpos, kpos, padding = padded_step([9, 6, 2], 12, t=2)
    window_qpos, window_kpos = qpos.clone(), kpos.clone()
    allowed = window_mask(window_qpos, window_kpos, 4) & padding  # (its parts hold their own tensors)
    assert_oracle(q, k, v, qpos, kpos, allowed)
    assert_oracle(q, k, v, qpos, kpos, allowed)
    assert len(plans_made) == 1
    if part == 0:
        allowed.parts[0].key_values[:, -3:] -= 3  # the window's keys, three positions nearer the queries
    else:
        allowed.parts[1].key_values[:, 4] = False
    assert_oracle(q, k, v, qpos, kpos, allowed)
    assert len(plans_made) == 2


def test_objects_holding_more_storage_than_kept_are_not_kept_alive(plans_made):
    import weakref

    q, k, v, qpos, kpos, allowed = padded_step([9, 6, 2], 12)
    base = torch.zeros(object_plans.KEEP_BYTES // 8 + 1, dtype=torch.long)  # a buffer past KEEP_BYTES
    held = base[: qpos.numel()].view_as(qpos).copy_(qpos)  # positions in a view of it
    assert_oracle(q, k, v, held, kpos, allowed)
    assert object_plans._kept == {}
    gone = weakref.ref(base)
    del base, held
    assert gone() is None  # nothing kept the buffer alive
    assert_oracle(q, k, v, qpos, kpos, allowed)  # small ones are kept
    assert len(object_plans._kept) == 1


def test_positions_written_through_numpy_are_planned_again(plans_made):
    q, k, v, qpos, kpos, allowed = padded_step([9, 6, 2], 12)
    shared = torch.from_numpy(qpos.numpy().copy())  # its numpy array writes it with no version counter moved
    assert_oracle(q, k, v, shared, kpos, allowed)
    version = shared._version
    shared.numpy()[1, 0] -= 3
    assert shared._version == version
    assert_oracle(q, k, v, shared, kpos, allowed)
    assert len(plans_made) == 2


def test_a_device_tensor_is_checked_by_its_version_counter_not_its_values():
    # (a GPU tensor's values compared would be a device sync in every layer; the meta device stands in for one here)
    positions, cpu = torch.arange(6, device="meta")[None], torch.arange(6)[None]
    state = object_plans.snapshot((positions, cpu))
    assert [type(then) for _, then in state] == [int, torch.Tensor]
    assert object_plans.unwritten(state)
    positions.add_(1)
    assert not object_plans.unwritten(state)
