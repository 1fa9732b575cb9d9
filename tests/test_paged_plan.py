"""A paged step planned once and run in every layer (engine.plan_paged): equal to paged_attention and to the
float64 oracle layer after layer, refusing tensors it was not made for, owning its tables and positions, and reading
nothing back to the host per layer on the decode path in place."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import engine
from engine import paged_attention, plan_paged
from engine.kernels.decode.native_build import native_unavailable
from engine.quantized import quantize
from tests.host_syncs import counted_host_syncs
from tests.paged_cases import oracle, paged_batches


def other_layer(args, seed):
    """The same step's tensors of another layer: new q and pools of the same shapes (NaN kept where it was)."""
    q, k_pages, v_pages, *tables = args
    g = torch.Generator().manual_seed(seed)
    new = [torch.where(x.isnan(), x, torch.randn(x.shape, generator=g, dtype=x.dtype)) for x in (q, k_pages, v_pages)]
    return (*new, *tables)


@settings(max_examples=25, deadline=None)
@given(paged_batches())
def test_a_plan_run_on_three_layers_equals_paged_attention_and_the_oracle(problem):
    args, options = problem
    ours = {("alibi_slopes" if name == "alibi" else name): x for name, x in options.items()}
    step = plan_paged(*args, **ours)
    for seed in range(3):
        layer = other_layer(args, seed) if seed else args
        out, lse = step.run(*layer[:3], return_lse=True)
        want, want_lse = paged_attention(*layer, return_lse=True, **ours)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)  # the same path, the same numbers
        oracle_out, oracle_lse = oracle(*layer, **options)
        torch.testing.assert_close(out, oracle_out, rtol=1e-9, atol=1e-9)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(oracle_lse))


def decode_step(dtype=torch.float32, batch=4, page_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([37, 5, 64, 20][:batch])
    pages_per = -(-int(lens.max()) // page_size)
    table = torch.randperm(batch * pages_per, generator=g).view(batch, pages_per)
    k_pages, v_pages = (torch.randn(batch * pages_per, page_size, 2, 16, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(batch, 6, 16, generator=g).to(dtype)
    return q, k_pages, v_pages, table, lens, torch.arange(batch + 1)


def test_a_planned_decode_step_reads_nothing_back_to_the_host_per_layer():
    if native_unavailable() is not None:
        pytest.skip(native_unavailable())
    args = decode_step()
    step = plan_paged(*args)
    assert step.path == "native in place", str(step)
    layers = [other_layer(args, seed)[:3] for seed in range(4)]
    step.run(*layers[0])  # (a first run may load the library)
    with counted_host_syncs() as syncs:
        outs = [step.run(*layer) for layer in layers]
    assert sum(syncs.values()) == 0, dict(syncs)
    for layer, out in zip(layers, outs):
        torch.testing.assert_close(out.double(), oracle(*layer, *args[3:])[0], rtol=1e-5, atol=1e-5)
    with counted_host_syncs() as syncs:  # unplanned, a call validates and copies its tables every time
        paged_attention(*args)
    assert sum(syncs.values()) > 0


@pytest.mark.parametrize("change", ["q dtype", "pool shape", "pool kind", "q device", "gradients"])
def test_a_paged_plan_refuses_tensors_it_was_not_made_for_naming_the_difference(change):
    q, k_pages, v_pages, *tables = decode_step()
    step = plan_paged(q, k_pages, v_pages, *tables)
    given_ = {"q dtype": (q.double(), k_pages, v_pages), "pool shape": (q, k_pages[:-1], v_pages),
              "pool kind": (q, quantize(k_pages), v_pages), "q device": (q.to("meta"), k_pages, v_pages),
              "gradients": (q.clone().requires_grad_(), k_pages, v_pages)}[change]
    message = {"q dtype": "made for q's dtype torch.float32, got torch.float64",
               "pool shape": "made for k_pages's shape", "pool kind": "made for k_pages's quantized False, got True",
               "q device": "made for q's device cpu, got meta",
               "gradients": "made for tensors that do not need gradients"}[change]
    assert not step.matches(*given_)
    with pytest.raises(ValueError, match=message):
        step.run(*given_)


def test_a_paged_plan_owns_its_tables_and_positions():
    q, k_pages, v_pages, table, lens, indptr = decode_step()
    positions = lens - 1  # each query at its sequence's last key
    want = paged_attention(q, k_pages, v_pages, table, lens, indptr, positions.clone())
    step = plan_paged(q, k_pages, v_pages, table, lens, indptr, positions)
    table.fill_(0)
    lens.fill_(1)
    positions.fill_(0)
    torch.testing.assert_close(step.run(q, k_pages, v_pages), want, rtol=0, atol=0)


def test_print_of_a_paged_plan_names_its_path_and_explain_paged_agrees():
    args = decode_step()
    step = plan_paged(*args)
    if native_unavailable() is None:
        assert str(step).startswith("paged: decode_native reads K/V in place through the page table")
    assert str(step) == engine.explain_paged(*args)
    gathered = plan_paged(*args, kernel="reference")
    assert gathered.path == "per sequence" and "not decode_native in place: kernel='reference' forced" in str(gathered)
    assert "gathered, kernel reference" in engine.explain_paged(*args, kernel="reference")


def test_a_native_plan_run_on_pools_with_a_strided_last_axis_stays_exact():
    # planned on contiguous pools; a later layer's pools have a strided last axis (same shape and dtype): the plan
    # must not read them as contiguous rows
    q, k_pages, v_pages, *tables = decode_step()
    step = plan_paged(q, k_pages, v_pages, *tables)
    g = torch.Generator().manual_seed(3)
    strided = torch.randn(k_pages.shape[0], k_pages.shape[1], k_pages.shape[3], k_pages.shape[2],
                          generator=g).transpose(2, 3)  # [num_pages, P, Hkv, D], last axis strided
    assert step.matches(q, strided, v_pages)
    torch.testing.assert_close(step.run(q, strided, v_pages).double(), oracle(q, strided, v_pages, *tables)[0],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["auto", "tiled"])
@pytest.mark.parametrize("window", [None, 9])
def test_each_sequences_call_is_planned_once_per_step_not_per_layer(monkeypatch, kernel, window):
    # a mixed step (a prefill, a chunk, decodes) runs the readable path: its calls are planned by plan_paged, and a
    # layer's run plans nothing (it used to plan and build a window mask per sequence per layer)
    import engine.planning as planning
    q, k_pages, v_pages, table, lens, _ = decode_step()
    g = torch.Generator().manual_seed(3)
    indptr = torch.tensor([0, 5, 6, 10, 11])  # 5, 1, 4, 1 new queries
    q = torch.randn(11, 6, 16, generator=g)
    step = plan_paged(q, k_pages, v_pages, table, lens, indptr, window=window, kernel=kernel)
    assert step.path == ("mixed" if kernel == "auto" else "per sequence") and step.sequences is not None, str(step)
    planned = []  # every plan (engine.plan, causal_attention's) chooses its kernel through planning's ``choose``
    real_choose = planning.choose
    monkeypatch.setattr(planning, "choose", lambda *a, **k: planned.append(1) or real_choose(*a, **k))
    for seed in range(3):
        layer = other_layer((q, k_pages, v_pages, table, lens, indptr), seed)
        out = step.run(*layer[:3])
        want = oracle(*layer, window=window)[0]
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert planned == []
    assert f"kernel {kernel if kernel != 'auto' else ''}" in str(step)
    if kernel == "auto":  # the decodes (sequences 1 and 3: one query each) read in place as one call
        assert step.decodes[1] == [1, 3] and "sequence 1 (1 queries, 5 keys): read in place" in str(step)


def test_a_mixed_steps_decodes_with_nan_in_q_keep_it_to_their_rows():
    # the decodes of a mixed step are read in place; NaN in one decode's q sends them to their own calls, which keep
    # it to that row (as the oracle does)
    if native_unavailable() is not None:
        pytest.skip(native_unavailable())
    q, k_pages, v_pages, table, lens, _ = decode_step()
    indptr = torch.tensor([0, 5, 6, 10, 11])  # a prefill of 5, a decode, a chunk of 4, a decode
    q = torch.randn(11, 6, 16, generator=torch.Generator().manual_seed(4))
    step = plan_paged(q, k_pages, v_pages, table, lens, indptr)
    assert step.path == "mixed", str(step)
    for bad_row in (5, 10, 2):  # each decode's row, then a prefill's
        q_bad = q.clone()
        q_bad[bad_row, 1, 3] = float("nan")
        out, lse = step.run(q_bad, k_pages, v_pages, return_lse=True)
        want, want_lse = oracle(q_bad, k_pages, v_pages, table, lens, indptr)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5, equal_nan=True)
        assert out.isnan().any(dim=(1, 2)).nonzero().flatten().tolist() == [bad_row]
