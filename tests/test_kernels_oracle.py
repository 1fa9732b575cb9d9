"""Every kernel against an independent float64 oracle, at sizes that span several tiles of each kernel.

The oracle is plain dense attention written here, not the engine's reference: float64 scores, the rule
``key_pos <= query_pos`` and the window / document rules written out from positions and ids (not read
from the engine's mask helpers), ``masked_fill(-inf)``, a softmax that leaves rows seeing nothing at 0
with lse ``-inf``, and GQA by ``repeat_interleave``. Its gradients come from float64 autograd.

T is above sdpa_tiles' 256-query tile (and tiled's 128), so dk and dv sum shares of several query tiles
and window / document edges fall inside tiles. The kernels run in fp32 (tolerance: ``assert_near_oracle``).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import pytest
import torch

from engine.attention import causal_attention
from engine.inputs import prepare_inputs
from engine.kernels.sdpa.calls import BLOCK_K, BLOCK_Q, plan_calls
from engine.kernels.sdpa.sdpa_tiles import sdpa_tiles_attention
from engine.masks import document_mask, window_mask

KERNELS = ["reference", "tiled", "sdpa", "sdpa_tiles", "decode"]  # decode with gradients hands off to tiled
# forward: no gradients (the inference paths: decode's split-KV, sdpa_tiles without autograd);
# out: upstream gradient on out only (sdpa_tiles then runs its fused backward span by span);
# out_and_lse: random upstream gradients on out and lse (the backward folds dlse into delta)
MODES = ["forward", "out", "out_and_lse"]


class Case(NamedTuple):
    shape: tuple[int, int, int, int, int, int]  # (B, Hq, Hkv, T, S, D)
    kwargs: dict  # causal_attention's positions and ``allowed`` (built with the engine's mask helpers)
    visible: torch.Tensor  # bool [B, 1, T, S] for the oracle, written out here from the same positions / ids


def oracle_attention(q, k, v, visible, scale):
    """Plain attention in q's dtype: ``(out [B, Hq, T, Dv], lse [B, Hq, T])``, differentiable.

    q ``[B, Hq, T, D]``, k ``[B, Hkv, S, D]``, v ``[B, Hkv, S, Dv]``; visible bool ``[B, 1|Hq, T, S]``.
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [B, Hq, S, D]: query head h reads KV head h // G
    v = v.repeat_interleave(group, dim=1)  # [B, Hq, S, Dv]
    scores = (q @ k.transpose(-2, -1)) * scale  # [B, Hq, T, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    seen = visible.any(dim=-1)  # [B, 1|Hq, T]
    safe = torch.where(seen[..., None], scores, 0.0)  # rows that see nothing: any finite row, zeroed below
    weights = torch.softmax(safe, dim=-1) * seen[..., None]  # [B, Hq, T, S]
    lse = torch.where(seen, torch.logsumexp(safe, dim=-1), float("-inf"))  # [B, Hq, T]
    return weights @ v, lse  # [B, Hq, T, Dv], [B, Hq, T]


def documents(*lengths: int) -> torch.Tensor:
    """Int64 ``[L]`` ids of packed documents: ``documents(2, 3) -> [0, 0, 1, 1, 1]``."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def make_case(shape, qpos=None, kpos=None, window: int | None = None, ids=None, causal: bool = True) -> Case:
    """A case from positions ``[T]|[B, T]``, ``[S]|[B, S]`` (default: chunked prefill), a window or document
    ids ``[L]|[B, L]`` (T == S == L); ``causal=False`` drops the position rule."""
    b, _, _, t, s, _ = shape
    kwargs = {} if qpos is None else {"query_positions": qpos, "key_positions": kpos}
    qpos = torch.arange(s - t, s) if qpos is None else qpos
    kpos = torch.arange(s) if kpos is None else kpos
    qp, kp = qpos.expand(b, t)[:, None, :, None], kpos.expand(b, s)[:, None, None, :]  # [B, 1, T, 1], [B, 1, 1, S]
    visible = kp <= qp  # [B, 1, T, S]
    if not causal:
        kwargs["causal"] = False
        visible = torch.ones_like(visible)
    if window is not None:
        kwargs["allowed"] = window_mask(qpos, kpos, window)
        visible = visible & (qp - kp < window)  # keys p-w+1 .. p
    if ids is not None:
        kwargs["allowed"] = document_mask(ids)
        ids = ids.expand(b, t)  # [B, L]
        visible = visible & (ids[:, None, :, None] == ids[:, None, None, :])
    return Case(shape, kwargs, visible)


def _per_row_positions() -> Case:
    g = torch.Generator().manual_seed(7)
    kpos = torch.stack([torch.arange(420), torch.arange(420) * 2 - 40])  # [B, S]: row 1 gapped, from -40
    qpos = torch.stack([torch.arange(120, 420),  # [B, T]: row 0 plain chunked prefill
                        torch.randint(-80, 800, (300,), generator=g).sort().values])  # 11 queries below -40
    return make_case((2, 2, 1, 300, 420, 8), qpos, kpos)


CASES = {
    # T = S = 520: three query tiles of sdpa_tiles, GQA; sdpa_tiles coalesces it into one causal call
    "prefill": lambda: make_case((1, 4, 2, 520, 520, 8)),
    # 300 queries at positions 320..619 after 320 cached keys: the diagonal cuts tiles off their corners
    "chunked_prefill": lambda: make_case((1, 2, 1, 300, 620, 8)),
    # a window of 100 keys: every query tile shares key tiles with the next one
    "window": lambda: make_case((1, 4, 2, 530, 530, 8), torch.arange(530), torch.arange(530), window=100),
    # documents of 150, 300, 110 tokens: query tiles straddle both boundaries
    "documents": lambda: make_case((1, 2, 1, 560, 560, 8), ids=documents(150, 300, 110)),
    # the same documents without the causal rule (a packed encoder): diagonal tiles that mix documents
    # are masked by the document rule alone
    "documents_bidirectional": lambda: make_case((1, 2, 1, 560, 560, 8), ids=documents(150, 300, 110),
                                                 causal=False),
    # [B, T] / [B, S] positions that differ by row; row 1 has queries that see nothing
    "per_row_positions": _per_row_positions,
    # 12 new tokens against 700 keys, window 300: decode's own fused path without gradients, tiled with them
    "decode": lambda: make_case((2, 4, 2, 12, 700, 8), torch.arange(688, 700), torch.arange(700), window=300),
    # 4 new tokens against 4096 keys, one KV head: decode splits the keys in two chunks merged by lse
    "decode_split_kv": lambda: make_case((1, 2, 1, 4, 4096, 8)),
}


def _tensors(shape, seed: int = 0):
    """fp32 q ``[B, Hq, T, D]``, k, v ``[B, Hkv, S, D]``, and upstream gradients of out and lse."""
    b, hq, hkv, t, s, d = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for h, n in ((hq, t), (hkv, s), (hkv, s)))
    grad_out = torch.randn(b, hq, t, d, generator=g)  # [B, Hq, T, Dv]
    grad_lse = torch.randn(b, hq, t, generator=g)  # [B, Hq, T]; rows with lse -inf must still get 0
    return q, k, v, grad_out, grad_lse


def _run(run, q, k, v, grad_out, grad_lse, mode: str):
    """``[out, lse, dq, dk, dv]`` of ``run(q, k, v) -> (out, lse)`` on leaf copies of q, k, v (``[out, lse]``
    for mode "forward")."""
    if mode == "forward":
        with torch.no_grad():
            return list(run(q, k, v))
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = run(*leaves)
    if mode == "out":  # no gradient reaches lse (sdpa_tiles then runs its fused backward span by span)
        grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    else:
        grads = torch.autograd.grad((out, lse), leaves, (grad_out.to(out.dtype), grad_lse.to(lse.dtype)))
    return [out.detach(), lse.detach(), *grads]


def _oracle(case: Case, mode: str):
    """``(float64 results, plain fp32 results)`` of the oracle, each ``[out, lse, dq, dk, dv]``."""
    q, k, v, grad_out, grad_lse = _tensors(case.shape)
    scale = 1.0 / math.sqrt(case.shape[-1])

    def plain(dtype):
        return _run(lambda *x: oracle_attention(*x, case.visible, scale), *(x.to(dtype) for x in (q, k, v)),
                    grad_out, grad_lse, mode)

    return plain(torch.float64), plain(torch.float32)


@functools.cache
def _expected(name: str, mode: str):
    return _oracle(CASES[name](), mode)


def assert_near_oracle(got, exact, plain, keys: int, what: str) -> None:
    """``got`` (fp32 kernel) against float64 ``exact``: same -inf / NaN pattern, max error at most twice that
    of the plain fp32 run plus ``4 sqrt(S) eps`` (relative to the largest entry, at least 1): the fused
    kernels sum the S keys' fp32 terms in their own order, whose rounding grows like sqrt(S) eps."""
    assert got.shape == exact.shape, (what, got.shape, exact.shape)
    got, plain = got.double(), plain.double()
    finite = torch.isfinite(exact)
    assert torch.equal(torch.isfinite(got), finite), f"{what}: NaN/inf where the oracle has none, or the reverse"
    assert torch.equal(got[~finite], exact[~finite]), f"{what}: non-finite entries differ"  # lse of empty rows
    err = (got - exact)[finite].abs().max().item()
    plain_err = (plain - exact)[finite].abs().max().item()
    floor = 4 * math.sqrt(keys) * torch.finfo(torch.float32).eps * max(1.0, exact[finite].abs().max().item())
    assert err <= 2 * plain_err + floor, f"{what}: error {err:.3g} > 2 x plain fp32 {plain_err:.3g} + {floor:.3g}"


def assert_all_near_oracle(got, expected, keys: int, what: str) -> None:
    exact, plain = expected
    assert len(got) == len(exact)
    for name, a, e, p in zip(["out", "lse", "dq", "dk", "dv"], got, exact, plain):
        assert_near_oracle(a, e, p, keys, f"{what}: {name}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("kernel", KERNELS)
def test_outputs_lse_and_gradients_equal_the_float64_oracle(kernel, name, mode):
    case = CASES[name]()
    q, k, v, grad_out, grad_lse = _tensors(case.shape)

    def engine(q, k, v):
        return causal_attention(q, k, v, kernel=kernel, return_lse=True, **case.kwargs)

    got = _run(engine, q, k, v, grad_out, grad_lse, mode)
    expected = _expected(name, mode)
    if name == "per_row_positions":  # the case holds rows that see nothing: their lse is -inf, gradients 0
        assert bool(torch.isneginf(expected[0][1]).any())
    assert_all_near_oracle(got, expected, case.shape[4], f"{kernel} {name} {mode}")


# sdpa_tiles cases whose consecutive causal query tiles coalesce: (case, block_q, block_k, expected plan_calls
# as [(rows.start, rows.stop, i0, i1, j0, j1, kind), ...] per group).
COALESCED = {
    # T = S = 600: three query tiles become one causal call
    "prefill": lambda: (make_case((1, 2, 1, 600, 600, 8)), BLOCK_Q, BLOCK_K,
                        [[(0, 1, 0, 600, 0, 600, "causal")]]),
    # 384 queries after 256 cached keys: one full span of the cache, one causal square of the new keys
    "chunked_prefill": lambda: (make_case((1, 2, 1, 384, 640, 8)), BLOCK_Q, BLOCK_K,
                                [[(0, 1, 0, 384, 0, 256, "full"), (0, 1, 0, 384, 256, 640, "causal")]]),
    # the same with 16 x 8 tiles: five query tiles, the last one ragged (8 queries)
    "chunked_prefill_small_tiles": lambda: (make_case((1, 4, 2, 72, 104, 8)), 16, 8,
                                            [[(0, 1, 0, 72, 0, 32, "full"), (0, 1, 0, 72, 32, 104, "causal")]]),
    # per-row documents: row 0's 512-token document spans two query tiles, row 1's first one too
    "documents_per_row": lambda: (make_case((2, 2, 1, 868, 868, 8),
                                            ids=torch.stack([documents(256, 512, 100), documents(512, 356)])),
                                  BLOCK_Q, BLOCK_K,
                                  [[(0, 1, 0, 256, 0, 256, "causal")], [(0, 1, 256, 768, 256, 768, "causal")],
                                   [(0, 1, 768, 868, 768, 868, "causal")], [(1, 2, 0, 512, 0, 512, "causal")],
                                   [(1, 2, 512, 868, 512, 868, "causal")]]),
    # documents of 16, 48, 8, 24 tokens in 8 x 4 tiles: the 48-token document is one call over 6 query tiles
    "documents_small_tiles": lambda: (make_case((1, 2, 2, 96, 96, 8), ids=documents(16, 48, 8, 24)), 8, 4,
                                      [[(0, 1, 0, 16, 0, 16, "causal")], [(0, 1, 16, 64, 16, 64, "causal")],
                                       [(0, 1, 64, 72, 64, 72, "causal")], [(0, 1, 72, 96, 72, 96, "causal")]]),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(COALESCED))
def test_coalesced_causal_tiles_plan_as_documented_and_equal_the_oracle(name, mode):
    case, block_q, block_k, expected_plan = COALESCED[name]()
    q, k, v, grad_out, grad_lse = _tensors(case.shape)
    kwargs = case.kwargs

    def inputs(q, k, v):
        return prepare_inputs(q, k, v, kwargs.get("query_positions"), kwargs.get("key_positions"),
                              kwargs.get("allowed"), None, causal=kwargs.get("causal", True))

    plan = [[(call[0].start, call[0].stop, *call[1:]) for call in group]
            for group in plan_calls(inputs(q, k, v), block_q, block_k)]
    assert plan == expected_plan
    assert any(call[3] - call[2] > block_q for group in plan for call in group)  # a call spans several tiles
    got = _run(lambda *x: sdpa_tiles_attention(inputs(*x), True, block_q, block_k), q, k, v, grad_out, grad_lse,
               mode)
    assert_all_near_oracle(got, _oracle(case, mode), case.shape[4], f"sdpa_tiles {name} {mode}")
