"""A preallocated per-layer KV cache that stores every key with its position.

Positions drive the cache (the attention chapter's rule: key j is visible to query i iff pos(k_j) <= pos(q_i)):
each slot holds a key, a value, the key's position and whether the slot holds a real token (pad slots are kept
but never attended to). Prefill, chunked prefill and one-token decode are one call, ``update``: it writes T new
slots for every row and returns all slots so far.

    capacity 8, two rows, left-padded prompt of 4 then one decode step ("." = pad slot):

        slot        0  1  2  3  4 | 5  6  7
        row 0       .  .  a  b  c |            positions 0 0 0 1 2   valid F F T T T
        row 1       d  e  f  g  h |            positions 0 1 2 3 4   valid T T T T T
                    (prefill: T = 5)  decode writes slot 5 at positions [3, 5]

Rows advance together in slots (one write offset for the batch) but keep their own positions, so ragged
batches, left or right padding and per-row decode positions need no special path.

Memory of a whole model's cache: ``2 * layers * B * Hkv * S * D * bytes`` (keys and values); Llama-3-8B
(32 layers, Hkv = 8, D = 128) at 128k tokens in fp16 holds 2 * 32 * 8 * 131072 * 128 * 2 = 17.2 GB per sequence.

Quantized (``dtype=torch.int8`` or ``torch.float8_e4m3fn``): ``update`` takes keys and values in any float
dtype and stores them as 1-byte entries with one fp32 scale per token and head (engine.quantized), 1 + 4/D
bytes per entry (Llama-3-8B at 128k: 8.6 GB + 0.27 GB of scales); ``view`` returns ``QuantizedKV`` keys and
values, which ``causal_attention`` reads without a full-precision copy (kernel ``decode_native``).

Shared rows (``shared_values=True``): the values are the first ``value_dim`` columns of the keys' own rows, one
row per token stored once (a latent cache: MLA's ``[c_kv | k_rope]``, 512 + 64 numbers, whose first 512 are the
values; DeepSeek V4's kv, ``value_dim = head_dim``). ``update`` takes the rows as ``keys`` (``values=None``) and
``view`` returns ``values`` as ``keys[..., :value_dim]``, which the kernels read once (engine.shared_rows).
"""

from __future__ import annotations

import torch

from engine import huge_pages
from engine.inputs import SUPPORTED_DTYPES
from engine.quantized import QUANTIZED_DTYPES, QuantizedKV, quantize
from engine.shared_rows import shares_rows

__all__ = ["KVCache", "kv_cache_bytes"]


def kv_cache_bytes(layers: int, batch: int, kv_heads: int, tokens: int, head_dim: int, dtype_bytes: int,
                   scale_bytes: int = 0) -> int:
    """Bytes of keys and values for a whole model: ``2 * layers * B * Hkv * S * (D * bytes + scale_bytes)``.

    ``scale_bytes`` is 4 for a quantized cache (int8 / fp8 entries, one fp32 scale per token and head), else 0.
    Example, Llama-3-8B at 128k tokens in fp16: ``kv_cache_bytes(32, 1, 8, 131072, 128, 2) == 17_179_869_184``
    (17.2 GB); in int8 ``kv_cache_bytes(32, 1, 8, 131072, 128, 1, 4) == 8_858_370_048`` (8.9 GB, 0.27 GB of it
    scales).
    """
    for name, n in (("layers", layers), ("batch", batch), ("kv_heads", kv_heads), ("tokens", tokens),
                    ("head_dim", head_dim), ("dtype_bytes", dtype_bytes), ("scale_bytes", scale_bytes)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    return 2 * layers * batch * kv_heads * tokens * (head_dim * dtype_bytes + scale_bytes)


class KVCache:
    """Keys, values, key positions and slot validity for one attention layer, preallocated.

    Storage:
        keys ``[B, Hkv, capacity, D]``, values ``[B, Hkv, capacity, Dv]`` in ``dtype``; for a quantized
        ``dtype`` (int8, float8_e4m3fn) also key_scales, value_scales fp32 ``[B, Hkv, capacity]``;
        positions int64 ``[B, capacity]``; valid bool ``[B, capacity]`` (False for pad slots).
    ``length`` slots (shared by the batch) are filled; ``next_positions`` ``[B]`` is each row's next position.
    """

    def __init__(
        self,
        batch_size: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        value_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        shared_values: bool = False,
    ) -> None:
        value_dim = head_dim if value_dim is None else value_dim
        for name, n in (("batch_size", batch_size), ("kv_heads", kv_heads), ("capacity", capacity),
                        ("head_dim", head_dim), ("value_dim", value_dim)):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        if shared_values not in (True, False):
            raise ValueError(f"shared_values must be True or False, got {shared_values!r}")
        if shared_values and value_dim > head_dim:
            raise ValueError(f"shared values are the first value_dim columns of the keys' rows: value_dim must be "
                             f"<= head_dim = {head_dim}, got {value_dim}")
        self.shared_values = shared_values
        self.quantized = isinstance(dtype, torch.dtype) and dtype in QUANTIZED_DTYPES
        if not isinstance(dtype, torch.dtype) or not (dtype in SUPPORTED_DTYPES or self.quantized):
            plain = ", ".join(str(x) for x in SUPPORTED_DTYPES)
            quantized = ", ".join(str(x) for x in QUANTIZED_DTYPES)
            raise ValueError(f"dtype must be a floating-point torch.dtype the kernels compute ({plain}) or a "
                             f"quantized one ({quantized}), got {dtype!r} ({type(dtype).__name__})")
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError) as error:
                raise ValueError(f"device must be a torch.device, a device string (e.g. 'cpu', 'cuda:0') or None, "
                                 f"got {device!r}: {error}") from error
        self.capacity = capacity
        storage = dict(dtype=dtype, device=device)
        self.keys = huge_pages.zeros(batch_size, kv_heads, capacity, head_dim, **storage)  # [B, Hkv, capacity, D]
        self.values = self.keys[..., :value_dim] if shared_values else \
            huge_pages.zeros(batch_size, kv_heads, capacity, value_dim, **storage)  # [B, Hkv, capacity, Dv]
        if self.quantized:  # one scale per token and head (a shared row: one scale for its key and its value)
            self.key_scales = torch.ones(batch_size, kv_heads, capacity, device=device)  # [B, Hkv, capacity]
            self.value_scales = self.key_scales if shared_values else \
                torch.ones(batch_size, kv_heads, capacity, device=device)  # [B, Hkv, capacity]
        self.positions = torch.zeros(batch_size, capacity, dtype=torch.long, device=device)  # [B, capacity]
        self.valid = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)  # [B, capacity]
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value storage (the KV-cache formula above at ``S = capacity``, one layer; a
        quantized cache adds its scales, 4 bytes per token and head for keys and for values)."""
        if self.shared_values:  # one row per token: the values are the keys' first columns
            return self.keys.nbytes + (self.key_scales.nbytes if self.quantized else 0)
        scales = self.key_scales.nbytes + self.value_scales.nbytes if self.quantized else 0
        return self.keys.nbytes + self.values.nbytes + scales

    @property
    def bookkeeping_nbytes(self) -> int:
        """Bytes of the per-slot positions and validity (not part of the KV-cache formula)."""
        return self.positions.nbytes + self.valid.nbytes

    @property
    def next_positions(self) -> torch.Tensor:
        """int64 ``[B]``: one past the largest position of each row's real tokens (0 for an empty row)."""
        filled = torch.where(self.valid[:, : self.length], self.positions[:, : self.length] + 1, 0)  # [B, L]
        return filled.amax(dim=1) if self.length else torch.zeros_like(self.positions[:, 0])  # [B]

    def update(
        self,
        keys: torch.Tensor,
        values: torch.Tensor | None,
        positions: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | QuantizedKV, torch.Tensor | QuantizedKV, torch.Tensor, torch.Tensor]:
        """Append T slots to every row and return everything cached so far.

        Args:
            keys: ``[B, Hkv, T, D]`` new keys (RoPE already applied).
            values: ``[B, Hkv, T, Dv]`` new values; with ``shared_values`` None (or ``keys[..., :Dv]``): the
                values are the keys' first Dv columns.
            positions: integer ``[T]`` or ``[B, T]`` positions of the new tokens; default
                ``next_positions[:, None] + arange(T)`` (each row continues where it stopped).
            valid: bool ``[B, T]``, False at pad tokens; default all True.

        Returns:
            ``(keys [B, Hkv, L, D], values [B, Hkv, L, Dv], key_positions [B, L], key_valid [B, L])``,
            views of the cache with ``L = length`` after the write (keys and values as ``QuantizedKV``
            views when the cache is quantized: the new ones are quantized as they are written).

        Raises ValueError, leaving the cache unchanged, on bad shapes or when ``length + T > capacity``.
        """
        if self.shared_values:
            values = self._shared(keys, values)
        t = self._check_new(keys, values)
        batch = self.batch_size
        if self.length + t > self.capacity:
            raise ValueError(f"KV cache overflow: it holds {self.length} of {self.capacity} slots and cannot take "
                             f"{t} more (needs capacity >= {self.length + t}); nothing was written")
        if positions is None:
            positions = self.next_positions[:, None] + torch.arange(t, device=self.keys.device)  # [B, T]
        positions = self._check_rows(positions, t, "positions", integer=True)  # [B, T]
        valid = torch.ones(batch, t, dtype=torch.bool, device=self.keys.device) if valid is None else \
            self._check_rows(valid, t, "valid", integer=False)  # [B, T]
        end = self.length + t
        written = ((keys, self.keys, self.key_scales if self.quantized else None),)
        if not self.shared_values:
            written += ((values, self.values, self.value_scales if self.quantized else None),)
        if self.quantized:
            for new, data, scales in written:
                stored = quantize(new, data.dtype)
                data[:, :, self.length:end] = stored.data  # [B, Hkv, T, D]
                scales[:, :, self.length:end] = stored.scale  # [B, Hkv, T]
        else:
            for new, data, _ in written:
                data[:, :, self.length:end] = new  # [B, Hkv, T, D | Dv]
        self.positions[:, self.length:end] = positions  # [B, T]
        self.valid[:, self.length:end] = valid  # [B, T]
        self.length = end
        return self.view()

    def view(self) -> tuple[torch.Tensor | QuantizedKV, torch.Tensor | QuantizedKV, torch.Tensor, torch.Tensor]:
        """The filled slots: ``(keys [B, Hkv, L, D], values [B, Hkv, L, Dv], positions [B, L], valid [B, L])``."""
        end = self.length
        keys, values = self.keys[:, :, :end], self.values[:, :, :end]
        if self.quantized:
            keys = QuantizedKV(keys, self.key_scales[:, :, :end])  # [B, Hkv, L, D] with scales [B, Hkv, L]
            values = QuantizedKV(values, self.value_scales[:, :, :end])  # [B, Hkv, L, Dv]
        return keys, values, self.positions[:, :end], self.valid[:, :end]

    def truncate(self, length: int) -> None:
        """Roll back to the first ``length`` slots (speculative decoding, retries); later writes overwrite the rest.

        Without padding, slot ``i`` holds position ``i``, so this is "truncate to position ``length``".
        """
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.length:
            raise ValueError(f"truncate length must be an int in [0, {self.length}] (the filled slots), got {length!r}")
        self.length = length

    def reset(self) -> None:
        """Empty the cache (storage is kept; nothing is reallocated)."""
        self.length = 0

    def _shared(self, keys, values) -> torch.Tensor:
        """A shared-rows cache's new values: the new keys' first Dv columns (``values`` must be None or that)."""
        if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
            raise ValueError(f"keys must be a tensor [B, Hkv, T, D], got {getattr(keys, 'shape', type(keys).__name__)}")
        if values is not None and not shares_rows(keys, values):
            raise ValueError("this cache stores its values as the first value_dim columns of its keys' rows "
                             "(shared_values=True): pass values=None (or keys[..., :value_dim])")
        return keys[..., : self.values.shape[-1]]  # [B, Hkv, T, Dv]

    def _check_new(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        batch, heads, _, d = self.keys.shape
        dv = self.values.shape[-1]
        for name, x, width in (("keys", keys, d), ("values", values, dv)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                raise ValueError(f"{name} must be a tensor [B, Hkv, T, D], got {getattr(x, 'shape', type(x).__name__)}")
            if x.shape[0] != batch or x.shape[1] != heads or x.shape[3] != width:
                raise ValueError(f"{name} must have shape [{batch}, {heads}, T, {width}] to fit this cache, "
                                 f"got {list(x.shape)}")
            if self.quantized and not x.is_floating_point():
                raise ValueError(f"{name} must be a float tensor (quantized to {self.keys.dtype} here), got {x.dtype}")
            if not self.quantized and x.dtype != self.keys.dtype:
                raise ValueError(f"{name} must have the cache's dtype {self.keys.dtype}, got {x.dtype}")
        if keys.shape[2] != values.shape[2]:
            raise ValueError(f"keys and values must have the same T, got {keys.shape[2]} and {values.shape[2]}")
        return keys.shape[2]

    def _check_rows(self, x: torch.Tensor, t: int, name: str, integer: bool) -> torch.Tensor:
        batch = self.batch_size
        kind = "an integer" if integer else "a bool"
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be {kind} tensor [{t}] or [{batch}, {t}], got {type(x).__name__}")
        ok_dtype = (not x.is_floating_point() and x.dtype != torch.bool) if integer else x.dtype == torch.bool
        if not ok_dtype:
            raise ValueError(f"{name} must be {kind} tensor, got dtype {x.dtype}")
        if x.dim() == 1 and x.shape[0] == t:
            x = x[None, :]  # [1, T]
        if x.dim() != 2 or x.shape[1] != t or x.shape[0] not in (1, batch):
            raise ValueError(f"{name} must have shape [{t}] or [{batch}, {t}], got {list(x.shape)}")
        return x.to(self.keys.device).expand(batch, t)  # [B, T]
