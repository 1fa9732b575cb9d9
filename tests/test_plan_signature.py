"""A plan's signature is whole, and a plan owns what it decided (robustness round 4).

Every part of the tensors a kernel reads (each of q, k, v's kind, shape, dtype and device) is in the one signature
that the plan cache's key and ``AttentionPlan.run`` compare: a reused plan refuses any one of them changed alone,
with a ValueError naming it, and a cached plan is never reused for a call that differs in one. A plan keeps copies
of its positions and mask, so changing them in place afterwards changes no result, whichever kernel it runs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import engine
from engine import causal_attention, window_mask
from engine.planning import plan_for_shapes
from engine.quantized import quantize
from tests.modifier_oracle import oracle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def decode_tensors(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, n, 8, generator=g).to(dtype) for h, n in ((4, 1), (2, 40), (2, 40)))


def changed(tensors, which: str, how: str):
    """q, k, v with one part of one tensor changed: its dtype, its shape, or its kind (a QuantizedKV)."""
    out = dict(zip("qkv", tensors))
    x = out[which]
    if how == "dtype":
        out[which] = x.to(torch.float64 if x.dtype != torch.float64 else torch.float32)
    elif how == "shape":
        out[which] = torch.cat([x, x[..., :1, :]], dim=2) if which == "q" else x[..., :1]  # T + 1, or Dv = 1
    else:
        out[which] = quantize(x, torch.int8)
    return out["q"], out["k"], out["v"]


PARTS = [(which, how) for which in "qkv" for how in ("dtype", "shape", "kind") if (which, how) != ("q", "kind")]


@pytest.mark.parametrize("which, how", PARTS, ids=[f"{w}-{h}" for w, h in PARTS])
def test_a_plan_refuses_each_part_of_each_tensor_changed_alone(which, how):
    tensors = decode_tensors()
    step = engine.plan(*tensors)
    step.run(*tensors)  # one normal run first: what it prepared must not serve other tensors
    other = changed(tensors, which, how)
    assert not step.matches(*other)
    part = {"dtype": "dtype", "shape": "shape", "kind": "kind"}[how]
    with pytest.raises(ValueError, match=f"this plan was made for {which}'s {part}"):
        step.run(*other)
    fresh = engine.plan(*tensors)  # as a plan's first run, too: the ValueError, not torch's own error
    with pytest.raises(ValueError, match=f"this plan was made for {which}'s {part}"):
        fresh.run(*other)


def test_a_plan_refuses_a_quantized_q():
    q, k, v = decode_tensors()
    step = engine.plan(q, k, v)
    assert not step.matches(quantize(q, torch.int8), k, v)
    with pytest.raises(ValueError, match="q must be a torch.Tensor, got QuantizedKV"):
        step.run(quantize(q, torch.int8), k, v)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_a_plan_does_not_match_a_tensor_on_another_device(which):
    tensors = decode_tensors()
    step = engine.plan(*tensors)
    step.run(*tensors)
    other = dict(zip("qkv", tensors))
    other[which] = other[which].to("meta")
    assert not step.matches(other["q"], other["k"], other["v"])  # (running it is checked in a subprocess below)


def test_another_dtype_of_v_or_k_after_a_cached_call_raises_instead_of_reading_its_bytes():
    q, k, v = decode_tensors()
    causal_attention(q, k, v)  # caches the plan of these shapes
    for args in ((q, k, v.half()), (q, k, v.bfloat16()), (q, k.half(), v), (q.double(), k, v)):
        with pytest.raises(ValueError, match="must share one dtype"):
            causal_attention(*args)
    with pytest.raises(ValueError, match="both be QuantizedKV or both tensors"):
        causal_attention(q, k, quantize(v, torch.int8))


def test_a_meta_tensor_after_a_cached_call_or_a_plan_raises_naming_the_device_in_a_fresh_process():
    # a kernel reading a meta tensor's (null) memory would kill the process: the check runs where a crash is seen
    script = ("import torch, engine\n"
              "from engine import causal_attention\n"
              "q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)\n"
              "causal_attention(q, k, v)\n"
              "step = engine.plan(q, k, v)\n"
              "step.run(q, k, v)\n"
              "for i in range(3):\n"
              "    args = [q, k, v]\n"
              "    args[i] = args[i].to('meta')\n"
              "    for call in (causal_attention, step.run):\n"
              "        try:\n"
              "            call(*args)\n"
              "            print('accepted')\n"
              "        except ValueError as error:\n"
              "            print('refused:', error)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    lines = done.stdout.splitlines()
    assert len(lines) == 6 and all(line.startswith("refused:") and "meta" in line for line in lines), lines


KEY_PARTS = {  # one part of the cached plan's key changed alone: (first call's options, second call's options)
    "scale": ({"scale": 0.5}, {"scale": 2.0}),
    "softcap": ({"softcap": 50.0}, {"softcap": 0.5}),
    "causal": ({"causal": True}, {"causal": False}),
}


@pytest.mark.parametrize("part", sorted(KEY_PARTS))
def test_the_plan_cache_never_serves_a_call_that_differs_in_one_key_part(part):
    first, second = KEY_PARTS[part]
    q, k, v = (x.double() for x in decode_tensors(seed=3))
    q = torch.cat([q] * 3, dim=2)  # T = 3: the causal rule matters
    causal_attention(q, k, v, **first)
    got = causal_attention(q, k, v, **second)
    want = oracle(q, k, v, **second)[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_the_plan_cache_keys_the_kernel_and_the_gradient_need():
    q, k, v = decode_tensors()
    auto = plan_for_shapes(q, k, v)
    assert auto.kernel != "reference"  # auto never takes the reference ...
    assert plan_for_shapes(q, k, v, kernel="reference").kernel == "reference"  # ... so a shared key would show
    assert plan_for_shapes(q, k, v, kernel="tiled").kernel == "tiled"
    grad = plan_for_shapes(q.requires_grad_(), k, v)
    assert grad.grad and not auto.grad and grad is not auto


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("change", ["query_positions", "key_positions", "allowed", "window"])
def test_a_plan_owns_its_positions_and_mask_whatever_kernel_runs(dtype, change):
    q, k, v = decode_tensors(seed=5)
    q = torch.cat([q] * 4, dim=2)  # T = 4 decode queries
    qpos, kpos = torch.arange(36, 40, dtype=dtype), torch.arange(40, dtype=dtype)
    allowed = torch.ones(4, 40, dtype=torch.bool)
    mask = window_mask(qpos, kpos, 9) if change == "window" else allowed
    want = oracle(q, k, v, qpos.long(), kpos.long(), mask.clone() if change != "window" else
                  window_mask(qpos.long(), kpos.long(), 9))[0]
    plans = [engine.plan(q, k, v, qpos, kpos, mask, kernel=name) for name in ("auto", "tiled", "reference")]
    for step in plans[:1]:
        step.run(q, k, v)  # one run before the change: what it prepared stays the plan's
    if change == "query_positions":
        qpos -= 20
    elif change == "key_positions":
        kpos += 3
    elif change == "allowed":
        allowed[:, ::2] = False
    else:  # the window mask's own positions (the tensors it was built from)
        qpos -= 5
    for step in plans:
        torch.testing.assert_close(step.run(q, k, v).double(), want, rtol=1e-5, atol=1e-5)


def test_reuse_keys_every_kept_plan_on_its_tensors_whole_and_the_grad_mode():
    # the one key of every kept plan: (context, Signature, grad mode, grad need); never a plan of other tensors
    from engine.planning import Same, reuse
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    store, made = {}, []

    def get(*tensors, context="step", current=None):
        return reuse(store, context, tensors, lambda: made.append(1) or engine.plan(*tensors), current=current)

    first = get(q, k, v)
    assert get(q.clone(), k.clone(), v.clone()) is first and len(made) == 1  # same signature: reused
    for other in [(q.half(), k.half(), v.half()), (q, k, v[..., :4]), (q[:, :, :2], k, v),
                  (q, k[:, :, :4], v[:, :, :4]), (q.requires_grad_(True), k, v)]:
        assert get(*other) is not first  # each part of each tensor, and the gradient need, is in the key
    q.requires_grad_(False)
    with torch.no_grad():
        assert get(q, k, v) is not first
    assert get(q, k, v, context="another") is not first
    assert get(q, k, v, current=lambda plan: False) is not first  # a stale plan is made again
    bias = torch.zeros(1)
    assert Same(bias) == Same(bias) and Same(bias) != Same(torch.zeros(1)) and hash(Same(bias)) == id(bias)
