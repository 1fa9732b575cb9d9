"""Top-k sparse attention (``key_indices``): each query sees only its listed keys, with the position rule and any
mask; the ``sparse`` kernel (only the listed keys gathered) and every other kernel (through the index mask) equal
the float64 oracle built from the definition: a dense mask from the indices."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine import causal_attention, window_mask
from engine.kernels.decode.native_build import native_unavailable


def index_oracle(q, k, v, key_indices, query_positions=None, key_positions=None, allowed=None, softcap=None):
    """float64 ``(out, lse)``, one query and head at a time, from the definition: the listed keys (once each) that
    the rule and ``allowed`` leave."""
    b_, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    qpos = torch.arange(s - t, s) if query_positions is None else query_positions
    kpos = torch.arange(s) if key_positions is None else key_positions
    out = torch.zeros(b_, hq, t, v.shape[3], dtype=torch.float64)
    lse = torch.full((b_, hq, t), -math.inf, dtype=torch.float64)
    for b in range(b_):
        for h in range(hq):
            kv_head = h // (hq // hkv)
            for i in range(t):
                listed = key_indices[b if key_indices.shape[0] > 1 else 0, kv_head if key_indices.shape[1] > 1 else 0,
                                     i].tolist()
                keys = sorted({j for j in listed if j >= 0 and int(kpos[j]) <= int(qpos[i])
                               and (allowed is None or bool(allowed[i, j]))})
                if not keys:
                    continue
                scores = (k[b, kv_head, keys].double() @ q[b, h, i].double()) / math.sqrt(d)
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                lse[b, h, i] = torch.logsumexp(scores, 0)
                out[b, h, i] = torch.softmax(scores, 0) @ v[b, kv_head, keys].double()
    return out, lse


@st.composite
def sparse_calls(draw):
    hkv, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    batch, t, s = draw(st.integers(1, 2)), draw(st.integers(1, 12)), draw(st.integers(1, 40))
    top = draw(st.integers(1, 10))
    per_head = draw(st.booleans()) and hkv > 1
    seed = draw(st.integers(0, 10_000))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hkv * group, t, 8, generator=g, dtype=torch.float64)
    k = torch.randn(batch, hkv, s, 8, generator=g, dtype=torch.float64)
    v = torch.randn(batch, hkv, s, 5, generator=g, dtype=torch.float64)
    indices = torch.randint(-1, s, (batch, hkv if per_head else 1, t, top), generator=g)  # repeats and -1 included
    options = {}
    if draw(st.booleans()):  # positions of their own (a chunk, gaps)
        options["key_positions"] = torch.sort(torch.randint(0, 3 * s, (s,), generator=g)).values
        options["query_positions"] = torch.randint(0, 3 * s, (t,), generator=g)
    if draw(st.booleans()):
        qpos = options.get("query_positions", torch.arange(s - t, s))
        kpos = options.get("key_positions", torch.arange(s))
        options["allowed"] = window_mask(qpos, kpos, draw(st.integers(1, 12)))
    if draw(st.booleans()):
        options["softcap"] = 3.0
    return q, k, v, indices, options


@settings(max_examples=60, deadline=None)
@given(sparse_calls(), st.sampled_from(["sparse", "auto", "tiled", "reference"]))
def test_key_indices_equal_the_oracle_on_every_kernel(call, kernel):
    q, k, v, indices, options = call
    out, lse = causal_attention(q, k, v, key_indices=indices, return_lse=True, kernel=kernel, **options)
    dense_allowed = options.get("allowed")
    want, want_lse = index_oracle(q, k, v, indices, options.get("query_positions"), options.get("key_positions"),
                                  None if dense_allowed is None else dense_allowed.to_dense(), options.get("softcap"))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    assert torch.equal(lse.isneginf(), want_lse.isneginf())
    torch.testing.assert_close(lse[~lse.isneginf()], want_lse[~want_lse.isneginf()], rtol=1e-10, atol=1e-10)


def case(s=600, t=5, top=32, dtype=torch.float32, seed=0, heads=(8, 2)):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads[0], t, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, heads[1], s, 16, generator=g).to(dtype) for _ in range(2))
    indices = torch.randint(0, s, (2, heads[1], t, top), generator=g)
    return q, k, v, indices


def test_auto_takes_the_sparse_kernel_for_few_listed_keys_and_every_key_listed_equals_dense_causal():
    native = "decode_native" if native_unavailable() is None else "sparse"
    q, k, v, indices = case(t=40)  # a prefill (T > 16): the native kernel reads the listed keys in place too
    plan = engine.explain(q, k, v, key_indices=indices)
    assert plan.kernel == native and (native == "sparse" or "only each query's listed keys" in str(plan)), str(plan)
    per_head = torch.rand(2, 8, 40, 600, generator=torch.Generator().manual_seed(1)) < 0.9  # a mask per query head
    plan = engine.explain(q, k, v, key_indices=indices, allowed=per_head)  # not a page table: the sparse kernel
    assert plan.kernel == "sparse", str(plan)
    q, k, v, indices = case()  # a decode step (T = 5): the native kernel reads the listed keys in place
    plan = engine.explain(q, k, v, key_indices=indices)
    assert plan.kernel == native, str(plan)
    everything = torch.arange(600).expand(2, 1, 5, 600)
    torch.testing.assert_close(causal_attention(q, k, v, key_indices=everything, kernel="sparse"),
                               causal_attention(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_nan_in_unlisted_or_hidden_keys_never_leaks_and_a_row_with_no_key_gives_zero(dtype):
    q, k, v, indices = case(s=700, dtype=dtype)  # indices drawn over all 700 keys
    indices[0, 0, 1] = -1  # query 1 of KV head 0 lists nothing
    qpos, kpos = torch.arange(100, 105), torch.arange(700)  # queries at 100..104: every key after them is hidden
    listed = torch.zeros(2, 2, 700, dtype=torch.bool)
    for b in range(2):
        for h in range(2):
            listed[b, h, indices[b, h].flatten().clamp(min=0)] = True
    seen = listed & (kpos <= 100)  # keys some query may see (listed, and at or before position 100)
    k = torch.where(~seen[..., None], float("nan"), k.float()).to(dtype)  # unlisted or hidden: NaN keys,
    v = torch.where(~seen[..., None], float("inf"), v.float()).to(dtype)  # inf values
    out, lse = causal_attention(q, k, v, qpos, kpos, key_indices=indices, return_lse=True, kernel="sparse")
    assert not out.isnan().any() and not out.isinf().any()
    assert torch.equal(out[0, :4, 1], torch.zeros_like(out[0, :4, 1])) and bool(lse[0, :4, 1].isneginf().all())
    want = index_oracle(q.double(), torch.nan_to_num(k.double()), torch.nan_to_num(v.double(), posinf=0.0), indices,
                        qpos, kpos)[0]
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(out.double(), want, rtol=tolerance, atol=tolerance)


def test_gradients_equal_the_reference_on_the_index_mask():
    q, k, v, indices = case(s=300, t=4, top=20, dtype=torch.float64)
    mask = engine.masks.key_indices.key_index_mask(indices, 300, 8)
    grads = []
    for kwargs in (dict(key_indices=indices, kernel="sparse"), dict(allowed=mask.to_dense(), kernel="reference")):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        causal_attention(*leaves, **kwargs).pow(2).sum().backward()
        grads.append([x.grad for x in leaves])
    for mine, want in zip(*grads):
        torch.testing.assert_close(mine, want, rtol=1e-10, atol=1e-10)


def test_bad_key_indices_are_refused_naming_what_was_expected():
    q, k, v, indices = case()
    for bad, text in ((indices.float(), "int32 / int64 tensor"), (indices[0], r"\[B, Hkv\|1, T, K\]"),
                      (indices + 600, r"\[-1, 600\)"), (indices - 2, r"\[-1, 600\)"),
                      (indices[:, :, :3], "T, K"), (indices.expand(2, 2, 5, 32)[:, :1].repeat(1, 3, 1, 1), "1 head")):
        with pytest.raises(ValueError, match=text):
            causal_attention(q, k, v, key_indices=bad)


def test_a_plan_owns_its_key_indices_and_runs_other_layers_and_sinks():
    q, k, v, indices = case()
    step = engine.plan(q, k, v, key_indices=indices, sinks=torch.zeros(8))
    want = step.run(q, k, v)
    indices.fill_(0)  # the caller's tensor changed after planning
    assert torch.equal(step.run(q, k, v), want)
    assert f"sinks: applied to {step.kernel}" in str(step)


def test_a_visible_non_finite_key_or_value_poisons_as_the_reference_does():
    q, k, v, indices = case(s=600, dtype=torch.float64)
    k[0, 0, indices[0, 0, 2, 0]] = float("nan")  # listed (and visible) for query 2 of KV head 0
    v[1, 1, indices[1, 1, 3, 0], 2] = float("inf")
    mask = engine.masks.key_indices.key_index_mask(indices, 600, 8).to_dense()
    out, lse = causal_attention(q, k, v, key_indices=indices, return_lse=True, kernel="sparse")
    want, want_lse = causal_attention(q, k, v, allowed=mask, return_lse=True, kernel="reference")
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10, equal_nan=True)
    assert torch.equal(lse.isneginf(), want_lse.isneginf()) and out.isnan().any()


def test_strided_and_expanded_inputs_give_the_contiguous_result():
    q, k, v, indices = case(s=600, dtype=torch.float64)
    want = causal_attention(q, k, v, key_indices=indices, kernel="sparse")
    k_t = k.transpose(2, 3).contiguous().transpose(2, 3)  # the same values, S as the innermost axis
    v_wide = torch.cat([v, v], dim=-1)[..., :16]  # a strided last-but-one axis
    assert not k_t.is_contiguous() and not v_wide.is_contiguous()
    torch.testing.assert_close(causal_attention(q, k_t, v_wide, key_indices=indices, kernel="sparse"), want,
                               rtol=0, atol=1e-12)
    shared = causal_attention(q, k, v, key_indices=indices[:1, :1].expand(2, 2, 5, 32), kernel="sparse")
    torch.testing.assert_close(shared, causal_attention(q, k, v, key_indices=indices[:1, :1], kernel="sparse"),
                               rtol=0, atol=0)
