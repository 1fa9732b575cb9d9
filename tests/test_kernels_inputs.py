"""Valid but unusual inputs through every kernel: any memory layout, scales <= 0, D = 0, fp64 end to end.

Each is checked against an oracle that shares no code with the kernels: the float64 per-query loop, or plain
float64 autograd attention (tests.precision.plain_attention) for gradients.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import engine
from engine import KVCache, causal_attention, window_mask
from engine.kernels.decode.decode import _heads_fold
from engine.kernels.sdpa.fused_op import flash_operands
from engine.reference.loops import per_query_attention
from tests.kernel_matrix import MATRIX
from tests.precision import plain_attention

ALL = sorted(MATRIX)  # flex and sdpa_cuda: tests/kernel_matrix.py says where they are tested


def visible(qpos: torch.Tensor, kpos: torch.Tensor, batch: int, allowed=None) -> torch.Tensor:
    """Bool ``[B, 1|Hq, T, S]``: the position rule written out, ``& allowed``."""
    mask = (kpos[None, None, :] <= qpos[None, :, None]).expand(batch, -1, -1)[:, None]  # [B, 1, T, S]
    return mask if allowed is None else mask & allowed


# --- memory layouts --------------------------------------------------------------------------------


def lay_out(base: torch.Tensor, layout: str, axis: int) -> torch.Tensor:
    """The same values as ``base [4-D]`` in another memory layout (a differentiable function of base).

    "permuted": stored with ``axis`` last in memory, so the last axis is strided (unless ``axis == 3``);
    "sliced": every other entry of a twice-longer ``axis`` (``x[..., ::2]`` when ``axis == 3``);
    "expanded": stride 0 along ``axis`` (base must have size 1 there).
    """
    if layout == "permuted":
        order = [a for a in range(4) if a != axis] + [axis]
        stored = base.permute(order).contiguous()  # axis last in memory
        return stored.permute([order.index(a) for a in range(4)])
    if layout == "sliced":
        wide = torch.repeat_interleave(base, 2, dim=axis)  # [.., 2n, ..]
        return wide[(slice(None),) * axis + (slice(None, None, 2),)]  # entries 0, 2, 4, ...: stride 2
    shape = list(base.shape)
    shape[axis] = 3
    return base.expand(shape)


@st.composite
def layout_cases(draw):
    b, hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    t, s, d = draw(st.integers(1, 9)), draw(st.integers(1, 13)), draw(st.sampled_from([1, 4, 8]))
    layouts = [(draw(st.sampled_from(["contiguous", "permuted", "sliced", "expanded"])), draw(st.integers(0, 3)))
               for _ in range(3)]
    return (b, hkv * group, hkv, t, s, d), layouts, draw(st.integers(0, 2**16))


def _layout_tensors(shape, layouts, seed):
    """Leaves (what gradients land on) and their laid-out views: q, k, v."""
    b, hq, hkv, t, s, d = shape
    full = [(b, hq, t, d), (b, hkv, s, d), (b, hkv, s, d)]
    gen = torch.Generator().manual_seed(seed)
    leaves, views = [], []
    for size, (layout, axis) in zip(full, layouts):
        size = list(size)
        if layout == "expanded":
            size[axis] = 1  # the leaf holds one slice; the view repeats it
        leaf = torch.randn(size, generator=gen, dtype=torch.float64)
        leaves.append(leaf)
        if layout == "expanded":
            target = list(full[len(views)])
            views.append(lambda x, target=target: x.expand(target))
        elif layout == "contiguous":
            views.append(lambda x: x)
        else:
            views.append(lambda x, layout=layout, axis=axis: lay_out(x, layout, axis))
    return leaves, views


@pytest.mark.parametrize("kernel", ALL)
@given(case=layout_cases())
def test_every_layout_gives_the_oracle_forward_and_backward(kernel, case):
    # Transposed, sliced and expanded inputs, along any axis including the last (the fused CPU kernel reads
    # the last axis as contiguous memory: such inputs once gave garbage through sdpa, sdpa_tiles and decode).
    shape, layouts, seed = case
    leaves, views = _layout_tensors(shape, layouts, seed)
    b, hq, hkv, t, s, d = shape
    leaves32 = [x.float().requires_grad_(True) for x in leaves]
    q, k, v = (view(x) for view, x in zip(views, leaves32))
    assert [tuple(x.shape) for x in (q, k, v)] == [(b, hq, t, d), (b, hkv, s, d), (b, hkv, s, d)]
    oracle = per_query_attention(*(x.detach().double() for x in (q, k, v)))
    with torch.no_grad():  # inference takes the fused fast paths (decode among them)
        torch.testing.assert_close(causal_attention(q, k, v, kernel=kernel).double(), oracle, rtol=2e-5, atol=2e-5)
    out = causal_attention(q, k, v, kernel=kernel)
    torch.testing.assert_close(out.double(), oracle, rtol=2e-5, atol=2e-5)

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    out.backward(grad_out)
    leaves64 = [x.requires_grad_(True) for x in leaves]
    mask = visible(torch.arange(s - t, s), torch.arange(s), b)
    plain = plain_attention(*(view(x) for view, x in zip(views, leaves64)), mask, d ** -0.5, torch.float64)
    plain.backward(grad_out.double())
    for name, got, want in zip("qkv", leaves32, leaves64):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-4, msg=f"d{name}")


def test_the_issue_examples_of_strided_last_axes():
    # Each of these once came back wrong from the default kernel (up to 1.7e38 off).
    q, k, v = (torch.randn(1, 1, 4, 8) for _ in range(3))
    cases = [(q.mT.contiguous().mT, k, v), (q, k, torch.randn(1, 1, 4, 16)[..., ::2]),
             (q, torch.randn(1, 1, 4, 1).expand(1, 1, 4, 8), v)]
    for qq, kk, vv in cases:
        oracle = per_query_attention(qq.double(), kk.double(), vv.double())
        for kernel in ["auto", *ALL]:
            torch.testing.assert_close(causal_attention(qq, kk, vv, kernel=kernel).double(), oracle,
                                       rtol=1e-5, atol=1e-5)


def test_common_layouts_reach_the_fused_kernel_without_a_copy():
    # Contiguous, [B, S, H, D] transposed and KV-cache slices keep their storage; a strided last axis is copied.
    bshd = torch.randn(2, 7, 4, 8).transpose(1, 2)  # [B, H, S, D] view of [B, S, H, D]
    cache = torch.randn(2, 4, 32, 8)[:, :, :7]  # the filled part of a longer buffer
    plain = torch.randn(2, 4, 7, 8)
    for x in (bshd, cache, plain):
        assert all(y.data_ptr() == x.data_ptr() for y in flash_operands(x, x, x))
    strided = torch.randn(2, 4, 7, 16)[..., ::2]
    copied = flash_operands(strided, strided, strided)[0]
    assert copied.stride(-1) == 1 and torch.equal(copied, strided)


# --- scales <= 0 -----------------------------------------------------------------------------------

SCALE_CASES = {
    "prefill": (40, 40, None),  # T == S: one fused is_causal call (sdpa)
    "chunked_long": (256, 384, None),  # sdpa_tiles: full keys 0..127, then a causal square 128..383
    "documents": (512, 512, torch.arange(512) // 256),  # sdpa_tiles: each document is one causal square
}


@pytest.mark.parametrize("scale", [0.0, -0.5, -3.0])
@pytest.mark.parametrize("case", sorted(SCALE_CASES))
@pytest.mark.parametrize("kernel", ["auto", *ALL])
def test_zero_and_negative_scales_equal_the_oracle_with_gradients(kernel, case, scale):
    # scale 0 averages the visible values uniformly; a negative scale is a positive one on -q. The fused
    # is_causal path once returned NaN for both.
    t, s, ids = SCALE_CASES[case]
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen, dtype=torch.float64) for n in (t, s, s))
    allowed = None if ids is None else engine.document_mask(ids)
    qpos, kpos = torch.arange(s - t, s), torch.arange(s)
    leaves = [x.float().requires_grad_(True) for x in (q, k, v)]
    out = causal_attention(*leaves, allowed=allowed, scale=scale, kernel=kernel)
    mask = visible(qpos, kpos, 1, None if allowed is None else allowed.to_dense())
    plain = [x.clone().requires_grad_(True) for x in (q, k, v)]
    oracle = plain_attention(*plain, mask, scale, torch.float64)
    torch.testing.assert_close(out.double(), oracle, rtol=2e-5, atol=2e-5)
    with torch.no_grad():
        torch.testing.assert_close(causal_attention(*leaves, allowed=allowed, scale=scale, kernel=kernel).double(),
                                   oracle, rtol=2e-5, atol=2e-5)
    grad_out = torch.randn(out.shape, generator=gen)
    out.backward(grad_out)
    oracle.backward(grad_out.double())
    for name, got, want in zip("qkv", leaves, plain):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-4, msg=f"d{name}")
    if scale == 0.0:  # uniform weights: each output row is the mean of the values it sees
        means = (mask.double() @ v) / mask.sum(-1, keepdim=True)  # [1, 2, T, Dv]
        torch.testing.assert_close(out.double(), means, rtol=2e-5, atol=2e-5)


# --- D = 0 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["auto", *ALL])
def test_an_empty_head_dim_with_a_scale_averages_the_visible_values(kernel):
    # D = 0: every score is 0, so each row is the mean of its visible values and its lse is log(count).
    q, k, v = torch.randn(2, 2, 3, 0), torch.randn(2, 1, 5, 0), torch.randn(2, 1, 5, 4)
    out, lse = causal_attention(q, k, v, scale=1.0, kernel=kernel, return_lse=True)
    counts = torch.arange(3, 6, dtype=torch.float32)  # queries at 2, 3, 4 see 3, 4, 5 keys
    means = v.cumsum(dim=2)[:, :, 2:] / counts[:, None]  # [2, 1, 3, 4]
    torch.testing.assert_close(out, means.expand(2, 2, 3, 4))
    torch.testing.assert_close(lse, counts.log().expand(2, 2, 3))


# --- fp64 stays fp64, the lse included ---------------------------------------------------------------


@pytest.mark.parametrize("kernel", ALL)
def test_gradcheck_through_output_and_lse_in_float64(kernel):
    # The lse is returned in the compute dtype (fp64 here), so finite differences see every digit.
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 3, generator=gen, dtype=torch.float64, requires_grad=True)
               for n in (5, 7, 7))
    allowed = window_mask(torch.arange(2, 7), torch.arange(7), 4)

    def attention(q, k, v):
        return causal_attention(q, k, v, allowed=allowed, kernel=kernel, return_lse=True)

    out, lse = attention(q, k, v)
    assert out.dtype == lse.dtype == torch.float64
    assert torch.autograd.gradcheck(attention, (q, k, v))


def test_the_readme_split_and_merge_is_exact_in_float64():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 8, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 48, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    qpos, kpos = torch.arange(40, 48), torch.arange(48)
    out_a, lse_a = causal_attention(q, k[:, :, :24], v[:, :, :24], qpos, kpos[:24], return_lse=True)
    out_b, lse_b = causal_attention(q, k[:, :, 24:], v[:, :, 24:], qpos, kpos[24:], return_lse=True)
    merged, lse = engine.merge_attention_states([out_a, out_b], [lse_a, lse_b])
    whole, whole_lse = causal_attention(q, k, v, return_lse=True)
    torch.testing.assert_close(merged, whole, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(merged, per_query_attention(q, k, v), rtol=1e-12, atol=1e-12)


# --- decode against a KV-cache view ----------------------------------------------------------------


@pytest.mark.parametrize("masked", [False, True], ids=["positions", "key_padding"])
def test_decode_reads_a_strided_kv_cache_view_split_by_keys(masked, no_native):
    # KVCache.view() is a slice of a longer buffer: decode splits its keys into chunks without a copy
    # (the torch decode kernel: the native one, ahead of it, is off here; test_decode_native covers it).
    batch, q_heads, kv_heads, d, length = 1, 4, 2, 8, 4096
    cache = KVCache(batch, kv_heads, capacity=6144, head_dim=d)
    gen = torch.Generator().manual_seed(3)
    cache.update(torch.randn(batch, kv_heads, length, d, generator=gen),
                 torch.randn(batch, kv_heads, length, d, generator=gen))
    k, v, kpos, _ = cache.view()
    assert not k.is_contiguous() and _heads_fold(k) and _heads_fold(v)  # a view the split can fold
    q = torch.randn(batch, q_heads, 2, d, generator=gen)
    qpos = kpos[:, -2:]
    allowed = (torch.arange(length) % 7 != 0)[None, None, None, :] if masked else None
    out, lse = causal_attention(q, k, v, qpos, kpos, allowed, kernel="decode", return_lse=True)
    assert engine.explain(q, k, v, qpos, kpos, allowed).kernel == "decode"
    oracle = per_query_attention(q.double(), k.double(), v.double(), qpos, kpos,
                                 None if allowed is None else allowed.expand(batch, q_heads, 2, length))
    torch.testing.assert_close(out.double(), oracle, rtol=1e-5, atol=1e-5)
    _, ref_lse = causal_attention(q, k.contiguous(), v.contiguous(), qpos, kpos, allowed, kernel="reference",
                                  return_lse=True)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
