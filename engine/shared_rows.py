"""Shared K/V rows: V given as the first Dv columns of K's own rows (one tensor read as both).

Two model families store one row per token that serves as key and value:

    DeepSeek V4            kv  [B, 1, S, 512]            k = kv,  v = kv               (Dv = D)
    absorbed MLA (V2/V3)   latent [B, 1, S, 512 + 64]    k = latent,  v = latent[..., :512]
                           (c_kv, the compressed K/V, then the shared RoPE key; engine.latent)

Passing ``v = k[..., :Dv]`` (a view: no copy) tells the kernels so: the native decode kernel then asks memory for
K's rows only (V's are the same bytes, already on their way), the tiled kernel converts the rows to its compute
dtype once, and the sparse kernel gathers each listed row once. The results are those of any ``v`` holding the same
numbers: only the reads change.

    k = torch.randn(1, 1, 4096, 576); v = k[..., :512]     shares_rows(k, v) -> True
    v = k[..., :512].clone()                               shares_rows(k, v) -> False (equal numbers, own bytes)
"""

from __future__ import annotations

import torch

from engine.quantized import QuantizedKV

__all__ = ["shares_rows"]


def shares_rows(k, v) -> bool:
    """True when ``v [B, Hkv, S, Dv]`` is a view of the first Dv columns of ``k [B, Hkv, S, D]``'s rows: the same
    storage, first element, dtype and strides (a ``QuantizedKV``: its data so, and the same scale tensor)."""
    if isinstance(k, QuantizedKV) and isinstance(v, QuantizedKV):
        return _prefix_view(k.data, v.data) and _same_view(k.scale, v.scale)
    return isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and _prefix_view(k, v)


def _prefix_view(k: torch.Tensor, v: torch.Tensor) -> bool:
    return (k.dim() == v.dim() == 4 and k.dtype == v.dtype and k.device == v.device and k.numel() > 0
            and v.data_ptr() == k.data_ptr() and v.shape[:3] == k.shape[:3] and v.shape[3] <= k.shape[3]
            and v.stride() == k.stride())


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
