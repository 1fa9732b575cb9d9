"""Dispatch: the fastest kernel whose semantics fit, a readable explanation, and no silent slow path."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import engine.kernels.dispatch as dispatch
from engine.attention import causal_attention
from engine.inputs import prepare_inputs
from engine.kernels.dispatch import SlowPathWarning, select_kernel
from engine.masks import key_padding_mask, window_mask
from engine.planning import explain


def rand(b, hq, hkv, t, s, d, dv=None):
    return torch.randn(b, hq, t, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, dv or d)


def chosen(q, k, v, **kwargs):
    return select_kernel(prepare_inputs(q, k, v, kwargs.pop("query_positions", None), None,
                                        kwargs.pop("allowed", None), None, **kwargs))[0]


def test_plain_prefill_runs_torch_sdpa():
    assert chosen(*rand(1, 4, 2, 64, 64, 16)) == "sdpa"


def test_decode_runs_the_native_decode_kernel_unless_gradients_are_needed():
    q, k, v = rand(2, 8, 2, 1, 1024, 16)
    assert chosen(q, k, v) == "decode_native"
    assert chosen(q, k, v, allowed=key_padding_mask(torch.tensor([3, 1024]), 1024)) == "decode_native"
    assert chosen(q.requires_grad_(), k, v) not in ("decode", "decode_native")


def test_without_the_native_kernel_decode_runs_the_torch_decode_kernel_and_explain_says_why(no_native):
    q, k, v = rand(2, 8, 2, 1, 1024, 16)
    assert chosen(q, k, v) == "decode"
    assert chosen(q, k, v, allowed=key_padding_mask(torch.tensor([3, 1024]), 1024)) == "decode"
    assert explain(q, k, v).passed_over["decode_native"] == "native code is turned off (test)"


def test_masks_and_position_offsets_run_the_fused_tiles():
    q, k, v = rand(1, 4, 2, 64, 128, 16)
    assert chosen(q, k, v) == "sdpa_tiles"  # chunked prefill: bottom-right causal is not SDPA's is_causal
    pos = torch.arange(64)
    assert chosen(q[:, :, :, :], k[:, :, :64], v[:, :, :64], allowed=window_mask(pos, pos, 8)) == "sdpa_tiles"


def test_softcap_and_value_dims_run_the_tiled_kernel():
    assert chosen(*rand(1, 4, 2, 64, 64, 16), softcap=30.0) == "tiled"
    assert chosen(*rand(1, 4, 2, 64, 64, 16, 8)) == "tiled"


def test_explain_names_the_kernel_and_why_faster_ones_did_not_fit():
    pos = torch.arange(64)
    choice = explain(*rand(1, 4, 2, 64, 64, 16), allowed=window_mask(pos, pos, 8))
    assert choice.kernel == "sdpa_tiles"
    assert "decode" in choice.passed_over and "sdpa" in choice.passed_over
    assert "mask" in choice.passed_over["sdpa"]
    text = str(choice)
    assert text.startswith("kernel: sdpa_tiles") and "not sdpa:" in text
    forced = explain(*rand(1, 4, 2, 64, 64, 16), kernel="tiled")
    assert forced.kernel == "tiled" and "auto would pick sdpa" in forced.reason
    with pytest.raises(ValueError, match="kernel must be 'auto' or one of"):
        explain(*rand(1, 1, 1, 4, 4, 4), kernel="fastest")


def test_every_choice_is_logged_at_debug_level(caplog):
    q, k, v = rand(1, 2, 1, 8, 8, 4)
    with caplog.at_level(logging.DEBUG, logger="engine.kernels"):
        causal_attention(q, k, v)
    assert any(f"kernel={explain(q, k, v).kernel}" in record.getMessage() for record in caplog.records)


def test_forcing_the_reference_at_a_slow_size_warns(monkeypatch):
    monkeypatch.setattr(dispatch, "SLOW_REFERENCE_SCORES", 1000)
    q, k, v = rand(1, 2, 1, 32, 32, 4)  # 2 * 32 * 32 = 2,048 scores > 1,000
    with pytest.warns(SlowPathWarning, match="materialising reference"):
        causal_attention(q, k, v, kernel="reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto never falls back to the reference
        causal_attention(q, k, v)
        causal_attention(q, k, v, softcap=2.0)


def test_auto_gives_the_same_results_as_the_reference_for_every_choice():
    pos = torch.arange(64)
    for kwargs, shape in (({}, (1, 4, 2, 64, 64, 16)), ({}, (2, 8, 2, 1, 1024, 16)),
                          ({"allowed": window_mask(pos, pos, 8)}, (1, 4, 2, 64, 64, 16)),
                          ({"softcap": 5.0}, (1, 4, 2, 64, 64, 16))):
        q, k, v = rand(*shape)
        torch.testing.assert_close(causal_attention(q, k, v, **kwargs),
                                   causal_attention(q, k, v, kernel="reference", **kwargs), rtol=1e-5, atol=1e-6)


def test_explain_answers_for_empty_queries_or_keys():
    q, k = torch.randn(1, 4, 0, 16), torch.randn(1, 2, 5, 16)
    fast = {"decode_native", "decode", "sdpa", "sdpa_tiles", "tiled"}
    assert explain(q, k, k).kernel in fast
    assert explain(torch.randn(1, 4, 3, 16), k[:, :, :0], k[:, :, :0]).kernel in fast


def test_nan_in_q_found_while_running_goes_straight_to_the_tiled_kernel(caplog):
    # The fused kernels find NaN in q only after running; dispatch then resumes at the kernel that handles it
    # (not at every fused kernel in between), and the NaN stays in its own row.
    q, k, v = rand(1, 4, 2, 1, 1024, 16)
    q[0, 1, 0, 3] = float("nan")
    with caplog.at_level(logging.DEBUG, logger="engine.kernels"):
        out = causal_attention(q, k, v)
    hops = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(hops) == 1 and hops[0].endswith("kernel=tiled")  # from decode_native, straight to tiled
    assert bool(out[0, 1].isnan().all()) and bool(torch.isfinite(out[0, [0, 2, 3]]).all())


def test_no_kernel_runs_a_call_with_an_option_it_does_not_take(monkeypatch):
    """Options (softcap, ...) are checked once, in dispatch: a kernel that does not list an option in its
    ``takes`` never runs a call with it, forced or not, even when its own ``fits`` would accept the call."""
    q, k, v = rand(1, 4, 2, 4, 1024, 16)
    inputs = prepare_inputs(q, k, v, None, None, None, None, softcap=5.0)
    assert inputs.options() == {"softcap"}
    assert prepare_inputs(q, k, v, None, None, None, None).options() == frozenset()
    monkeypatch.setitem(dispatch.KERNELS, "decode", dispatch.KERNELS["decode"]._replace(fits=lambda x: None))
    for name, kernel in dispatch.KERNELS.items():
        choice = explain(q, k, v, softcap=5.0, kernel=name)
        assert "softcap" in dispatch.KERNELS[choice.kernel].takes, (name, choice)
        if "softcap" not in kernel.takes:
            assert choice.passed_over[name] == "softcap: not computed by this kernel"
    out = causal_attention(q, k, v, softcap=5.0, kernel="decode")
    torch.testing.assert_close(out, causal_attention(q, k, v, softcap=5.0, kernel="reference"))
