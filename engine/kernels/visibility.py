"""The visibility rule, stated once for every kernel: which keys each query sees.

    key j is visible to query i  <=>  key_positions[j] <= query_positions[i]   (when causal)
                                      and allowed[..., i, j]                     (when given)

``visibility_mask`` builds it as one structured mask (kernels ask it for tile bounds and exact blocks, or
materialise it); ``causal_pattern`` says when it equals one of the fused kernel's two built-in patterns, so
no mask needs to be built at all.
"""

from __future__ import annotations

import torch

from engine.inputs import AttentionInputs
from engine.masks.causal import CausalMask
from engine.masks.structured import AllOf, StructuredMask, as_structured


def visibility_mask(inputs: AttentionInputs) -> StructuredMask | None:
    """The call's visibility as one structured mask (None: every key is visible to every query); built once per
    plan (``AttentionInputs.decided``)."""
    return inputs.decided("visibility_mask", lambda: _visibility_mask(inputs))


def _visibility_mask(inputs: AttentionInputs) -> StructuredMask | None:
    parts: list[StructuredMask] = []
    if inputs.causal:
        parts.append(CausalMask(inputs.query_positions, inputs.key_positions))  # [B, 1, T, S]
    if inputs.allowed is not None:
        parts.append(as_structured(inputs.allowed))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else AllOf(parts)


def dense_visibility(inputs: AttentionInputs) -> torch.Tensor:
    """The rule as a bool ``[B|1, Hq|1, T, S]`` tensor (materialised: for the dense kernel)."""
    mask = visibility_mask(inputs)
    if mask is None:
        t, s = inputs.q.shape[2], inputs.k.shape[2]
        return torch.ones(1, 1, t, s, dtype=torch.bool, device=inputs.q.device)  # [1, 1, T, S]
    dense = mask.to_dense()
    return dense.reshape((1,) * (4 - dense.dim()) + tuple(dense.shape))  # [B|1, Hq|1, T|1, S|1]


def causal_pattern(inputs: AttentionInputs) -> str | None:
    """``"none"`` (every key visible), ``"causal"`` (top-left) or None (the rule needs a mask), ignoring ``allowed``.

    The fused kernel knows two visibility patterns: none, and ``is_causal`` aligned to the *top-left* corner
    (query i sees keys j <= i). The rule equals one of them when:

        every key is visible           max(key_pos) <= min(query_pos) in each row, or causal=False
                                       (e.g. one-token decode with default positions)
        top-left causal                T == S, query_pos == key_pos and strictly increasing in each row
                                       (plain prefill with default positions)

        chunked prefill  T=2, S=4:  queries at 2, 3 see keys 0..2 / 0..3 (bottom-right): neither pattern.

    Decided once per plan; default positions are read off the shapes (no pass over positions, no host sync).
    """
    return inputs.decided("causal_pattern", lambda: _causal_pattern(inputs))


def _causal_pattern(inputs: AttentionInputs) -> str | None:
    query_pos, key_pos = inputs.query_positions, inputs.key_positions  # [B, T], [B, S]
    if not inputs.causal or query_pos.numel() == 0 or key_pos.numel() == 0:  # no queries or no keys: nothing to hide
        return "none"
    if inputs.default_positions:  # queries at S-T .. S-1, keys at 0 .. S-1
        t, s = query_pos.shape[1], key_pos.shape[1]
        return "none" if t <= 1 else "causal" if t == s else None
    if bool((key_pos.amax(dim=-1) <= query_pos.amin(dim=-1)).all()):
        return "none"
    if query_pos.shape[1] == key_pos.shape[1] and torch.equal(query_pos, key_pos) and \
            bool((key_pos.diff(dim=-1) > 0).all()):
        return "causal"
    return None


def decode_rows(inputs: AttentionInputs) -> tuple[int, int, torch.Tensor | None]:
    """The decode kernels' view of the rule, decided once per plan: ``(j0, j1, visible)``, the span of keys some
    row sees (``visible_span``) and which of them each query row sees, bool ``[B|1, Hkv|1, G*T|1, j1-j0]``
    (``row_visibility``; one row for all when they are alike), or None when every row sees every key of the span
    (one-token decode)."""
    return inputs.decided("decode_rows", lambda: _decode_rows(inputs))


def _decode_rows(inputs: AttentionInputs) -> tuple[int, int, torch.Tensor | None]:
    batch, q_heads, t, _ = inputs.q.shape
    kv_heads, s = inputs.k.shape[1], inputs.k.shape[2]
    every_key = inputs.allowed is None and causal_pattern(inputs) == "none"  # one-token decode: no mask at all
    if every_key:
        return 0, s, None
    mask = visibility_mask(inputs)
    if mask is not None and batch * t * s <= DENSE_ROWS:  # a small call: one pass over every key and row
        return dense_rows(mask, kv_heads, q_heads // kv_heads, t, s)
    j0, j1 = visible_span(mask, batch, t, s)
    visible = None
    if j1 > j0 and mask is not None:
        visible = row_visibility(mask, batch, kv_heads, q_heads // kv_heads, t, j0, j1)  # [B|1, Hkv|1, G*T, n]
    return j0, j1, visible


# B * T * S at most, a decode call's visibility is made dense in one piece (dense_rows) rather than bounded tile by
# tile for each batch row and read over the span. Measured (a plan's decode_rows, fresh plans, one thread): B 2, T 1,
# S 1024 with a padded row 116 us dense / 216 tiles; B 8, S 8k 364 / 748; B 8, S 128k, window 4k 1.5 / 3.9 ms; at
# 1M entries, windows or not, dense was never slower
DENSE_ROWS = 1 << 20


def dense_rows(mask, kv_heads: int, group: int, t: int, s: int) -> tuple[int, int, torch.Tensor | None]:
    """``decode_rows``' ``(j0, j1, visible)`` from the mask made dense whole: the keys some row sees, in whole blocks
    of 256 (as ``visible_span`` cuts them), and ``row_visibility`` over them, bool ``[B|1, Hkv|1, G*T, j1-j0]``
    (``[B|1, 1, 1, j1-j0]`` for one query shared by every head: the same row for the group's G rows)."""
    dense = mask.to_dense()
    dense = dense.reshape((1,) * (4 - dense.dim()) + tuple(dense.shape))  # [B|1, Hq|1, T|1, S|1]
    seen = dense.any(dim=(0, 1, 2))  # [S|1]: some row sees the key
    if seen.shape[0] == 1:  # every key alike
        j0, j1 = (0, s) if bool(seen) else (0, 0)
    else:
        hits = seen.nonzero()  # [n, 1]
        j0, j1 = _blocks(int(hits[0]), int(hits[-1]), s) if hits.numel() else (0, 0)
    if j1 == j0:
        return 0, 0, None
    part = dense[..., j0:j1] if dense.shape[3] > 1 else dense
    part = part.expand(*part.shape[:2], t, j1 - j0)  # [B|1, Hq|1, T, n]
    if part.shape[1] > 1:  # per head: head h * G + g, row i -> [B|1, Hkv, G*T, n] row g * T + i
        return j0, j1, part.reshape(part.shape[0], kv_heads, group * t, j1 - j0).contiguous()
    if t == 1:  # one row for the group's G rows (the kernels broadcast it; the native one then reads it once)
        return j0, j1, part.clone()  # [B|1, 1, 1, n]
    return j0, j1, part.repeat(1, 1, group, 1)  # shared by every head: [B|1, 1, G*T, n]


def _blocks(first: int, last: int, s: int, block: int = 256) -> tuple[int, int]:
    """The keys ``first .. last`` widened to whole blocks of ``block`` keys (at most s)."""
    return first // block * block, min(-(-(last + 1) // block) * block, s)


def visible_span(mask, batch: int, t: int, s: int) -> tuple[int, int]:
    """The smallest key range ``[j0, j1)`` holding every key some row sees (whole cache if unsure)."""
    if mask is None:
        return 0, s
    block = 256
    seen = torch.zeros(-(-s // block), dtype=torch.bool)
    for b in range(batch if mask.batched() else 1):
        some, _ = mask.tile_bounds(b, max(t, 1), block, t, s)  # [1, nk]
        seen |= some.any(dim=0)
    hits = seen.nonzero()
    if hits.numel() == 0:
        return 0, 0
    return int(hits[0]) * block, min(int(hits[-1] + 1) * block, s)


def chunk_rows(inputs, i0: int, i1: int) -> tuple[int, int, torch.Tensor | None]:
    """``decode_rows`` for query rows i0 .. i1-1 alone (a chunk of a prefill in batch-invariant mode): the span of
    keys they see, in whole blocks of 256 as ``visible_span`` cuts it, and their visibility
    ``[B|1, Hkv|1, G*T_c, j1-j0]`` (None: every key)."""
    batch, q_heads, t, _ = inputs.q.shape
    kv_heads, s = inputs.k.shape[1], inputs.k.shape[2]
    mask = visibility_mask(inputs)
    if mask is None:
        return 0, s, None
    visible = row_visibility(mask, batch, kv_heads, q_heads // kv_heads, i1 - i0, 0, s, first=i0)  # [.., G*T_c, S]
    seen = visible.reshape(-1, s).any(0).nonzero()
    if seen.numel() == 0:
        return 0, 0, None
    j0, j1 = _blocks(int(seen[0]), int(seen[-1]), s)
    return j0, j1, visible[..., j0:j1].contiguous()


def row_visibility(mask, batch: int, kv_heads: int, group: int, t: int, j0: int, j1: int,
                   first: int = 0) -> torch.Tensor:
    """Bool ``[B|1, Hkv|1, G*T, j1-j0]``: which keys each query row sees (query rows ``first .. first+T-1``)."""
    blocks = []
    for b in range(batch if mask.batched() else 1):
        visible = mask.block(b, first, first + t, j0, j1)  # [T, n] or [Hq|1, T|1, n|1]
        visible = visible.expand(*visible.shape[:-2], t, j1 - j0)
        if visible.dim() == 3 and visible.shape[0] > 1:  # per head: [Hq, T, n] -> [Hkv, G*T, n]
            visible = visible.reshape(kv_heads, group * t, j1 - j0)
        else:  # shared by every head: [T, n] -> [1, G*T, n]
            visible = visible.reshape(t, j1 - j0).repeat(group, 1)[None]
        blocks.append(visible)
    return torch.stack(blocks)  # [B|1, Hkv|1, G*T, n]
