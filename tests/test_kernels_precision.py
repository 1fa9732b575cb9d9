"""Low-precision inputs: each kernel's error against float64 is at most 2x a plain same-precision run's.

The plain run (tests/precision.py) does scores, softmax and the weighted sum all in the input dtype; the
kernels accumulate in fp32, so they must do at least about as well.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention import causal_attention
from engine.inputs import prepare_inputs
from engine.kernels.visibility import dense_visibility
from engine.masks import document_mask, window_mask
from tests.kernel_matrix import FAST
from tests.precision import assert_within_precision, plain_attention

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _case(name):
    pos = torch.arange(260)
    if name == "prefill_gqa":  # T = S = 113, Hq = 4, Hkv = 2
        return (1, 4, 2, 113, 113, 32), {}
    if name == "chunked_prefill":  # 40 queries after 163 cached keys
        return (1, 4, 1, 40, 203, 32), {}
    if name == "window":  # window of 64 over 260 tokens
        return (1, 2, 1, 260, 260, 32), {"allowed": window_mask(pos, pos, 64)}
    if name == "documents":  # documents of 100, 60 and 100 tokens
        return (1, 2, 2, 260, 260, 32), {"allowed": document_mask(pos // 100 + (pos >= 160).long())}
    if name == "decode":  # one query against 1,037 keys, GQA 4:1
        return (2, 8, 2, 1, 1037, 64), {}
    raise KeyError(name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["prefill_gqa", "chunked_prefill", "window", "documents", "decode"])
@pytest.mark.parametrize("kernel", FAST)
def test_low_precision_error_is_at_most_twice_a_plain_run(kernel, case, dtype):
    (b, hq, hkv, t, s, d), kwargs = _case(case)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(b, hq, t, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, s, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, s, d, generator=g).to(dtype)
    oracle = causal_attention(q.double(), k.double(), v.double(), kernel="reference", **kwargs)  # fp64
    inputs = prepare_inputs(q, k, v, None, None, kwargs.get("allowed"), None)
    mask = dense_visibility(inputs)
    if not isinstance(mask, torch.Tensor):
        mask = mask.to_dense()
    plain = plain_attention(q, k, v, mask, inputs.scale, dtype)
    out = causal_attention(q, k, v, kernel=kernel, **kwargs)
    assert out.dtype == dtype
    assert_within_precision(out, oracle, plain, dtype)
