"""Training: gradients through every kernel equal the reference's (out and lse both differentiable)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import causal_attention
from engine.masks import document_mask, padding_mask, window_mask
from tests.kernel_matrix import FAST


def _case(name):
    pos = torch.arange(150)
    if name == "prefill_gqa":  # T = S = 150, tiles that do not divide T
        return (2, 4, 2, 150, 150, 16, 16), {}
    if name == "chunked_prefill":  # 40 queries after 110 cached keys, MQA
        return (1, 4, 1, 40, 150, 16, 16), {}
    if name == "window":  # window of 20
        return (1, 4, 2, 150, 150, 16, 16), {"allowed": window_mask(pos, pos, 20)}
    if name == "documents":  # documents of 50 tokens
        return (1, 2, 1, 150, 150, 16, 16), {"allowed": document_mask(pos // 50)}
    if name == "padding_with_empty_rows":  # row 0 has no real token at all
        return (2, 4, 2, 150, 150, 16, 16), {"allowed": padding_mask(torch.tensor([0, 77]), 150)}
    if name == "softcap":  # softcap changes the score gradient by 1 - tanh^2
        return (1, 2, 1, 60, 70, 8, 8), {"softcap": 3.0}
    if name == "dv_differs":  # Dv != D
        return (1, 2, 1, 60, 70, 8, 5), {}
    if name == "decode":  # T = 2 against 700 keys: decode hands training to the tiled kernels
        return (2, 4, 2, 2, 700, 16, 16), {}
    raise KeyError(name)


def _grads(kernel, shape, kwargs, dtype=torch.float64, with_lse=True):
    b, hq, hkv, t, s, d, dv = shape
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, hq, t, d, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(b, hkv, s, d, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(b, hkv, s, dv, generator=g, dtype=dtype).requires_grad_()
    out, lse = causal_attention(q, k, v, kernel=kernel, return_lse=True, **kwargs)
    loss = (out * torch.randn(out.shape, generator=g, dtype=dtype)).sum()
    if with_lse:  # rows with lse -inf get weight 0 (their lse has no gradient to give)
        weight = torch.randn(lse.shape, generator=g)
        loss = loss + torch.where(torch.isfinite(lse), lse * weight, 0.0).sum()
    loss.backward()
    return out.detach(), [x.grad for x in (q, k, v)]


@pytest.mark.parametrize("case", ["prefill_gqa", "chunked_prefill", "window", "documents", "padding_with_empty_rows",
                                  "softcap", "dv_differs", "decode"])
@pytest.mark.parametrize("kernel", FAST)
def test_gradients_equal_the_reference_in_float64(kernel, case):
    shape, kwargs = _case(case)
    for with_lse in (False, True):
        _, expected = _grads("reference", shape, kwargs, with_lse=with_lse)
        _, got = _grads(kernel, shape, kwargs, with_lse=with_lse)
        for name, a, e in zip("qkv", got, expected):
            assert a.dtype == e.dtype, name
            torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10, msg=f"d{name} (lse term: {with_lse})")


@pytest.mark.parametrize("kernel", FAST)
def test_rows_that_see_nothing_get_zero_gradients_not_nan(kernel):
    shape, kwargs = _case("padding_with_empty_rows")
    _, (dq, dk, dv) = _grads(kernel, shape, kwargs, dtype=torch.float32)
    assert all(bool(torch.isfinite(x).all()) for x in (dq, dk, dv))
    assert torch.equal(dq[0], torch.zeros_like(dq[0]))  # row 0: no real token
    assert torch.equal(dk[0], torch.zeros_like(dk[0])) and torch.equal(dv[0], torch.zeros_like(dv[0]))
    assert bool((dq[1, :, :77].abs().sum(-1) > 0).all())  # real queries of row 1 do get gradients


@pytest.mark.parametrize("kernel", FAST)
def test_float32_gradients_are_as_accurate_as_the_reference_float32_gradients(kernel):
    # Error against the float64 gradients at most 2x the fp32 reference's own error, plus a floor.
    shape, kwargs = _case("window")
    _, exact = _grads("reference", shape, kwargs)
    _, plain = _grads("reference", shape, kwargs, dtype=torch.float32)
    _, got = _grads(kernel, shape, kwargs, dtype=torch.float32)
    for name, a, p, e in zip("qkv", got, plain, exact):
        err, plain_err = (a.double() - e).abs().max().item(), (p.double() - e).abs().max().item()
        floor = 4 * torch.finfo(torch.float32).eps * max(1.0, e.abs().max().item())
        assert err <= 2 * plain_err + floor, f"d{name}: {err:.3g} > 2 x {plain_err:.3g} + {floor:.3g}"


def test_fused_tile_gradients_match_with_masked_non_finite_values():
    # NaN in keys/values that no query sees: the gradients of everything else equal the clean run's.
    pos = torch.arange(120)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 120, 8, generator=g) for _ in range(3))
    allowed = window_mask(pos, pos, 10)
    grads = []
    for poisoned in (False, True):
        k2, v2 = k.clone(), v.clone()
        if poisoned:
            k2[:, :, 100:110], v2[:, :, 100:110] = float("nan"), float("nan")
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k2, v2))
        causal_attention(qq, kk, vv, allowed=allowed)[:, :, :100].sum().backward()
        grads.append([x.grad for x in (qq, kk, vv)])
    for clean, dirty in zip(*grads):
        assert bool(torch.isfinite(dirty).all())
        torch.testing.assert_close(dirty, clean, rtol=1e-6, atol=1e-6)



def _rounded_grads(run, shape, kwargs, rounded_to, dtype):
    """Gradients of ``run(q, k, v, mask, scale)`` on inputs rounded to ``rounded_to``, then cast to ``dtype``."""
    from engine.inputs import prepare_inputs
    from engine.kernels.visibility import dense_visibility

    b, hq, hkv, t, s, d, dv = shape
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(*size, generator=g).to(rounded_to).to(dtype).requires_grad_()
               for size in ((b, hq, t, d), (b, hkv, s, d), (b, hkv, s, dv)))
    inputs = prepare_inputs(q, k, v, None, None, kwargs.get("allowed"), None)
    mask = dense_visibility(inputs)
    mask = mask if isinstance(mask, torch.Tensor) else mask.to_dense()
    out = run(q, k, v, mask, inputs.scale)
    (out * torch.randn(out.shape, generator=g).to(rounded_to).to(dtype)).sum().backward()
    return [x.grad for x in (q, k, v)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ["prefill_gqa", "chunked_prefill", "window", "documents"])
@pytest.mark.parametrize("kernel", FAST)
def test_low_precision_gradients_are_as_accurate_as_a_plain_run(kernel, case, dtype):
    # bf16/fp16 go to the fused kernels without an fp32 copy: gradients against float64 (on the same rounded
    # inputs) must still be within 2x a plain same-precision run's error, plus a floor (tests/precision.py).
    from tests.precision import plain_attention

    shape, kwargs = _case(case)

    def engine(q, k, v, mask, scale):
        return causal_attention(q, k, v, kernel=kernel, **kwargs)

    def plain(q, k, v, mask, scale):
        return plain_attention(q, k, v, mask, scale, q.dtype)

    exact = _rounded_grads(plain, shape, kwargs, dtype, torch.float64)
    plain_grads = _rounded_grads(plain, shape, kwargs, dtype, dtype)
    got = _rounded_grads(engine, shape, kwargs, dtype, dtype)
    for name, a, p, e in zip("qkv", got, plain_grads, exact):
        assert a.dtype == dtype, name
        err, plain_err = (a.double() - e).abs().max().item(), (p.double() - e).abs().max().item()
        floor = 4 * torch.finfo(dtype).eps * max(1.0, e.abs().max().item())
        assert err <= 2 * plain_err + floor, f"d{name}: {err:.3g} > 2 x {plain_err:.3g} + {floor:.3g}"
