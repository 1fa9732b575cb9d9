"""The ``flex`` kernel on CPU against a float64 oracle written here, and its BlockMask against the dense mask.

On CPU, Flex compiles inference in fp32/bf16/fp16; a call asking for the lse, or in fp64, runs Flex's unfused
implementation with the same ``mask_mod`` and ``score_mod``; Flex has no CPU backward, so training hands over
to the next kernel (tested below). The compiled cases are few on purpose: each costs one compile (~6 s).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

import engine
from engine import causal_attention
from engine.kernels.flex.block_mask import block_mask_cache_info, clear_block_mask_cache, structured_block_mask
from engine.masks import (
    causal_mask,
    document_mask,
    key_padding_mask,
    padding_mask,
    padding_positions,
    window_mask,
)
from engine.masks.structured import as_structured


def qkv(b, hq, hkv, t, s, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, t, d, generator=g, dtype=dtype), torch.randn(b, hkv, s, d, generator=g, dtype=dtype),
            torch.randn(b, hkv, s, d, generator=g, dtype=dtype))


def oracle(q, k, v, visible, scale=None, softcap=None):
    """Dense float64 attention over an explicit bool ``visible [B, 1|Hq, T, S]``: ``(out, lse)``; rows that see
    nothing give 0 and -inf. Query head h reads KV head h // G."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)  # [B, Hq, S, *]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q.double() @ k.transpose(-1, -2) * scale  # [B, Hq, T, S]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, T]
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # rows with lse -inf: 0
    return weights @ v, lse


def _rule(qpos, kpos):
    """``key_pos <= query_pos`` written out: ``[B, 1, T, S]`` from ``[B, T]`` and ``[B, S]``."""
    return kpos[:, None, None, :] <= qpos[:, None, :, None]


def case(name):
    """``(shape (B, Hq, Hkv, T, S, D), causal_attention kwargs, visible [B, 1|Hq, T, S] built here)``."""
    if name == "causal":  # plain prefill, GQA: the rule is top-left causal on indices
        t = 150
        pos = torch.arange(t).expand(1, t)
        return (1, 4, 2, t, t, 16), {}, _rule(pos, pos)
    if name == "chunked_prefill":  # 37 queries after 166 cached keys (bottom-right corner)
        qpos, kpos = torch.arange(166, 203).expand(2, -1), torch.arange(203).expand(2, -1)
        return (2, 4, 2, 37, 203, 16), {}, _rule(qpos, kpos)
    if name == "per_row_positions":  # each row its own rising positions with gaps; row 2's first queries see none
        g = torch.Generator().manual_seed(1)
        kpos = torch.randint(1, 4, (3, 140), generator=g).cumsum(-1)  # [3, 140]
        qpos = kpos[:, -40:].clone()
        qpos[2, :5] = 0  # before every key: rows that see nothing
        return (3, 4, 2, 40, 140, 8), {"query_positions": qpos, "key_positions": kpos}, _rule(qpos, kpos)
    if name == "window":  # 37 keys, own included
        pos = torch.arange(300)
        near = (pos[:, None] - pos[None, :] < 37)[None, None]
        return (1, 4, 2, 300, 300, 16), {"allowed": window_mask(pos, pos, 37)}, _rule(pos[None], pos[None]) & near
    if name == "documents":  # packed documents of 70, 1, 129 and 100 tokens
        ids = torch.repeat_interleave(torch.arange(4), torch.tensor([70, 1, 129, 100]))
        pos = torch.arange(300)[None]
        same = (ids[:, None] == ids[None, :])[None, None]
        return (1, 4, 4, 300, 300, 16), {"allowed": document_mask(ids)}, _rule(pos, pos) & same
    if name == "padding":  # left padding to 130 of rows 0 (nothing), 50 and 130 tokens, positions from 0
        lengths = torch.tensor([0, 50, 130])
        pos = padding_positions(lengths, 130, "left")  # [3, 130]
        valid = torch.arange(130)[None, :] >= (130 - lengths)[:, None]  # [3, 130]
        kwargs = {"allowed": padding_mask(lengths, 130, "left"), "query_positions": pos, "key_positions": pos}
        return (3, 2, 1, 130, 130, 8), kwargs, _rule(pos, pos) & (valid[:, None, :, None] & valid[:, None, None, :])
    if name == "key_padding_decode":  # one query per row against caches of 0, 100 and 300 real keys
        lengths = torch.tensor([0, 100, 300])
        valid = torch.arange(300)[None, :] < lengths[:, None]  # [3, 300]
        return (3, 8, 2, 1, 300, 16), {"allowed": key_padding_mask(lengths, 300)}, valid[:, None, None, :]
    if name == "softcap":  # chunked prefill with scores capped by 5 * tanh(s / 5)
        qpos, kpos = torch.arange(70, 100)[None], torch.arange(100)[None]
        return (1, 4, 2, 30, 100, 16), {"softcap": 5.0}, _rule(qpos, kpos)
    if name == "mqa_cross":  # causal=False, every query head reads the one KV head
        return (2, 6, 1, 33, 140, 16), {"causal": False}, torch.ones(1, 1, 33, 140, dtype=torch.bool)
    if name == "empty_rows":  # a dense mask that hides every key from rows 10..19
        allowed = torch.ones(80, 80, dtype=torch.bool)
        allowed[10:20] = False
        pos = torch.arange(80)[None]
        return (1, 2, 1, 80, 80, 8), {"allowed": allowed}, _rule(pos, pos) & allowed
    if name == "dense_per_head":  # a random mask that differs per batch row and head
        g = torch.Generator().manual_seed(3)
        allowed = torch.rand(2, 4, 77, 150, generator=g) < 0.3
        qpos, kpos = torch.arange(73, 150).expand(2, -1), torch.arange(150).expand(2, -1)
        return (2, 4, 2, 77, 150, 8), {"allowed": allowed}, _rule(qpos, kpos) & allowed
    if name == "composed_softcap":  # the composed mask with a softcap of 5: mask_mod and score_mod in one kernel
        shape, kwargs, visible = case("composed")
        return shape, {**kwargs, "softcap": 5.0}, visible
    if name == "composed":  # (window 40 | first 16 keys) & two documents of 150
        pos = torch.arange(300)
        ids = pos // 150
        sink = pos[None, :] < 16
        allowed = (window_mask(pos, pos, 40) | sink) & document_mask(ids)
        near = (pos[:, None] - pos[None, :] < 40) & (pos[None, :] <= pos[:, None])
        dense = (near | sink) & (ids[:, None] == ids[None, :])
        return (1, 4, 2, 300, 300, 8), {"allowed": allowed}, (_rule(pos[None], pos[None]) & dense[None, None])
    raise KeyError(name)


CASES = ["causal", "chunked_prefill", "per_row_positions", "window", "documents", "padding", "key_padding_decode",
         "softcap", "mqa_cross", "empty_rows", "dense_per_head", "composed", "composed_softcap"]


@pytest.mark.parametrize("name", CASES)
def test_flex_output_and_lse_equal_the_float64_oracle(name):
    # fp64 with the lse: Flex's unfused implementation, driven by the kernel's own mask_mod and score_mod.
    shape, kwargs, visible = case(name)
    q, k, v = qkv(*shape)
    expected, expected_lse = oracle(q, k, v, visible, softcap=kwargs.get("softcap"))
    out, lse = causal_attention(q, k, v, kernel="flex", return_lse=True, **kwargs)
    assert "forced by kernel='flex'" in engine.explain(q, k, v, kernel="flex", **kwargs).reason
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expected_lse))  # -inf exactly at rows that see nothing
    torch.testing.assert_close(lse, expected_lse, rtol=1e-12, atol=1e-12)  # natural log, as the engine's


# One compile each (~6-20 s on a cold cache): top-left causal on indices; per-row positions, padding and rows that
# see nothing; composed families with a softcap (mask_mod and score_mod). The rest runs through the same mask_mod
# unfused (above).
COMPILED = ["causal", "padding", "composed_softcap"]


@pytest.fixture(scope="module")
def fresh_compiler():
    """Compiled kernels from earlier tests count against torch.compile's limit (8 per function, then it runs
    Flex unfused): start this module's compiled cases from an empty cache so they test the compiled kernel."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPILED)
def test_compiled_flex_equals_the_oracle_and_a_second_call_does_not_recompile(name, fresh_compiler):
    from torch._dynamo.utils import counters

    shape, kwargs, visible = case(name)
    q, k, v = qkv(*shape, dtype=torch.float32)
    expected, _ = oracle(q, k, v, visible, softcap=kwargs.get("softcap"))
    graphs = counters["stats"]["unique_graphs"]
    out = causal_attention(q, k, v, kernel="flex", **kwargs)  # inference without lse: the compiled kernel
    graphs_after = counters["stats"]["unique_graphs"]
    assert graphs_after > graphs  # compiled, not unfused
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-6)
    empty = ~visible.any(dim=-1).expand(out.shape[:3])  # [B, Hq, T] rows that see nothing
    assert bool((out[empty] == 0).all())
    # The next call of a loop (new tensors, new position tensors of equal values) reuses kernel and block mask.
    hits = block_mask_cache_info()["hits"]
    again = causal_attention(*(x.clone() for x in (q, k, v)), kernel="flex",
                             **{key: (x.clone() if isinstance(x, torch.Tensor) else x) for key, x in kwargs.items()})
    assert counters["stats"]["unique_graphs"] == graphs_after
    assert torch.equal(again, out)
    assert block_mask_cache_info()["hits"] == hits + 1


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_masked_keys_and_values_never_leak(poison):
    # Keys 150..199 hold NaN/inf; a window of 20 keeps them from rows < 150, which equal the clean run bit for bit.
    pos = torch.arange(220)
    q, k, v = qkv(1, 4, 2, 220, 220, 16)
    allowed = window_mask(pos, pos, 20)
    clean = causal_attention(q, k, v, allowed=allowed, kernel="flex")
    k[:, :, 150:200, 3], v[:, :, 150:200, 5] = poison, poison
    out, lse = causal_attention(q, k, v, allowed=allowed, kernel="flex", return_lse=True)
    assert torch.equal(out[:, :, :150], clean[:, :, :150])
    assert bool(torch.isnan(out[:, :, 150:219]).all())  # a visible poisoned key poisons its row
    assert bool(torch.isneginf(lse[:, :, 150:219]).all()) and bool(torch.isfinite(lse[:, :, 219:]).all())
    expected, _ = oracle(q[:, :, 219:], k[:, :, 200:], v[:, :, 200:], torch.ones(1, 1, 1, 20, dtype=torch.bool))
    torch.testing.assert_close(out[:, :, 219:], expected, rtol=1e-10, atol=1e-12)  # sees keys 200..219 only


def test_training_on_cpu_hands_over_to_the_next_kernel_with_the_reason():
    # Flex has no CPU backward (torch 2.13): a forced flex call that needs gradients runs the next exact kernel,
    # and explain says why; the gradients equal the oracle's.
    shape, kwargs, visible = case("window")
    q, k, v = (x.requires_grad_(True) for x in qkv(*shape))
    choice = engine.explain(q, k, v, kernel="flex", **kwargs)
    assert choice.kernel == "tiled" and "no CPU backward" in choice.passed_over["flex"]
    out = causal_attention(q, k, v, kernel="flex", **kwargs)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = oracle(q, k, v, visible)[0]
    torch.testing.assert_close(grads, torch.autograd.grad(expected.square().sum(), (q, k, v)), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("return_lse", [True, False], ids=["unfused_lse", "unfused_fp64"])
def test_under_no_grad_leaves_that_require_grad_run_flex(return_lse):
    # no backward is coming under no_grad, so the leaves' requires_grad must not reach Flex (which refused them on
    # CPU as if one were: "FlexAttention does not support backward on CPU"); fp64 runs the unfused path, no compile
    shape, kwargs, visible = case("window")
    q, k, v = (x.requires_grad_(True) for x in qkv(*shape))
    with torch.no_grad():
        assert engine.explain(q, k, v, kernel="flex", **kwargs).kernel == "flex"
        result = causal_attention(q, k, v, kernel="flex", return_lse=return_lse, **kwargs)
    out = result[0] if return_lse else result
    torch.testing.assert_close(out, oracle(q.detach(), k.detach(), v.detach(), visible)[0], rtol=1e-10, atol=1e-12)
    assert not out.requires_grad


def test_auto_never_takes_flex_on_cpu_and_says_why():
    # Softcap: the CPU's fused kernels do not take it, so auto reaches flex, passes it over, and runs tiled.
    shape, kwargs, _ = case("softcap")
    q, k, v = qkv(*shape, dtype=torch.float32)
    choice = engine.explain(q, k, v, **kwargs)
    assert choice.kernel == "tiled" and "flex runs when forced" in choice.passed_over["flex"]


def test_block_masks_are_cached_by_content_and_keep_their_own_copy_of_the_values():
    clear_block_mask_cache()
    q, k, v = qkv(2, 2, 1, 40, 140, 8)
    qpos, kpos = torch.arange(100, 140).expand(2, -1).clone(), torch.arange(140).expand(2, -1).clone()
    first = causal_attention(q, k, v, qpos, kpos, kernel="flex", return_lse=True)
    assert block_mask_cache_info() == {"hits": 0, "builds": 1, "size": 1}
    causal_attention(q, k, v, qpos.clone(), kpos.clone(), kernel="flex", return_lse=True)  # equal values: a hit
    assert block_mask_cache_info()["hits"] == 1
    qpos[1] -= 60  # the caller changes its tensor in place: a new mask, and the cached one still holds the old
    moved = causal_attention(q, k, v, qpos, kpos, kernel="flex", return_lse=True)
    assert block_mask_cache_info()["builds"] == 2
    expected, _ = oracle(q, k, v, _rule(qpos, kpos))
    torch.testing.assert_close(moved[0], expected, rtol=1e-10, atol=1e-12)
    again = causal_attention(q, k, v, torch.arange(100, 140), torch.arange(140), kernel="flex", return_lse=True)
    assert block_mask_cache_info()["hits"] == 2 and torch.equal(again[0], first[0])


# --- the BlockMask is the dense mask it describes ----------------------------------------------------------


@st.composite
def structured_masks(draw):
    """A structured mask over ``[B, 1|Hq, T, S]`` of any family, possibly composed with &, | and ~."""
    batch, t, s = draw(st.integers(1, 3)), draw(st.integers(1, 40)), draw(st.integers(1, 40))
    kpos = torch.tensor(draw(st.lists(st.integers(0, 3), min_size=s, max_size=s))).cumsum(0)  # rising, repeats
    kpos = kpos.expand(batch, s) if draw(st.booleans()) else kpos + torch.arange(batch)[:, None] * 5
    qpos = torch.tensor(draw(st.lists(st.integers(-5, 130), min_size=t, max_size=t)))
    if draw(st.booleans()):  # consecutive positions: mask_mod computes them from the index instead of reading
        qpos, kpos = torch.arange(s - t, s), torch.arange(s) if draw(st.booleans()) else kpos
    ids_k = torch.tensor(sorted(draw(st.lists(st.integers(0, 4), min_size=s, max_size=s))))
    ids_q = torch.tensor(sorted(draw(st.lists(st.integers(0, 4), min_size=t, max_size=t))))
    lengths = torch.tensor(draw(st.lists(st.integers(0, s), min_size=batch, max_size=batch)))
    heads = draw(st.sampled_from([1, 2]))
    dense = torch.rand(batch, heads, t, s, generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))) < 0.5
    families = {
        "causal": lambda: causal_mask(qpos.expand(batch, t), kpos),
        "window": lambda: window_mask(qpos.expand(batch, t), kpos, draw(st.integers(1, 20))),
        "documents": lambda: document_mask(ids_q, ids_k),
        "key_padding": lambda: key_padding_mask(lengths, s, draw(st.sampled_from(["left", "right"]))),
        "dense": lambda: dense,
    }
    mask = families[draw(st.sampled_from(sorted(families)))]()
    for _ in range(draw(st.integers(0, 2))):
        other = families[draw(st.sampled_from(sorted(families)))]()
        mask = draw(st.sampled_from([lambda a, b: a & b, lambda a, b: a | b, lambda a, b: ~a & b]))(
            as_structured(mask), other)
    return as_structured(mask), batch, heads, t, s


def _listed(num: torch.Tensor, indices: torch.Tensor, nk: int) -> torch.Tensor:
    """The key blocks each query block lists: bool ``[B, H, nq, nk]`` from a BlockMask's count and indices."""
    rank = torch.arange(indices.shape[-1])
    chosen = torch.zeros(*num.shape, nk, dtype=torch.bool)
    chosen.scatter_(-1, indices.long(), rank < num[..., None])
    return chosen


@given(drawn=structured_masks(), block=st.sampled_from([4, 8, 16]))
def test_the_block_mask_of_any_structured_mask_is_the_dense_mask(drawn, block):
    mask, batch, heads, t, s = drawn
    dense = mask.to_dense()
    dense = dense.reshape((1,) * (4 - dense.dim()) + tuple(dense.shape)).expand(batch, heads, t, s)  # [B, H, T, S]
    block_mask = structured_block_mask(mask, batch, t, s, block)
    nq, nk = -(-t // block), -(-s // block)
    partial = _listed(block_mask.kv_num_blocks, block_mask.kv_indices, nk)  # [B|1, 1, nq, nk]
    full = _listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nk)
    assert not bool((partial & full).any())  # a block is in one list at most
    padded = torch.zeros(batch, heads, nq * block, nk * block, dtype=torch.bool)
    padded[:, :, :t, :s] = dense
    blocks = padded.view(batch, heads, nq, block, nk, block)
    valid = torch.zeros(nq * block, nk * block, dtype=torch.bool)
    valid[:t, :s] = True
    valid = valid.view(nq, block, nk, block)  # entries inside T x S (the last blocks may stick out)
    any_true = blocks.any(dim=(3, 5)).any(dim=1, keepdim=True)  # [B, 1, nq, nk], over heads
    all_true = (blocks | ~valid).all(dim=(3, 5)).all(dim=1, keepdim=True)  # [B, 1, nq, nk]
    skipped = ~(partial | full)
    assert not bool((skipped & any_true).any())  # skipped blocks are truly empty
    assert not bool((full & ~all_true).any())  # full blocks are truly full
    # Partial blocks: the mask_mod, evaluated everywhere, is the dense mask (so also inside each partial block).
    evaluated = create_mask(block_mask.mask_mod, batch, heads, t, s, device="cpu")  # [B, H, T, S]
    assert torch.equal(evaluated, dense)
