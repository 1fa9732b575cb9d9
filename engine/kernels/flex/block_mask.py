"""The rule as FlexAttention wants it: a ``BlockMask`` from the structured mask's tile bounds, and a ``mask_mod``.

FlexAttention visits, for each query block, the key blocks its ``BlockMask`` lists, in two lists: *partial*
blocks, where it asks ``mask_mod(b, h, q_idx, kv_idx)`` for every pair, and *full* blocks, where it asks
nothing. The engine's plan already knows both, from the visibility mask's per-tile bounds
(``StructuredMask.tile_bounds``)::

    some[i, j]   every[i, j]   block kind            BlockMask
    False        -             empty: never read     in neither list
    True         False         partial               kv_indices       (mask_mod decides each pair)
    True         True          full                  full_kv_indices  (no mask_mod)

and ``mask_mod`` is the same rule evaluated pair by pair: each mask family's own ``relate`` on the per-token
values (positions, document ids, validity flags) of query ``q_idx`` and key ``kv_idx``, joined by the mask's
``&``, ``|`` and ``~``::

    causal & window(4):  mask_mod(b, h, i, j) = (key_pos[b, j] <= query_pos[b, i])                    # CausalMask
                           & (key_pos[b, j] <= query_pos[b, i]) & (query_pos[b, i] - key_pos[b, j] < 4)  # WindowMask

The per-token values are padded to whole blocks (repeating the last entry), so the kernel never reads past
them in a block that straddles the end of the sequence. Block masks are cached by content: the layers of one
training step, or repeated calls with equal positions, build theirs once (``block_mask_cache_info``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import torch

from engine.inputs import AttentionInputs
from engine.kernels.visibility import causal_pattern, visibility_mask
from engine.masks.pairwise import PairwiseMask
from engine.masks.structured import AllOf, AnyOf, DenseMask, Not, StructuredMask

try:  # FlexAttention arrived in torch 2.5; the engine runs on older torch without it
    from torch.nn.attention.flex_attention import BlockMask
except ImportError:  # pragma: no cover - torch < 2.5
    BlockMask = None

BLOCK = 128  # queries and keys per block (FlexAttention's default block size)
CACHE_SIZE = 16  # block masks kept (least recently used dropped first)

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class FlexMask(NamedTuple):
    """What a flex call needs about visibility: its ``BlockMask`` (None: every key visible) and how it was made."""

    block_mask: object | None  # a torch BlockMask, or None
    kind: str  # "none" (no mask), "causal" (top-left, from indices) or "structured" (from the tile bounds)


def flex_mask(inputs: AttentionInputs, block: int = BLOCK, backward: bool = False) -> FlexMask:
    """The call's visibility for FlexAttention, built once per distinct content (cached). ``backward``: also
    the query-side block lists Flex's backward reads (3/4 of the build time at T = 32k; inference skips them)."""
    batch, _, t, _ = inputs.q.shape
    s = inputs.k.shape[2]
    pattern = causal_pattern(inputs) if inputs.allowed is None else None
    if pattern == "none":  # every key visible (decode with default positions, causal=False)
        return FlexMask(None, "none")
    if pattern == "causal":  # plain prefill: the rule is q_idx >= kv_idx, independent of the position values
        key = ("causal", t, s, block, str(inputs.q.device), backward)
        build = lambda: _causal_block_mask(t, s, block, inputs.q.device, backward)  # noqa: E731
        return FlexMask(_cached(key, [], build), "causal")
    mask = visibility_mask(inputs)
    leaves = _leaves(mask)
    key = ("structured", repr(mask), batch, t, s, block, str(inputs.q.device), backward,
           tuple((x.dtype, tuple(x.shape)) for x in leaves))
    build = lambda: structured_block_mask(mask, batch, t, s, block, backward)  # noqa: E731
    return FlexMask(_cached(key, leaves, build), "structured")


def structured_block_mask(mask: StructuredMask, batch: int, t: int, s: int, block: int = BLOCK,
                          backward: bool = True):
    """A ``BlockMask`` ``[B|1, 1, ceil(T/block), ceil(S/block)]`` from ``mask``'s tile bounds, with its ``mask_mod``.

    Per-head masks (a dense ``[B, Hq, T, S]`` tensor) share one block list for every head: a block is skipped
    only if it is empty for every head, full only if it is full for every head (``tile_bounds`` combines
    heads that way); ``mask_mod`` reads each head's own entries.
    """
    rows = batch if mask.batched() else 1
    bounds = [mask.tile_bounds(b, block, block, t, s) for b in range(rows)]
    some = torch.stack([pair[0] for pair in bounds])[:, None]  # [B|1, 1, nq, nk]
    every = torch.stack([pair[1] for pair in bounds])[:, None]  # [B|1, 1, nq, nk]
    partial = some & ~every
    kv_num, kv_indices = _block_lists(partial)
    full_num, full_indices = _block_lists(every)
    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=(block, block),
                                    mask_mod=mask_mod_of(mask, t, s, block), seq_lengths=(t, s),
                                    compute_q_blocks=backward)


def _block_lists(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``chosen`` bool ``[B, H, nq, nk]`` -> (how many per query block ``[B, H, nq]``, their key-block indices first
    ``[B, H, nq, nk]``), int32 as FlexAttention reads them."""
    count = chosen.sum(dim=-1, dtype=torch.int32)  # [B, H, nq]
    order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)  # chosen blocks first, in key order
    return count, order.to(torch.int32)  # separate tensors for the two lists (the compiler must not alias them)


def _causal_block_mask(t: int, s: int, block: int, device: torch.device, backward: bool):
    """Top-left causal on indices (query i sees keys j <= i; T == S): the blocks below the diagonal are full."""
    nq, nk = -(-t // block), -(-s // block)
    i = torch.arange(nq, device=device)[:, None]  # [nq, 1]
    j = torch.arange(nk, device=device)[None, :]  # [1, nk]
    every = ((j + 1) * block - 1 <= i * block)[None, None]  # [1, 1, nq, nk]: the last key <= the first query
    partial = ((j * block <= (i + 1) * block - 1) & ~every[0, 0])[None, None]  # [1, 1, nq, nk]
    kv_num, kv_indices = _block_lists(partial)
    full_num, full_indices = _block_lists(every)
    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=(block, block),
                                    mask_mod=causal_index_mod, seq_lengths=(t, s), compute_q_blocks=backward)


def causal_index_mod(b, h, q_idx, kv_idx):
    """Top-left causal on indices: what plain prefill's positions reduce to (``causal_pattern`` says when)."""
    return kv_idx <= q_idx


# --- mask_mod: the structured mask, pair by pair ------------------------------------------------------------


def mask_mod_of(mask: StructuredMask, t: int, s: int, block: int = BLOCK) -> MaskMod:
    """``mask_mod(b, h, q_idx, kv_idx) -> bool``: ``mask`` at one (query, key) pair of batch row b, head h.

    Families (``PairwiseMask``) evaluate their own ``relate`` on the two tokens' values; ``&``, ``|``, ``~``
    combine; a dense tensor is read at ``[b, h, q_idx, kv_idx]`` (size-1 axes at 0); any other mask is
    materialised once and read the same way.
    """
    padded_t, padded_s = -(-t // block) * block, -(-s // block) * block
    if isinstance(mask, (AllOf, AnyOf)):
        parts = [mask_mod_of(part, t, s, block) for part in mask.parts]
        join = mask.op
        return lambda b, h, q_idx, kv_idx: _fold(join, [part(b, h, q_idx, kv_idx) for part in parts])
    if isinstance(mask, Not):
        inner = mask_mod_of(mask.part, t, s, block)
        return lambda b, h, q_idx, kv_idx: ~inner(b, h, q_idx, kv_idx)
    if isinstance(mask, PairwiseMask):
        key_at = _token_values(mask.key_values, padded_s)
        if mask.query_values is None:  # key-only (padding of keys): every query side counts as True
            return lambda b, h, q_idx, kv_idx: mask.relate(torch.ones_like(key_at(b, kv_idx)), key_at(b, kv_idx))
        query_at = _token_values(mask.query_values, padded_t)
        return lambda b, h, q_idx, kv_idx: mask.relate(query_at(b, q_idx), key_at(b, kv_idx))
    dense = mask.mask if isinstance(mask, DenseMask) else mask.to_dense()
    return _dense_mod(dense, padded_t, padded_s)


def _fold(join, values):
    out = values[0]
    for value in values[1:]:
        out = join(out, value)
    return out


def _token_values(values: torch.Tensor, padded: int):
    """``at(b, idx)``: the value of token idx in batch row b, from ``[L]`` or ``[B, L]`` values padded to ``padded``.

    Consecutive positions shared by every row (``offset + idx``: default positions, plain windows) are computed
    from the index instead of read: the kernel evaluates ``mask_mod`` on every pair of a partial block, and
    arithmetic costs less there than a load (measured on CPU: a window's mask_mod 1.4x faster)."""
    if values.dim() == 2 and (values.shape[0] == 1 or values.stride(0) == 0):
        values = values[0]  # one row (expanded over the batch): read it once
    offset = _arange_offset(values)
    if offset is not None:
        return lambda b, idx: idx + offset
    values = _pad_last(values, padded)  # [L'] or [B, L']
    if values.dim() == 1:
        return lambda b, idx: values[idx]
    return lambda b, idx: values[b, idx]


INDEX_LIMIT = 1 << 30  # positions computed as offset + idx stay far inside int32 (Flex's index dtype)


def _arange_offset(values: torch.Tensor) -> int | None:
    """``c`` when ``values`` is the integer sequence ``c, c + 1, ...`` (within int32), else None."""
    if values.dim() != 1 or values.dtype != torch.int64 or values.numel() == 0:
        return None
    first, length = int(values[0]), values.shape[0]
    if not (-INDEX_LIMIT < first and first + length < INDEX_LIMIT):
        return None
    expected = torch.arange(first, first + length, device=values.device)  # [L]
    return first if torch.equal(values, expected) else None


def _dense_mod(dense: torch.Tensor, padded_t: int, padded_s: int) -> MaskMod:
    """A bool tensor broadcastable to ``[B, Hq, T, S]`` read pair by pair (a size-1 axis is read at 0)."""
    m = dense.reshape((1,) * (4 - dense.dim()) + tuple(dense.shape))  # [B|1, H|1, T|1, S|1]
    m = _pad_axis(m, 2, padded_t) if m.shape[2] > 1 else m.clone()
    if m.shape[3] > 1:
        m = _pad_axis(m, 3, padded_s)
    batched, per_head, per_query, per_key = (m.shape[axis] > 1 for axis in range(4))

    def mod(b, h, q_idx, kv_idx):
        return m[b if batched else 0, h if per_head else 0, q_idx if per_query else 0, kv_idx if per_key else 0]

    return mod


def _pad_last(values: torch.Tensor, length: int) -> torch.Tensor:
    return _pad_axis(values, values.dim() - 1, length)


def _pad_axis(x: torch.Tensor, axis: int, length: int) -> torch.Tensor:
    """A copy of ``x`` grown to ``length`` along ``axis`` by repeating its last entry. Always a copy: a cached
    block mask's ``mask_mod`` must not see later in-place changes of the caller's tensors."""
    missing = length - x.shape[axis]
    if missing <= 0 or x.shape[axis] == 0:
        return x.clone()
    last = x.narrow(axis, x.shape[axis] - 1, 1)
    return torch.cat([x, last.expand(*x.shape[:axis], missing, *x.shape[axis + 1:])], dim=axis)


def _leaves(mask: StructuredMask) -> list[torch.Tensor]:
    """The tensors a mask's content lives in (values of each family, dense tensors), in a fixed order."""
    if isinstance(mask, (AllOf, AnyOf)):
        return [x for part in mask.parts for x in _leaves(part)]
    if isinstance(mask, Not):
        return _leaves(mask.part)
    if isinstance(mask, PairwiseMask):
        return [x for x in (mask.query_values, mask.key_values) if x is not None]
    return [mask.mask if isinstance(mask, DenseMask) else mask.to_dense()]


# --- the cache ----------------------------------------------------------------------------------------------

_CACHE: OrderedDict[tuple, list[tuple[list[torch.Tensor], object]]] = OrderedDict()
_STATS = {"hits": 0, "builds": 0}


def _cached(key: tuple, leaves: list[torch.Tensor], build: Callable[[], object]):
    """The block mask stored under ``key`` for leaves equal to ``leaves``, else a new one (stored)."""
    entries = _CACHE.get(key, [])
    for stored, block_mask in entries:
        if all(torch.equal(a, b) for a, b in zip(stored, leaves)):
            _CACHE.move_to_end(key)
            _STATS["hits"] += 1
            return block_mask
    block_mask = build()
    _STATS["builds"] += 1
    _CACHE[key] = [*entries[-3:], ([x.clone() for x in leaves], block_mask)]  # up to 4 contents per key
    _CACHE.move_to_end(key)
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    return block_mask


def block_mask_cache_info() -> dict[str, int]:
    """``{"hits", "builds", "size"}`` of the block-mask cache (for tests and benchmarks)."""
    return {**_STATS, "size": sum(len(entries) for entries in _CACHE.values())}


def clear_block_mask_cache() -> None:
    _CACHE.clear()
    _STATS.update(hits=0, builds=0)
