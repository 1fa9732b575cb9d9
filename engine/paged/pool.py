"""The pages of a paged KV cache: storage, reference counts and the free list (engine.paged.cache keeps sequences).

Storage is head-major, ``[num_pages, Hkv, page_size, D]``: a head's keys of one page are one run of memory, which
the native kernel streams (the NHD order puts them Hkv * D apart: 1.3-1.9x slower decode, measured); ``keys`` and
``values`` show it in ``paged_attention``'s ``[num_pages, page_size, Hkv, D]`` order through a permuted view.

A quantized pool (``dtype`` int8 or float8_e4m3fn, engine.quantized) keeps 1-byte entries and one fp32 scale per
token and head; ``keys`` and ``values`` are then ``QuantizedKV`` views::

    data  [num_pages, page_size, Hkv, D]   of storage [num_pages, Hkv, page_size, D]   (int8 / e4m3)
    scale [num_pages, page_size, Hkv]      of storage [num_pages, Hkv, page_size]      (fp32)
    entry [p, s, h, d] stands for data[p, s, h, d] * scale[p, s, h]

so a token costs ``Hkv * (D + 4)`` bytes for its keys (fp32: ``4 * Hkv * D``). Slots no token was written to hold
0 (scale 1).

With ``shared_values`` a layer has one pool of rows: ``values`` is ``keys[..., :Dv]`` (a latent cache's
``[c_kv | k_rope]``, engine.shared_rows), written and copied once.
"""

from __future__ import annotations

from collections import Counter

import torch

from engine import huge_pages
from engine.inputs import SUPPORTED_DTYPES
from engine.quantized import QUANTIZED_DTYPES, QuantizedKV, quantize

__all__ = ["PagePool", "check_pool_dtype"]


def check_pool_dtype(dtype) -> bool:
    """True for a quantized dtype, False for one the kernels compute; ValueError naming every supported one else."""
    if isinstance(dtype, torch.dtype) and dtype in SUPPORTED_DTYPES:
        return False
    if isinstance(dtype, torch.dtype) and dtype in QUANTIZED_DTYPES:
        return True
    plain = ", ".join(str(d) for d in SUPPORTED_DTYPES)
    quantized = ", ".join(str(d) for d in QUANTIZED_DTYPES)
    raise ValueError(f"dtype must be one the kernels compute ({plain}) or a quantized one ({quantized}), got "
                     f"{dtype!r}")


def _pool(num_pages: int, page_size: int, heads: int, width: int, dtype: torch.dtype, device, quantized: bool):
    """Zeroed ``[num_pages, page_size, Hkv, E]`` (a ``QuantizedKV`` with scales 1 when quantized)."""
    data = huge_pages.zeros(num_pages, heads, page_size, width, dtype=dtype, device=device).permute(0, 2, 1, 3)
    if not quantized:
        return data  # [num_pages, page_size, Hkv, E]
    scale = torch.ones(num_pages, heads, page_size, device=device).permute(0, 2, 1)  # [num_pages, page_size, Hkv]
    return QuantizedKV(data, scale)


class PagePool:
    """``keys [num_pages, page_size, Hkv, D]`` and ``values [num_pages, page_size, Hkv, Dv]`` (tensors, or
    ``QuantizedKV`` for a quantized ``dtype``), with a reference count per page: ``take`` hands out a free page
    (count 1), ``hold`` adds a holder, ``drop`` removes one and returns the page to the free list at 0."""

    def __init__(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int, value_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None, layers: int = 1,
                 shared_values: bool = False) -> None:
        self.quantized = check_pool_dtype(dtype)
        if shared_values not in (True, False) or (shared_values and value_dim > head_dim):
            raise ValueError(f"shared_values (the values as the first value_dim columns of the keys' rows) must be "
                             f"True or False, with value_dim <= head_dim = {head_dim}: got {shared_values!r}, "
                             f"value_dim {value_dim}")
        self.page_size, self.shared_values = page_size, shared_values
        # one pair of pools per layer, one page numbering and free list for all of them (page p of every layer
        # belongs to the same tokens); a layer's two allocated one after the other (huge_pages staggers them)
        self.layer_keys, self.layer_values = [], []
        for _ in range(layers):
            keys = _pool(num_pages, page_size, kv_heads, head_dim, dtype, device, self.quantized)
            self.layer_keys.append(keys)
            self.layer_values.append(_value_rows(keys, value_dim) if shared_values else
                                     _pool(num_pages, page_size, kv_heads, value_dim, dtype, device, self.quantized))
        self.keys, self.values = self.layer_keys[0], self.layer_values[0]
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: the lowest ids first
        self._references = [0] * num_pages  # holders of each page

    @property
    def num_pages(self) -> int:
        return len(self._references)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        """Bytes of the pools (every page, used or not; a quantized pool's scales included)."""
        return sum(pool.nbytes for pool in self._stored())

    def references(self, page: int) -> int:
        return self._references[page]

    def freed_by(self, pages: list[int]) -> int:
        """How many pages would return to the free list if one reference were dropped per entry of ``pages``."""
        return sum(1 for page, n in Counter(pages).items() if self._references[page] == n)

    def take(self) -> int:
        page = self._free.pop()
        self._references[page] = 1
        return page

    def hold(self, page: int) -> None:
        self._references[page] += 1

    def drop(self, page: int) -> None:
        self._references[page] -= 1
        if self._references[page] == 0:
            self._free.append(page)

    def copy(self, source: int, target: int) -> None:
        """Page ``target`` becomes a copy of page ``source`` in every layer (keys and values; data and scales)."""
        for pool in self._stored():
            if self.quantized:
                pool.data[target], pool.scale[target] = pool.data[source], pool.scale[source]
            else:
                pool[target] = pool[source]

    def write(self, pages: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              layer: int = 0) -> None:
        """Row i of ``keys [N, Hkv, D]`` and ``values [N, Hkv, Dv]`` goes to slot ``slots[i]`` of page ``pages[i]``
        (int64 ``[N]``, distinct pairs) of ``layer``'s pools; a quantized pool quantizes each row per head first.
        Shared rows: the keys' rows hold the values (``values`` is not read)."""
        written = [(keys, self.layer_keys[layer])]
        if not self.shared_values:
            written.append((values, self.layer_values[layer]))
        for new, pool in written:
            if self.quantized:
                stored = quantize(new[None].to(pool.device), pool.data.dtype)  # [1, N, Hkv, E], scale per token, head
                pool.data[pages, slots] = stored.data[0]  # [N, Hkv, E]
                pool.scale[pages, slots] = stored.scale[0]  # [N, Hkv]
            else:
                pool[pages, slots] = new.to(pool.device, pool.dtype)  # [N, Hkv, E]

    def shared_rows(self, keys, values):
        """A shared-rows pool's new values: ``keys [N, Hkv, D]``'s first Dv columns (``values`` must be None)."""
        if values is not None:
            raise ValueError("this cache's values are the first value_dim columns of its keys' rows "
                             "(shared_values=True): pass values=None")
        dv = self.values.shape[-1]
        return keys[..., :dv] if isinstance(keys, torch.Tensor) and keys.dim() == 3 else keys

    def _stored(self) -> list:
        """The pools that own their storage (shared rows: the keys' alone)."""
        return self.layer_keys if self.shared_values else self.layer_keys + self.layer_values


def _value_rows(keys, value_dim: int):
    """The first ``value_dim`` columns of a pool's rows (a view; a quantized pool's scales are the keys')."""
    if isinstance(keys, QuantizedKV):
        return QuantizedKV(keys.data[..., :value_dim], keys.scale)
    return keys[..., :value_dim]  # [num_pages, page_size, Hkv, Dv]
