"""Plan once, run many (engine.planning): a plan reused across layers equals fresh calls, refuses tensors it was
not made for, never builds native code while planning or explaining; the layer and the transformers backend plan
once per step; ``import engine`` stays free of the lab's plotting."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import engine
from engine import KVCache, MultiHeadAttention, causal_attention, window_mask
from engine.planning import AttentionPlan
from tests.modifier_oracle import oracle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def layers_of(b, hq, hkv, t, s, d, n, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(b, h, m, d, generator=g, dtype=dtype).requires_grad_(grad)
                  for h, m in ((hq, t), (hkv, s), (hkv, s))) for _ in range(n)]


CASES = {  # (B, Hq, Hkv, T, S, D), positions and mask of the step
    "decode": ((2, 4, 2, 1, 300, 16), None),
    "chunked_window": ((2, 4, 1, 9, 40, 8), "window"),
    "prefill": ((1, 4, 2, 37, 37, 8), None),
    "ragged_rows": ((2, 4, 2, 5, 20, 8), "rows"),
}


def step_arguments(name):
    shape, extra = CASES[name]
    b, _, _, t, s, _ = shape
    qpos = kpos = allowed = None
    if extra == "window":
        allowed = window_mask(torch.arange(s - t, s), torch.arange(s), 6)
    if extra == "rows":  # each row its own positions: row 1 is 7 tokens behind
        kpos = torch.stack([torch.arange(s), torch.arange(s) - 7])  # [B, S]
        qpos = kpos[:, -t:]  # [B, T]
    return shape, qpos, kpos, allowed


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_a_plan_reused_across_layers_equals_fresh_calls_out_lse_and_gradients(name, grad):
    shape, qpos, kpos, allowed = step_arguments(name)
    layers = layers_of(*shape, n=3, grad=grad)
    step = engine.plan(*layers[0], qpos, kpos, allowed)
    for q, k, v in layers:
        out, lse = step.run(q, k, v, return_lse=True)
        want, want_lse = causal_attention(q, k, v, qpos, kpos, allowed, return_lse=True)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
        torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
        oracle_out = oracle(q, k, v, qpos, kpos, allowed)[0]
        torch.testing.assert_close(out, oracle_out, rtol=1e-9, atol=1e-9)
        if grad:
            w = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
            got = torch.autograd.grad((out * w).sum(), (q, k, v))
            expected = torch.autograd.grad((oracle_out * w).sum(), (q, k, v))
            for ours, theirs in zip(got, expected):
                torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)


@given(st.integers(1, 2), st.sampled_from([(2, 1), (4, 2), (3, 3)]), st.integers(1, 20), st.integers(1, 40),
       st.sampled_from(["auto", "tiled", "reference"]), st.integers(0, 100))
def test_property_a_plan_run_on_new_tensors_equals_a_fresh_call(b, heads, t, s, kernel, seed):
    hq, hkv = heads
    first, second = layers_of(b, hq, hkv, t, s, 8, n=2, seed=seed)
    step = engine.plan(*first, kernel=kernel)
    torch.testing.assert_close(step.run(*second), causal_attention(*second, kernel=kernel), rtol=1e-12, atol=1e-12)


def test_a_plan_refuses_tensors_it_was_not_made_for_naming_the_difference():
    q, k, v = layers_of(1, 4, 2, 1, 64, 16, n=1, dtype=torch.float32)[0]
    step = engine.plan(q, k, v)
    with pytest.raises(ValueError, match=r"made for k's shape \[1, 2, 64, 16\], got \[1, 2, 65, 16\]"):
        step.run(q, torch.randn(1, 2, 65, 16), torch.randn(1, 2, 65, 16))
    with pytest.raises(ValueError, match="made for q's dtype torch.float32, got torch.float64"):
        step.run(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="made for q's shape"):
        step.run(q[:, :, :0], k, v)
    with pytest.raises(ValueError, match="made for tensors that do not need gradients"):
        step.run(q.requires_grad_(), k, v)  # its kernel has no backward: a dropped gradient otherwise
    with pytest.raises(ValueError, match="k must be a torch.Tensor, got list"):
        step.run(q.detach(), [1.0], v)
    meta = torch.empty(1, 4, 1, 16, device="meta")
    with pytest.raises(ValueError, match="made for q's device cpu, got meta"):
        step.run(meta, k.to("meta"), v.to("meta"))


def test_print_of_a_plan_names_the_kernel_the_reasons_and_the_shapes():
    q, k, v = layers_of(1, 4, 2, 30, 40, 8, n=1, dtype=torch.float32)[0]  # T = 30: not a decode kernel's
    text = str(engine.plan(q, k, v, allowed=window_mask(torch.arange(10, 40), torch.arange(40), 4)))
    assert text.startswith("kernel: sdpa_tiles") and "  not decode_native: T = 30 queries" in text
    assert "planned for: q [1, 4, 30, 8], k [1, 2, 40, 8], v [1, 2, 40, 8] float32 on cpu" in text


def test_explain_and_plan_never_build_native_code(tmp_path):
    # a fresh process with an empty library cache: choosing decode_native builds nothing; the first run builds it
    script = ("import os, torch, engine\n"
              "q, k = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 600, 64)\n"
              "choice = engine.explain(q, k, k)\n"
              "step = engine.plan(q, k, k)\n"
              "cache = os.environ['ATTENTION_ENGINE_CACHE']\n"
              "print(choice.kernel, step.kernel, len(os.listdir(cache)) if os.path.exists(cache) else 0)\n")
    env = dict(os.environ, ATTENTION_ENGINE_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    kernel, planned, files = done.stdout.split()
    assert files == "0" and kernel == planned  # (decode_native where a compiler is present)


def test_import_engine_imports_neither_matplotlib_nor_the_lab():
    script = ("import sys, engine\n"
              "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib' or m.startswith('lab'))\n"
              "print(bad)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("window", [None, 5])
def test_layers_sharing_one_step_plan_equal_layers_planning_alone(window):
    # a decoder's layers step together: the first plans (positions, masks, kernel), the others reuse it
    torch.manual_seed(0)
    layers = [MultiHeadAttention(32, 4, 2, window=window).double() for _ in range(3)]
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, :3] = False  # row 1 left-padded
    caches = {mode: [layer.new_cache(2, 20) for layer in layers] for mode in ("shared", "alone")}
    for begin, end in ((0, 8), (8, 12)):  # a chunked prefill, then three decode steps
        x = torch.randn(2, end - begin, 32, dtype=torch.float64)
        outs = {}
        for mode in ("shared", "alone"):
            plans = {} if mode == "shared" else None
            h = x
            for layer, cache in zip(layers, caches[mode]):
                h = h + layer(h, cache=cache, valid=valid[:, begin:end], plans=plans)
            outs[mode] = h
        torch.testing.assert_close(outs["shared"], outs["alone"], rtol=0, atol=0)
    for _ in range(3):
        x = torch.randn(2, 1, 32, dtype=torch.float64)
        plans, h, h_alone = {}, x, x
        for layer, shared_cache, own_cache in zip(layers, caches["shared"], caches["alone"]):
            h = h + layer(h, cache=shared_cache, plans=plans)
            h_alone = h_alone + layer(h_alone, cache=own_cache)
        assert sum(isinstance(found, AttentionPlan) for found in plans.values()) == 1  # one plan, three layers
        torch.testing.assert_close(h, h_alone, rtol=0, atol=0)


def test_kv_cache_is_untouched_by_planning():
    cache = KVCache(1, 2, 8, 4)
    layer = MultiHeadAttention(8, 2, 2)
    layer(torch.randn(1, 3, 8), cache=cache, plans={})
    assert cache.length == 3
