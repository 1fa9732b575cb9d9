"""The kernel matrix on CUDA: every case of tests/test_kernels.py through the kernels that run there, against the
float64 reference computed on CPU; ``auto`` picks the CUDA kernels (``explain`` says so); the guarantees hold
(empty rows 0 / -inf, masked NaN never leaks, bf16/fp16 within precision, gradients, natural-log lse).

Marked ``gpu`` (``pytest -m gpu`` runs only these); without a CUDA device every test here is skipped with the
reason shown by ``pytest -rs``. Collected on any machine: nothing touches CUDA at import.
"""

from __future__ import annotations

import pytest
import torch

import engine
from engine import causal_attention, window_mask
from engine.masks import document_mask, key_padding_mask, padding_mask, padding_positions
from tests.precision import assert_within_precision, plain_attention
from tests.test_kernels import CASES, _case, qkv

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU matrix runs where "
                                 "torch.cuda.is_available() (scripts/gpu_check.sh)")]

CUDA_KERNELS = ["auto", "sdpa_cuda", "flex", "tiled"]


def _cuda_case(name: str):
    """``(shape, kwargs on CUDA, kwargs on CPU)`` for a case of the CPU matrix. Structured masks are rebuilt from
    CUDA tensors (the kernels then see tile bounds, not dense tensors); plain tensors are moved."""
    shape, kwargs = _case(name)
    cuda = {key: (value.cuda() if isinstance(value, torch.Tensor) else value) for key, value in kwargs.items()}
    pos300 = torch.arange(300, device="cuda")
    if name == "window":
        cuda["allowed"] = window_mask(pos300, pos300, 37)
    elif name == "window_chunk":
        cuda["allowed"] = window_mask(pos300[-64:], pos300, 50)
    elif name == "documents":
        ids = torch.repeat_interleave(torch.arange(4), torch.tensor([70, 1, 129, 100]))
        cuda["allowed"] = document_mask(ids.cuda())
    elif name == "padding_left":
        lengths = torch.tensor([0, 50, 130], device="cuda")
        positions = padding_positions(lengths, 130, "left")
        cuda.update(allowed=padding_mask(lengths, 130, "left"), query_positions=positions, key_positions=positions)
    elif name == "key_padding_decode":
        cuda["allowed"] = key_padding_mask(torch.tensor([0, 700, 1300], device="cuda"), 1300)
    elif name == "bidirectional":
        cuda["allowed"] = padding_mask(torch.tensor([90, 33], device="cuda"), 90)
    elif name == "composed":
        sink = pos300[None, :] < 16
        cuda["allowed"] = (window_mask(pos300, pos300, 40) | sink) & document_mask(pos300 // 150)
    assert not any(isinstance(x, torch.Tensor) and x.device.type != "cuda" for x in cuda.values())
    return shape, cuda, kwargs


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kernel", CUDA_KERNELS)
def test_cuda_kernels_equal_the_float64_reference(kernel, case):
    shape, cuda_kwargs, cpu_kwargs = _cuda_case(case)
    q, k, v = qkv(*shape)  # float64 on CPU
    ref, ref_lse = causal_attention(q, k, v, kernel="reference", return_lse=True, **cpu_kwargs)
    q32, k32, v32 = (x.float().cuda() for x in (q, k, v))
    out, lse = causal_attention(q32, k32, v32, kernel=kernel, return_lse=True, **cuda_kwargs)
    assert out.device.type == "cuda" and out.dtype == torch.float32
    torch.testing.assert_close(out.double().cpu(), ref, rtol=2e-4, atol=2e-5)
    assert torch.equal(torch.isneginf(lse).cpu(), torch.isneginf(ref_lse))  # -inf exactly at rows that see nothing
    torch.testing.assert_close(lse.double().cpu(), ref_lse, rtol=2e-4, atol=2e-5)  # natural log


def test_auto_picks_the_cuda_kernels_and_explain_names_them():
    q, k, v = (x.cuda() for x in qkv(2, 8, 2, 256, 256, 64, dtype=torch.bfloat16))
    assert engine.explain(q, k, v).kernel == "sdpa_cuda"  # plain prefill: is_causal fits
    assert engine.explain(q[..., :8], k[..., :8], v[..., :8], softcap=30.0).kernel == "tiled"  # D < 16: not Flex
    assert engine.explain(q[:, :, -1:], k, v).kernel == "sdpa_cuda"  # one-token decode: every key visible
    pos = torch.arange(256, device="cuda")
    for kwargs in ({"allowed": window_mask(pos, pos, 64)}, {"softcap": 30.0}):  # a mask; a softcap
        choice = engine.explain(q, k, v, **kwargs)
        assert choice.kernel == "flex" and "FlexAttention" in choice.reason, choice
        assert "sdpa_cuda" in choice.passed_over
    chunk = engine.explain(q[:, :, -16:], k, v)  # chunked prefill: bottom-right causal needs a mask
    assert chunk.kernel == "flex", chunk


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kernel", ["sdpa_cuda", "flex"])
def test_half_precision_is_accumulated_in_fp32(kernel, dtype):
    q, k, v = qkv(2, 8, 2, 300, 300, 64)  # float64 on CPU
    mask = torch.ones(300, 300, dtype=torch.bool).tril()[None, None]
    oracle = plain_attention(q, k, v, mask, 64 ** -0.5, torch.float64)
    plain = plain_attention(q, k, v, mask, 64 ** -0.5, dtype)
    out = causal_attention(*(x.to("cuda", dtype) for x in (q, k, v)), kernel=kernel)
    assert out.dtype == dtype
    assert_within_precision(out.cpu(), oracle, plain, dtype)


@pytest.mark.parametrize("case", ["chunked_prefill", "window", "documents", "padding_left", "softcap"])
def test_flex_gradients_on_cuda_equal_the_reference(case):
    shape, cuda_kwargs, cpu_kwargs = _cuda_case(case)
    shape = (*shape[:5], max(shape[5], 16), max(shape[6], 16))  # Flex's CUDA kernel needs head dims >= 16
    q, k, v = (x.requires_grad_(True) for x in qkv(*shape))
    ref = causal_attention(q, k, v, kernel="reference", **cpu_kwargs)
    expected = torch.autograd.grad(ref.square().sum(), (q, k, v))
    leaves = [x.detach().float().cuda().requires_grad_(True) for x in (q, k, v)]
    assert engine.explain(*leaves, kernel="flex", **cuda_kwargs).kernel == "flex"  # Flex trains on CUDA
    out = causal_attention(*leaves, kernel="flex", **cuda_kwargs)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("kernel", ["flex", "sdpa_cuda", "auto"])
def test_masked_nan_never_leaks_on_cuda(kernel):
    pos = torch.arange(220, device="cuda")
    q, k, v = (x.float().cuda() for x in qkv(1, 4, 2, 220, 220, 16))
    allowed = window_mask(pos, pos, 20) if kernel != "sdpa_cuda" else None
    clean = causal_attention(q, k, v, allowed=allowed, kernel=kernel)
    k[:, :, 200:, 3], v[:, :, 200:, 5] = float("nan"), float("inf")  # the last 20 keys: seen by rows >= 200 only
    out = causal_attention(q, k, v, allowed=allowed, kernel=kernel)
    assert torch.equal(out[:, :, :200], clean[:, :, :200])
    assert bool(torch.isnan(out[:, :, 200:]).all())


def test_a_decode_loop_compiles_flex_at_most_twice():
    # Growing caches: the first shape compiles a static kernel, the second a dynamic-shape one for the rest.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    q, k, v = (x.cuda() for x in qkv(2, 8, 2, 1, 1100, 64, dtype=torch.bfloat16))
    for length in range(1000, 1008):
        kpos = torch.arange(length, device="cuda")
        out = causal_attention(q, k[:, :, :length], v[:, :, :length], torch.tensor([length - 1], device="cuda"), kpos,
                               allowed=window_mask(torch.tensor([length - 1], device="cuda"), kpos, 512),
                               kernel="flex")
        assert out.shape == (2, 8, 1, 64)
    assert counters["stats"]["unique_graphs"] - graphs <= 2


def test_sdpa_cuda_reads_a_kv_cache_view_without_a_copy():
    cache_k = torch.randn(2, 2, 4096, 64, device="cuda", dtype=torch.bfloat16)
    cache_v = torch.randn_like(cache_k)
    k, v = cache_k[:, :, :1000], cache_v[:, :, :1000]  # strided views of the cache buffers
    q = torch.randn(2, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
    assert engine.explain(q, k, v).kernel == "sdpa_cuda"
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = causal_attention(q, k, v)
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < k.numel() * k.element_size()  # far less than one copy of K
    torch.testing.assert_close(out, causal_attention(q, k.contiguous(), v.contiguous(), kernel="tiled"),
                               rtol=2e-2, atol=2e-2)
