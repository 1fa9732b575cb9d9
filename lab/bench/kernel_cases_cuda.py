"""The GPU cases of ``run.py bench kernels --device cuda``: the engine against the best each peer offers there.

Peers, measured in the same run on the same tensors (bf16, D = 128, Hq = 32, Hkv = 8 unless said):

- SDPA with each CUDA backend forced in turn (flash, cuDNN, memory-efficient): the best one is the target's peer;
- FlexAttention called directly (compiled, ``create_block_mask`` from a hand-written ``mask_mod``): its block
  mask build and compile are timed apart (``setup s``), as is the engine's own block-mask build (the row
  ``engine block mask``, its cache cleared each time);
- flash-attn (``flash_attn_func`` / ``flash_attn_varlen_func``) when it is importable, with its own layout
  ``[B, T, H, D]`` prepared outside the timing.

Every timed call ends with ``torch.cuda.synchronize()``, so a row's time is what a caller waits for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention import causal_attention
from lab.bench.kernel_cases import COPY_BYTES, Case, Impl, _auto, causal_pairs, mask_build, window_pairs

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
DEVICE = "cuda"  # a smoke run of these cases elsewhere sets another device
BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def _synced(fn: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    return run


def _qkv(b, t, s, grad=False, hq=HQ, hkv=HKV, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(b, hq, t, D, generator=g, device=DEVICE, dtype=DTYPE)
    k = torch.randn(b, hkv, s, D, generator=g, device=DEVICE, dtype=DTYPE)
    v = torch.randn(b, hkv, s, D, generator=g, device=DEVICE, dtype=DTYPE)
    return tuple(x.requires_grad_(grad) for x in (q, k, v))


def _step(forward: Callable[[], torch.Tensor], leaves, train: bool) -> Callable[[], None]:
    if not train:
        return _synced(forward)

    def step() -> None:
        for x in leaves:
            x.grad = None
        forward().sum().backward()
    return _synced(step)


def _engine(q, k, v, train: bool, kernels=("flex",), **kwargs) -> list[Impl]:
    """The engine as a caller gets it (auto), and forced kernels; a forced kernel's first call (compile) is
    its setup."""
    impls = [Impl(f"engine ({_auto(q, k, v, **kwargs)})",
                  _step(lambda: causal_attention(q, k, v, **kwargs), (q, k, v), train))]
    for name in kernels:
        run = _step(lambda name=name: causal_attention(q, k, v, kernel=name, **kwargs), (q, k, v), train)
        impls.append(Impl(f"engine:{name}", run, setup=run))
    impls.append(mask_build(q, k, v, train, _synced, **kwargs))
    return impls


def _sdpa_backends(q, k, v, train: bool, **kwargs) -> list[Impl]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    impls = []
    for name in BACKENDS:
        backend = getattr(SDPBackend, name)

        def forward(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kwargs)
        run = _step(forward, (q, k, v), train)
        impls.append(Impl(f"sdpa {name.split('_')[0].lower()}", run, "peer", setup=run))
    return impls


def _flex(q, k, v, mask_mod, batch_rows: int | None, train: bool) -> Impl:
    """FlexAttention called directly: block mask from ``mask_mod`` and compile timed apart (setup)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    state: dict[str, Any] = {}

    def forward():
        return state["fn"](q, k, v, block_mask=state["mask"], enable_gqa=q.shape[1] != k.shape[1])

    def setup() -> None:
        state["mask"] = create_block_mask(mask_mod, batch_rows, None, q.shape[2], k.shape[2], device=DEVICE)
        state["fn"] = torch.compile(flex_attention)
        _step(forward, (q, k, v), train)()  # compiles
    return Impl("flex (direct)", _step(forward, (q, k, v), train), "peer", setup)


def _flash_attn(q, k, v, train: bool, **kwargs) -> Impl:
    """flash-attn's own kernel in its layout ``[B, T, H, D]`` (prepared outside the timing), if installed."""
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return Impl("flash-attn", lambda: None, "peer", setup=_missing("flash-attn is not installed"))
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(train) for x in (q, k, v))
    return Impl("flash-attn", _step(lambda: flash_attn_func(qt, kt, vt, **kwargs), (qt, kt, vt), train), "peer")


def _missing(why: str) -> Callable[[], None]:
    def setup() -> None:
        raise ImportError(why)
    return setup


def prefill(t: int, train: bool = False) -> Case:
    """Plain causal prefill (T = S, default positions): the engine runs sdpa_cuda."""
    def build() -> list[Impl]:
        q, k, v = _qkv(1, t, t, grad=train)
        return [*_engine(q, k, v, train), *_sdpa_backends(q, k, v, train, is_causal=True),
                _flex(q, k, v, lambda b, h, i, j: j <= i, None, train), _flash_attn(q, k, v, train, causal=True)]
    flops = 4 * D * HQ * causal_pairs(t) * (3.5 if train else 1.0)
    return Case("training" if train else "prefill", f"causal T={t}", {"T": t, "S": t}, build, flops)


def chunked(t: int, cached: int) -> Case:
    """T new queries after ``cached`` keys (bottom-right causal corner): the engine runs flex."""
    s = cached + t

    def build() -> list[Impl]:
        q, k, v = _qkv(1, t, s)
        return [*_engine(q, k, v, False), _flex(q, k, v, lambda b, h, i, j: j <= i + cached, None, False),
                _flash_attn(q, k, v, False, causal=True)]  # flash-attn aligns T != S bottom-right: the same rule
    flops = 4 * D * HQ * (t * cached + causal_pairs(t))
    return Case("chunked", f"T={t} after {cached}", {"T": t, "S": s}, build, flops)


def windowed(t: int, w: int, train: bool = False) -> Case:
    from engine.masks import window_mask

    def build() -> list[Impl]:
        q, k, v = _qkv(1, t, t, grad=train)
        pos = torch.arange(t, device=DEVICE)
        return [*_engine(q, k, v, train, allowed=window_mask(pos, pos, w)),
                _flex(q, k, v, lambda b, h, i, j: (j <= i) & (i - j < w), None, train),
                _flash_attn(q, k, v, train, causal=True, window_size=(w - 1, 0))]
    flops = 4 * D * HQ * window_pairs(t, w) * (3.5 if train else 1.0)
    return Case("training" if train else "window", f"window {w}, T={t}", {"T": t, "window": w}, build, flops)


def documents(n_docs: int, length: int, train: bool = False) -> Case:
    from engine.masks import document_mask

    t = n_docs * length

    def build() -> list[Impl]:
        q, k, v = _qkv(1, t, t, grad=train)
        ids = torch.arange(t, device=DEVICE) // length
        return [*_engine(q, k, v, train, allowed=document_mask(ids)),
                _flex(q, k, v, lambda b, h, i, j: (ids[i] == ids[j]) & (j <= i), None, train)]
    flops = 4 * D * HQ * n_docs * causal_pairs(length) * (3.5 if train else 1.0)
    return Case("training" if train else "documents", f"{n_docs} docs x {length}, T={t}", {"T": t}, build, flops)


def ragged(t: int, cached: list[int]) -> Case:
    """Rows with their own cache lengths (left padded, per-row positions), T new tokens each."""
    from engine.masks import key_padding_mask, padding_positions

    batch, s = len(cached), max(cached) + t

    def build() -> list[Impl]:
        q, k, v = _qkv(batch, t, s)
        lengths = torch.tensor(cached, device=DEVICE) + t
        positions = padding_positions(lengths, s, "left")  # [B, S]
        valid = torch.arange(s, device=DEVICE)[None, :] >= (s - lengths)[:, None]  # [B, S]
        kwargs = {"query_positions": positions[:, -t:], "key_positions": positions,
                  "allowed": key_padding_mask(lengths, s, "left")}
        mod = lambda b, h, i, j: valid[b, j] & (positions[b, j] <= positions[b, s - t + i])  # noqa: E731
        return [*_engine(q, k, v, False, **kwargs), _flex(q, k, v, mod, batch, False)]
    flops = 4 * D * HQ * sum(t * c + causal_pairs(t) for c in cached)
    return Case("ragged", f"B={batch} rows, T={t} after {cached[0]}..{cached[-1]}", {"T": t, "S": s, "B": batch},
                build, flops)


def decode(batch: int, s: int) -> Case:
    """One new token per row against S cached keys (every key visible): K/V bytes per second."""
    def build() -> list[Impl]:
        q, k, v = _qkv(batch, 1, s)
        impls = [*_engine(q, k, v, False), *_sdpa_backends(q, k, v, False)]
        impls.append(_flex(q, k, v, lambda b, h, i, j: j >= 0, None, False))
        impls.append(_flash_attn(q, k, v, False))
        src = k.reshape(-1)[: COPY_BYTES // k.element_size()]
        dst = torch.empty_like(src)
        impls.append(Impl("copy", _synced(lambda: dst.copy_(src)), "bandwidth",
                          note="copy bandwidth = (bytes read + written) / s"))
        return impls
    kv_bytes = 2.0 * batch * HKV * s * D * 2
    return Case("decode", f"B={batch} S={s}", {"S": s, "B": batch}, build, 4.0 * D * HQ * batch * s, kv_bytes)


def cuda_cases(quick: bool) -> list[Case]:
    """The issue's GPU cases (``quick``: small sizes that check the command end to end in seconds)."""
    if quick:
        return [prefill(1024), chunked(256, 1024), windowed(2048, 256), documents(8, 256), ragged(128, [256, 512]),
                decode(8, 4096), prefill(1024, train=True)]
    cases = [prefill(t) for t in (4096, 8192, 16384, 32768)]  # in order of the targets (--stop-after cuts the end)
    cases += [windowed(32768, 4096), documents(64, 512), chunked(2048, 30720)]
    cases += [ragged(512, [4096 * i for i in range(1, 9)])]  # 8 rows, caches of 4k..32k
    cases += [decode(b, s) for b in (8, 64) for s in (32768, 131072)]
    cases += [prefill(8192, train=True), windowed(16384, 4096, train=True), documents(32, 512, train=True)]
    return cases
