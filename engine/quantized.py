"""Quantized keys and values: int8 or fp8 e4m3 entries with one fp32 scale per token and head.

A KV cache in int8 holds a quarter of fp32's bytes (half of bf16's), and decode, whose cost is reading the
cache, reads that much less. Each key (and value) vector ``x [D]`` of one token and head is stored as

    data = round(x / scale) in int8 (|data| <= 127),  scale = max|x| / 127        (fp8: x / scale in e4m3,
    x ~= data * scale                                                               scale = max|x| / 448)

    x = [0.5, -1.0, 0.25]  ->  scale = 1/127,  data = [64, -127, 32]  ->  [0.504, -1.0, 0.252]

so the error of an entry is at most half a step, ``scale / 2`` (int8). fp8 e4m3 keeps 3 mantissa bits for
entries with ``|x| >= 2^-6 * scale`` (e4m3's smallest normal number, scaled): their error is at most 1/16 of
their own size; smaller ones fall into e4m3's subnormal range, whose steps are ``2^-9 * scale``, so the bound that holds
for every entry is ``max(|x| / 16, 2^-10 * scale)`` (an entry 1e-6 beside a row maximum of 1.0 reads back as 0).
``QuantizedKV`` is accepted by ``causal_attention`` as ``k`` and ``v``: the call gets the
option ``"quantized_kv"`` (``AttentionInputs.options()``), so only kernels that read it run it (the native
decode kernel dequantises in registers; the ``dequantized`` kernel is its readable twin).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QUANTIZED_DTYPES", "QuantizedKV", "quantize"]

# The dtypes a quantized cache stores, with the largest magnitude each represents.
QUANTIZED_DTYPES: dict[torch.dtype, float] = {torch.int8: 127.0}
if hasattr(torch, "float8_e4m3fn"):
    QUANTIZED_DTYPES[torch.float8_e4m3fn] = 448.0


@dataclass(frozen=True)
class QuantizedKV:
    """Keys or values ``[B, Hkv, S, D]`` as ``data`` (int8 / float8_e4m3fn, same shape) and ``scale`` fp32
    ``[B, Hkv, S]``: entry ``[b, h, j, d]`` stands for ``data[b, h, j, d] * scale[b, h, j]``. Views of a
    ``KVCache``'s buffers (any strides; the last axis of ``data`` contiguous for the native kernel)."""

    data: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.data, torch.Tensor) or self.data.dtype not in QUANTIZED_DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in QUANTIZED_DTYPES)
            raise ValueError(f"QuantizedKV data must be a tensor of dtype {names}, got "
                             f"{getattr(self.data, 'dtype', type(self.data).__name__)}")
        if self.data.dim() != 4:
            raise ValueError(f"QuantizedKV data must be 4-D [B, Hkv, S, D], got shape {tuple(self.data.shape)}")
        if (not isinstance(self.scale, torch.Tensor) or self.scale.dtype != torch.float32
                or tuple(self.scale.shape) != tuple(self.data.shape[:3])):
            raise ValueError(f"QuantizedKV scale must be float32 of shape {list(self.data.shape[:3])} "
                             f"[B, Hkv, S], got {getattr(self.scale, 'dtype', None)} "
                             f"{list(getattr(self.scale, 'shape', []))}")
        if self.scale.device != self.data.device:
            raise ValueError(f"QuantizedKV data and scale must be on one device, got {self.data.device} and "
                             f"{self.scale.device}")

    # the tensor-like surface validation and dispatch read
    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def requires_grad(self) -> bool:
        return False

    def dim(self) -> int:
        return 4

    def keys(self, j0: int, j1: int) -> QuantizedKV:
        """Slots ``j0 .. j1-1`` (views)."""
        return QuantizedKV(self.data[:, :, j0:j1], self.scale[:, :, j0:j1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[B, Hkv, S, D]`` in ``dtype``: ``data * scale`` (a full-precision copy: for tests and the twin)."""
        return (self.data.to(torch.float32) * self.scale[..., None]).to(dtype)  # [B, Hkv, S, D]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes


def quantize(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> QuantizedKV:
    """``x [B, Hkv, S, D]`` (any float dtype) as a QuantizedKV with one scale per ``[b, h, j]`` (see above).

    A vector of zeros gets scale 1 (data 0). NaN/inf cannot be stored: a vector holding one gets a NaN scale,
    so it reads back as NaN everywhere (masked-out slots never reach an output, as with any cache)."""
    if dtype not in QUANTIZED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in QUANTIZED_DTYPES)
        raise ValueError(f"quantize: dtype must be one of {names}, got {dtype}")
    limit = QUANTIZED_DTYPES[dtype]
    xf = x.to(torch.float32)  # [B, Hkv, S, D]
    amax = xf.abs().amax(dim=-1)  # [B, Hkv, S]
    finite = torch.isfinite(amax)
    scale = torch.where(amax > 0, amax / limit, 1.0)  # [B, Hkv, S]
    scale = torch.where(finite, scale, float("nan"))
    scaled = torch.where(finite[..., None], xf / scale[..., None], 0.0).clamp(-limit, limit)  # [B, Hkv, S, D]
    data = scaled.round().to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    return QuantizedKV(data, scale)


def checked_as_tensors(q: torch.Tensor, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """``k, v`` for input validation: a QuantizedKV stands in as a zero-stride tensor of q's dtype and its
    shape (validation then checks shapes as for any k, v); ValueError when only one of them is quantized."""
    quantized = isinstance(k, QuantizedKV), isinstance(v, QuantizedKV)
    if not any(quantized):
        return k, v
    if not all(quantized):
        raise ValueError(f"k and v must both be QuantizedKV or both tensors, got {type(k).__name__} and "
                         f"{type(v).__name__}")
    if k.data.dtype != v.data.dtype:
        raise ValueError(f"quantized k and v must share one dtype, got {k.data.dtype} and {v.data.dtype}")
    dtype = q.dtype if isinstance(q, torch.Tensor) else torch.float32
    return tuple(torch.zeros((), dtype=dtype, device=x.device).expand(x.shape) for x in (k, v))
