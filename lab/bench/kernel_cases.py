"""The cases of ``run.py bench kernels``: inputs, the implementations run side by side, and useful work.

Each case builds its tensors only when it runs (``build()``) and returns the implementations to time:
the engine (``causal_attention``, kernel chosen automatically), some of its kernels forced, and the
peers: PyTorch SDPA (``is_causal`` where its top-left alignment fits, else the equivalent dense bool
mask), FlexAttention compiled for CPU with a block mask, and the materialising reference.

Useful work counts only visible (query, key) pairs: ``4 * D`` FLOPs per pair forward (``q.k`` and
``p.v``), and 3.5x that for a training step (the backward does 2.5x the forward's matmuls).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention import causal_attention
from engine.inputs import prepare_inputs
from engine.kernels.dispatch import select_kernel
from engine.masks import document_mask, key_padding_mask, padding_positions, window_mask


@dataclass
class Impl:
    """One implementation of a case: ``run()`` is timed; ``setup()`` (compiling) is timed apart."""

    label: str
    run: Callable[[], Any]
    role: str = "engine"  # "engine", "peer", "bandwidth" (a copy), "read" (the K/V bytes read) or "overhead"
    setup: Callable[[], Any] | None = None
    note: str = ""
    kv_bytes: float | None = None  # K/V bytes this implementation reads, when not the case's (a quantized cache)


@dataclass
class Case:
    group: str
    name: str
    params: dict[str, Any]
    build: Callable[[], list[Impl]]
    flops: float  # useful FLOPs per call
    kv_bytes: float = 0.0  # K/V bytes a decode call must read
    notes: list[str] = field(default_factory=list)
    cold: bool = False  # every call after the caches are cleared (lab.measure.evict_caches): operands from memory


COPY_BYTES = 1 << 30  # the copy that measures the machine's bandwidth moves 1 GiB (or K, if smaller)


def _qkv(b, hq, hkv, t, s, d, dtype=torch.float32, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, d, generator=g, dtype=torch.float32).to(dtype)
    k = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float32).to(dtype)
    v = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float32).to(dtype)
    return tuple(x.requires_grad_(grad) for x in (q, k, v))


def _auto(q, k, v, **kwargs) -> str:
    """Which kernel ``kernel="auto"`` runs for these inputs (for the table)."""
    return select_kernel(prepare_inputs(q, k, v, kwargs.get("query_positions"), kwargs.get("key_positions"),
                                        kwargs.get("allowed"), None, causal=kwargs.get("causal", True)))[0]


def _engine_impls(q, k, v, kernels: tuple[str, ...], train: bool = False, **kwargs) -> list[Impl]:
    impls = [Impl(f"engine ({_auto(q, k, v, **kwargs)})", _call(q, k, v, train, "auto", **kwargs))]
    for name in kernels:  # a compiled kernel's first call (its compile) is its setup, timed apart
        call = _call(q, k, v, train, name, **kwargs)
        impls.append(Impl(f"engine:{name}", call, setup=call if name == "flex" else None))
    if "flex" in kernels:
        impls.append(mask_build(q, k, v, train, **kwargs))
    return impls


def _call(q, k, v, train: bool, kernel: str, **kwargs) -> Callable[[], Any]:
    if not train:
        return lambda: causal_attention(q, k, v, kernel=kernel, **kwargs)
    return _train_step(lambda: causal_attention(q, k, v, kernel=kernel, **kwargs), q, k, v)


def _train_step(forward: Callable[[], torch.Tensor], *leaves: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        for x in leaves:
            x.grad = None
        forward().sum().backward()
    return step


def _sdpa(q, k, v, train: bool, **kwargs) -> Callable[[], Any]:
    gqa = q.shape[1] != k.shape[1]
    forward = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **kwargs)  # noqa: E731
    return _train_step(forward, q, k, v) if train else forward


def _flex(q, k, v, mask_mod, batch_rows: int | None, train: bool) -> Impl:
    """FlexAttention compiled for CPU with the block mask of ``mask_mod``; setup = block mask + compile."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    state: dict[str, Any] = {}

    def setup() -> None:
        state["mask"] = create_block_mask(mask_mod, batch_rows, None, q.shape[2], k.shape[2], device="cpu")
        state["fn"] = torch.compile(flex_attention, dynamic=False)
        state["fn"](q, k, v, block_mask=state["mask"], enable_gqa=q.shape[1] != k.shape[1])  # compiles

    forward = lambda: state["fn"](q, k, v, block_mask=state["mask"], enable_gqa=q.shape[1] != k.shape[1])  # noqa: E731
    return Impl("flex (compiled)", _train_step(forward, q, k, v) if train else forward, "peer", setup)


def mask_build(q, k, v, train: bool, wrap: Callable = lambda fn: fn, **kwargs) -> Impl:
    """The engine's conversion of positions and masks to a FlexAttention BlockMask (with the backward's lists when
    training), its cache cleared each time: timed apart from the calls, which find it cached."""
    from engine.kernels.flex.block_mask import clear_block_mask_cache, flex_mask

    inputs = prepare_inputs(q, k, v, kwargs.get("query_positions"), kwargs.get("key_positions"),
                            kwargs.get("allowed"), None, causal=kwargs.get("causal", True))

    def build() -> None:
        clear_block_mask_cache()
        flex_mask(inputs, backward=train)
    return Impl("engine block mask (build)", wrap(build), "overhead")


def _flex_kernel(flex: bool) -> tuple[str, ...]:
    """The engine's flex kernel, forced, in the cases that measure FlexAttention (``--flex``)."""
    return ("flex",) if flex else ()


def _reference(q, k, v, **kwargs) -> Impl:
    return Impl("reference", lambda: causal_attention(q, k, v, kernel="reference", **kwargs), "peer")


def causal_pairs(t: int) -> int:
    return t * (t + 1) // 2


def window_pairs(t: int, w: int) -> int:
    return sum(min(i + 1, w) for i in range(t)) if t < 4 * w else w * (w + 1) // 2 + (t - w) * w


def prefill(t: int, heads: int, d: int, flex: bool, reference: bool, train: bool = False) -> Case:
    """Plain causal prefill, T = S, default positions: SDPA's is_causal fits exactly."""
    def build() -> list[Impl]:
        q, k, v = _qkv(1, heads, heads, t, t, d, grad=train)
        impls = _engine_impls(q, k, v, ("tiled",) if train else ("tiled", "sdpa_tiles", *_flex_kernel(flex)), train)
        impls.append(Impl("sdpa is_causal", _sdpa(q, k, v, train, is_causal=True), "peer"))
        if not train:
            dense = torch.ones(t, t, dtype=torch.bool).tril()
            impls.append(Impl("sdpa dense mask", _sdpa(q, k, v, False, attn_mask=dense), "peer"))
        if flex:
            impls.append(_flex(q, k, v, lambda b, h, i, j: j <= i, None, train))
        if reference:
            impls.append(_reference(q, k, v))
        return impls
    flops = 4 * d * heads * causal_pairs(t) * (3.5 if train else 1.0)
    return Case("training" if train else "prefill", f"causal T={t}", {"T": t, "S": t}, build, flops)


def chunked(t: int, cached: int, heads: int, d: int, flex: bool) -> Case:
    """T new queries after ``cached`` keys, default positions (bottom-right causal corner)."""
    s = cached + t

    def build() -> list[Impl]:
        q, k, v = _qkv(1, heads, heads, t, s, d)
        impls = _engine_impls(q, k, v, ("tiled", *_flex_kernel(flex)))
        dense = torch.arange(s)[None, :] <= torch.arange(cached, s)[:, None]  # [T, S]
        impls.append(Impl("sdpa dense mask", _sdpa(q, k, v, False, attn_mask=dense), "peer"))
        if flex:
            impls.append(_flex(q, k, v, lambda b, h, i, j: j <= i + cached, None, False))
        return impls
    flops = 4 * d * heads * (t * cached + causal_pairs(t))
    return Case("chunked", f"T={t} after {cached}", {"T": t, "S": s}, build, flops)


def ragged(t: int, cached: list[int], heads: int, d: int, flex: bool) -> Case:
    """A batch of rows with their own cache lengths (left padded, per-row positions), T new tokens each."""
    batch, s = len(cached), max(cached) + t
    lengths = torch.tensor(cached) + t  # real tokens per row (cache + new)

    def build() -> list[Impl]:
        q, k, v = _qkv(batch, heads, heads, t, s, d)
        positions = padding_positions(lengths, s, "left")  # [B, S]
        kwargs = {"query_positions": positions[:, -t:], "key_positions": positions,
                  "allowed": key_padding_mask(lengths, s, "left")}
        impls = _engine_impls(q, k, v, ("tiled",), **kwargs)
        valid = torch.arange(s)[None, :] >= (s - lengths)[:, None]  # [B, S]
        dense = valid[:, None, None, :] & (positions[:, None, None, :] <= positions[:, None, -t:, None])
        impls.append(Impl("sdpa dense mask", _sdpa(q, k, v, False, attn_mask=dense), "peer"))
        if flex:
            impls.append(_flex(q, k, v, lambda b, h, i, j: valid[b, j] & (positions[b, j] <= positions[b, s - t + i]),
                               batch, False))
        return impls
    flops = 4 * d * heads * sum(t * c + causal_pairs(t) for c in cached)
    return Case("chunked", f"B={batch} rows, T={t} after {cached[0]}..{cached[-1]}", {"T": t, "S": s, "B": batch},
                build, flops)


def windowed(t: int, w: int, heads: int, d: int, flex: bool, dense_peer: bool, train: bool = False) -> Case:
    """Sliding window of w keys (own included), as a structured mask."""
    def build() -> list[Impl]:
        q, k, v = _qkv(1, heads, heads, t, t, d, grad=train)
        pos = torch.arange(t)
        impls = _engine_impls(q, k, v, ("tiled", *_flex_kernel(flex)), train, allowed=window_mask(pos, pos, w))
        if dense_peer:
            dense = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < w)  # [T, T]
            impls.append(Impl("sdpa dense mask", _sdpa(q, k, v, train, attn_mask=dense), "peer"))
        if flex:
            impls.append(_flex(q, k, v, lambda b, h, i, j: (j <= i) & (i - j < w), None, train))
        return impls
    flops = 4 * d * heads * window_pairs(t, w) * (3.5 if train else 1.0)
    return Case("training" if train else "window", f"window {w}, T={t}", {"T": t, "window": w}, build, flops)


def documents(n_docs: int, length: int, heads: int, d: int, flex: bool, train: bool = False) -> Case:
    """n_docs packed documents of ``length`` tokens each, causal inside each document."""
    t = n_docs * length

    def build() -> list[Impl]:
        q, k, v = _qkv(1, heads, heads, t, t, d, grad=train)
        ids = torch.arange(t) // length
        impls = _engine_impls(q, k, v, ("tiled", *_flex_kernel(flex)), train, allowed=document_mask(ids))
        pos = torch.arange(t)
        dense = (ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None])  # [T, T]
        impls.append(Impl("sdpa dense mask", _sdpa(q, k, v, train, attn_mask=dense), "peer"))
        if flex:
            impls.append(_flex(q, k, v, lambda b, h, i, j: (ids[i] == ids[j]) & (j <= i), None, train))
        return impls
    flops = 4 * d * heads * n_docs * causal_pairs(length) * (3.5 if train else 1.0)
    return Case("training" if train else "documents", f"{n_docs} docs x {length}, T={t}", {"T": t}, build, flops)


def chunked_bf16(t: int, cached: int, heads: int, d: int, train: bool = False) -> Case:
    """Chunked prefill in bf16 (group "bf16", outside the targets): the fused kernel takes bf16 as it is."""
    s = cached + t

    def build() -> list[Impl]:
        q, k, v = _qkv(1, heads, heads, t, s, d, torch.bfloat16, grad=train)
        impls = _engine_impls(q, k, v, (), train)
        dense = torch.arange(s)[None, :] <= torch.arange(cached, s)[:, None]  # [T, S]
        impls.append(Impl("sdpa dense mask", _sdpa(q, k, v, train, attn_mask=dense), "peer"))
        return impls
    flops = 4 * d * heads * (t * cached + causal_pairs(t)) * (3.5 if train else 1.0)
    name = f"{'training ' if train else ''}T={t} after {cached} bfloat16"
    return Case("bf16", name, {"T": t, "S": s, "dtype": "torch.bfloat16"}, build, flops)


def memory(t: int, heads: int, d: int) -> Case:
    """Causal prefill at a length where the reference's scores would not fit (one run, peak memory)."""
    def build() -> list[Impl]:
        q, k, v = _qkv(1, heads, heads, t, t, d)
        return _engine_impls(q, k, v, ("tiled",))
    case = Case("memory", f"causal T={t}", {"T": t}, build, 4 * d * heads * causal_pairs(t))
    case.notes.append(f"the reference would hold {heads * t * t * 4 / 2 ** 30:,.0f} GiB of fp32 scores")
    return case
