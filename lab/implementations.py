"""The implementations a bench compares: every engine kernel, found at run time, and torch's SDPA as the peer.

Each is a function ``(q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv]) -> out [B, Hq, T, Dv]`` with
the engine's causal rule (queries at the last T of the S positions). Kernels are read from
``engine.kernels.dispatch.KERNELS`` when the bench runs, so a kernel added there is measured with no change here.

torch's SDPA aligns ``is_causal`` to the top-left corner, so it matches the engine only for prefill (T = S,
causal) and one-token decode (T = 1: the last query sees every key, no mask needed).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from engine.attention import causal_attention

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
PEER = "torch-sdpa"


def torch_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torch's fused attention under the engine's rule; GQA without copies (``enable_gqa``)."""
    t, s = q.shape[2], k.shape[2]
    if t not in (1, s):
        raise ValueError(f"torch-sdpa is compared only for prefill (T = S) or decode (T = 1), got T={t}, S={s}")
    return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=q.shape[1] != k.shape[1])


def _forced(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str) -> torch.Tensor:
    with warnings.catch_warnings():  # forcing the materialising reference at a large size is the point here
        warnings.filterwarnings("ignore", message=".*materialising reference.*")
        return causal_attention(q, k, v, kernel=kernel)


def available() -> dict[str, Attention]:
    """``{name: fn}``: ``engine:auto`` (what a caller gets), ``engine:<kernel>`` for each registered kernel,
    then the peer."""
    from engine.kernels.dispatch import KERNELS

    impls: dict[str, Attention] = {"engine:auto": causal_attention}
    impls.update({f"engine:{name}": partial(_forced, kernel=name) for name in KERNELS})
    impls[PEER] = torch_sdpa
    return impls


def why_not_fast(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why a forced engine kernel's fast path does not apply to these inputs (then forcing it would time its
    fallback, not the kernel), or None when it applies or the dispatcher states no condition for it."""
    if not name.startswith("engine:") or name == "engine:auto":
        return None
    from engine.inputs import prepare_inputs
    from engine.kernels.dispatch import KERNELS

    kernel = KERNELS.get(name.split(":", 1)[1])
    if kernel is None:
        return None
    return kernel.fits(prepare_inputs(q, k, v, None, None, None, None))


def select(names: str | None, extra: dict[str, Attention] | None = None) -> dict[str, Attention]:
    """The implementations named in a comma list (``None`` or ``"all"``: every one), checked against the registry.

    ``extra`` adds bench-specific implementations (the decode probe of ``bench gqa``).
    """
    impls = {**available(), **(extra or {})}
    if names in (None, "", "all"):
        return impls
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in impls]
    if unknown:
        raise ValueError(f"unknown implementation(s) {', '.join(unknown)}; available: {', '.join(impls)}")
    return {n: impls[n] for n in wanted}


def grouped_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One-token decode that reads each KV head once; equals ``causal_attention`` for T = 1.

    q ``[B, Hq, 1, D]``, k ``[B, Hkv, S, D]``, v ``[B, Hkv, S, Dv]`` -> ``[B, Hq, 1, Dv]`` in q's dtype.
    Query head ``h = kvh * G + g`` reads KV head ``h // G = kvh``: the reshape below groups exactly those heads.
    """
    batch, q_heads, t, d = q.shape
    kv_heads = k.shape[1]
    if t != 1:
        raise ValueError(f"grouped_decode handles one query per head (decode), got T={t}")
    group = q_heads // kv_heads
    qg = q.reshape(batch, kv_heads, group, d)  # [B, Hkv, G, D]
    scores = (qg @ k.transpose(-2, -1)) * d**-0.5  # [B, Hkv, G, S]
    softmax_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    weights = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(v.dtype)  # [B, Hkv, G, S], fp32 softmax
    return (weights @ v).reshape(batch, q_heads, 1, v.shape[-1])  # [B, Hq, 1, Dv]
