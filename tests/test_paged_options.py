"""A paged call's options beyond the window: ``score_mod`` (its batch index the sequence's) and ``allowed`` (bool
``[Nq, K]``: key j of its sequence visible to query row i where allowed[i, j]), ANDed with the position rule and the
window, on every path: the native kernel in place (a decode step and a mixed
step's decodes), each sequence's own call (gathered, by runs), against the float64 oracle; masked keys' NaN never
leaks; a fully masked row gives 0 and lse -inf; a bad mask gets a clear error."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine import paged_attention, plan_paged
from engine.kernels.decode.native_build import native_unavailable
from tests.paged_cases import oracle, paged_batches


def random_mask(args, seed: int, density: float = 0.6) -> torch.Tensor:
    q, _, _, _, kv_lens, _ = args[:6]
    longest = max([int(n) for n in kv_lens] + [0])
    g = torch.Generator().manual_seed(seed)
    return torch.rand(q.shape[0], longest + 3, generator=g) < density  # [Nq, K], K past every sequence


@settings(max_examples=40, deadline=None)
@given(paged_batches(), st.integers(0, 1000), st.sampled_from(["auto", "reference", "tiled"]))
def test_a_paged_call_with_allowed_equals_the_oracle_on_every_path(problem, seed, kernel):
    args, options = problem
    ours = {("alibi_slopes" if name == "alibi" else name): x for name, x in options.items()}
    allowed = random_mask(args, seed)
    out, lse = paged_attention(*args, allowed=allowed, return_lse=True, kernel=kernel, **ours)
    want, want_lse = oracle(*args, allowed=allowed, **options)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))


@settings(max_examples=25, deadline=None)
@given(paged_batches(uniform=True, dtype=torch.float32), st.integers(0, 1000))
def test_a_decode_step_with_allowed_is_read_in_place_and_equals_the_oracle(problem, seed):
    if native_unavailable() is not None:
        pytest.skip(native_unavailable())
    args, options = problem
    ours = {("alibi_slopes" if name == "alibi" else name): x for name, x in options.items()}
    allowed = random_mask(args, seed)
    step = plan_paged(*args, allowed=allowed, cascade=False, **ours)
    assert step.path == "native in place", str(step)
    out = step.run(*args[:3])
    torch.testing.assert_close(out.double(), oracle(*args, allowed=allowed, **options)[0], rtol=1e-5, atol=1e-5)


def mixed_step(seed=0, nan_masked=True):
    """A decode, a prefill of 6 and a decode over pages of 4; every key the mask hides from all queries NaN."""
    g = torch.Generator().manual_seed(seed)
    kv_lens, q_lens, page_size = [9, 6, 13], [1, 6, 1], 4
    owned = [-(-n // page_size) for n in kv_lens]
    table = torch.randperm(sum(owned), generator=g).split(owned)
    table = torch.nn.utils.rnn.pad_sequence(list(table), batch_first=True)
    k_pages, v_pages = (torch.randn(sum(owned), page_size, 2, 8, generator=g) for _ in range(2))
    indptr = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    q = torch.randn(int(indptr[-1]), 4, 8, generator=g)
    allowed = torch.rand(q.shape[0], 13, generator=g) < 0.5
    allowed[3] = False  # a prefill row that sees nothing
    if nan_masked:
        for b in range(3):
            rows = range(int(indptr[b]), int(indptr[b + 1]))
            for j in range(kv_lens[b]):
                if not any(bool(allowed[r, j]) for r in rows):
                    k_pages[table[b, j // page_size], j % page_size] = math.nan
                    v_pages[table[b, j // page_size], j % page_size] = math.nan
    return (q, k_pages, v_pages, table, torch.tensor(kv_lens), indptr), allowed


def test_a_mixed_step_with_allowed_keeps_masked_nan_out_and_gives_a_fully_masked_row_zero():
    args, allowed = mixed_step()
    step = plan_paged(*args, allowed=allowed)
    if native_unavailable() is None:
        assert step.path == "mixed" and "read in place by decode_native" in str(step), str(step)
    out, lse = step.run(*args[:3], return_lse=True)
    want, want_lse = oracle(*args, allowed=allowed)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[3], torch.zeros_like(out[3])) and bool(torch.isneginf(lse[3]).all())
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))


def test_allowed_is_refused_with_what_was_expected_and_given():
    args, allowed = mixed_step(nan_masked=False)
    for bad, text in ((allowed.float(), "bool tensor"), (allowed[:, :5], ">= 13"), (allowed[:-1], "[8, >= 13]"),
                      (allowed[0], "[8, >= 13]")):
        with pytest.raises(ValueError, match="allowed of a paged call must be a bool tensor"):
            paged_attention(*args, allowed=bad)
        with pytest.raises(ValueError, match=text.replace("[", r"\[")):
            paged_attention(*args, allowed=bad)
    with pytest.raises(ValueError, match="cascade=True with allowed, score_mod or key_indices"):
        paged_attention(*args, allowed=allowed, cascade=True)


def test_a_plan_owns_its_mask_and_explain_names_who_computes_it():
    args, allowed = mixed_step(nan_masked=False)
    step = plan_paged(*args, allowed=allowed)
    before = step.run(*args[:3])
    allowed.fill_(True)  # the caller's tensor changed after planning: the plan keeps its own copy
    assert torch.equal(step.run(*args[:3]), before)
    text = engine.explain_paged(*args, allowed=allowed, kernel="flex")
    assert "not flex in place: allowed: not computed by this kernel" in text


def tilt(score, sequence, head, query_pos, key_pos):
    """A score_mod that reads every index it is given, each one against the key (a constant per row would cancel)."""
    return score + 0.02 * (sequence + 1) * key_pos - 0.1 * head * (query_pos - key_pos).abs()


@settings(max_examples=30, deadline=None)
@given(paged_batches(), st.sampled_from(["auto", "reference", "tiled"]), st.booleans())
def test_a_paged_call_with_a_score_mod_equals_the_oracle_on_every_path(problem, kernel, masked):
    args, options = problem
    ours = {("alibi_slopes" if name == "alibi" else name): x for name, x in options.items()}
    allowed = random_mask(args, 7) if masked else None
    out, lse = paged_attention(*args, score_mod=tilt, allowed=allowed, return_lse=True, kernel=kernel, **ours)
    want, want_lse = oracle(*args, score_mod=tilt, allowed=allowed, **options)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    step = plan_paged(*args, score_mod=tilt, **ours)
    assert step.path in ("per sequence", "flex"), str(step)  # the native kernel does not compute a score_mod


def test_a_score_mod_that_is_not_callable_is_refused():
    args, _ = mixed_step(nan_masked=False)
    with pytest.raises(ValueError, match="score_mod must be a callable"):
        paged_attention(*args, score_mod=3.0)
    with pytest.raises(ValueError, match="cascade=True with allowed, score_mod or key_indices"):
        paged_attention(*args, score_mod=tilt, cascade=True)


def test_a_score_mod_and_a_mask_read_by_runs_of_pages_see_each_head_and_key_position(monkeypatch):
    # runs of one page (4 keys): each run its own call, merged by lse; with a score_mod the group's heads stay heads
    import engine.paged.runs as runs
    monkeypatch.setattr(runs, "RUN_KEYS", 4)
    args, allowed = mixed_step(nan_masked=False)
    step = plan_paged(*args, score_mod=tilt, allowed=allowed, kernel="tiled")
    assert "by runs of 4 keys" in str(step), str(step)
    out, lse = step.run(*args[:3], return_lse=True)
    want, want_lse = oracle(*args, score_mod=tilt, allowed=allowed)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    seen = ~torch.isneginf(want_lse)
    torch.testing.assert_close(lse.double()[seen], want_lse[seen], rtol=1e-5, atol=1e-5)
