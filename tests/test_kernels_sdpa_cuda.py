"""The ``sdpa_cuda`` kernel's own logic, checked on CPU: its fit test, and its call of SDPA (the GQA group folded
into query rows for all-visible calls, ``enable_gqa`` for causal ones) against a float64 oracle written here.
F.scaled_dot_product_attention runs on CPU too, so only the CUDA backends themselves wait for a GPU
(tests/test_kernels_cuda.py)."""

from __future__ import annotations

import math

import pytest
import torch

import engine
from engine.inputs import prepare_inputs
from engine.kernels.cuda.sdpa_cuda import _fused, sdpa_cuda_fits


def oracle(q, k, v, causal_top_left: bool):
    """Dense float64 attention; query head h reads KV head h // G; optional top-left causal (T == S)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)  # [B, Hq, S, D]
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, Hq, T, S]
    if causal_top_left:
        t, s = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(t, s, dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(scores, dim=-1) @ v  # [B, Hq, T, D]


def test_on_cpu_sdpa_cuda_does_not_fit_and_says_why():
    q = torch.randn(1, 4, 8, 16)
    assert "this is the CUDA kernel" in sdpa_cuda_fits(prepare_inputs(q, q[:, :2], q[:, :2], None, None, None, None))
    choice = engine.explain(q, q[:, :2], q[:, :2], kernel="sdpa_cuda")
    assert choice.kernel != "sdpa_cuda" and "this is the CUDA kernel" in choice.passed_over["sdpa_cuda"]


@pytest.mark.parametrize("t", [1, 3])
def test_all_visible_calls_fold_the_group_into_rows(t):
    # Hq = 8, Hkv = 2: rows g*T + i of KV head h are query i of head h*4 + g; decode-like T against 300 keys.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, 16, generator=g) for h, n in ((8, t), (2, 300), (2, 300)))
    inputs = prepare_inputs(q, k, v, None, None, None, None, causal=False)
    out, lse = _fused(inputs, "none", return_lse=False)
    assert lse is None
    torch.testing.assert_close(out.double(), oracle(q, k, v, False), rtol=1e-5, atol=1e-6)


def test_causal_calls_use_enable_gqa():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 90, 16, generator=g) for h in (6, 2, 2))
    inputs = prepare_inputs(q, k, v, None, None, None, None)
    out, _ = _fused(inputs, "causal", return_lse=False)
    torch.testing.assert_close(out.double(), oracle(q, k, v, True), rtol=1e-5, atol=1e-6)
