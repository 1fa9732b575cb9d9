"""Padding: rows of a batch have real lengths ``lengths[b]``; the rest of the row is padding.

    lengths = [3, 5], total = 5
    side="right":  row 0 = x x x . .   positions 0 1 2 3 4   (pads after the text)
    side="left":   row 0 = . . x x x   positions 0 0 0 1 2   (pads before the text; real tokens 0..L-1)

Left padding keeps the last real token at the end of every row (what generation wants); its real tokens
still need positions 0..L-1, which ``padding_positions`` gives. Pad tokens are masked, so their
positions never matter.
"""

from __future__ import annotations

import torch

from engine.masks.pairwise import PairwiseMask

_SIDES = ("left", "right")


class PaddingMask(PairwiseMask):
    """``query_valid & key_valid`` (bool flags; a key-only mask has no query side). Per tile the flags' min is
    "all valid" and their max "any valid": some pair may be visible if both sides have a valid token, every
    pair is if both sides are all valid."""

    name = "padding"
    key_only = True

    def relate(self, q, k):
        return q & k

    def bounds(self, q_lo, q_hi, k_lo, k_hi):
        return q_hi & k_hi, q_lo & k_lo


def _valid(lengths: torch.Tensor, total: int, side: str) -> torch.Tensor:
    if side not in _SIDES:
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1 or lengths.is_floating_point():
        raise ValueError(f"lengths must be an integer tensor of shape [B], got {lengths!r}")
    if bool(((lengths < 0) | (lengths > total)).any()):
        raise ValueError(f"lengths must lie in [0, {total}], got {lengths.tolist()}")
    index = torch.arange(total, device=lengths.device)  # [L]
    if side == "right":
        return index[None, :] < lengths[:, None]  # [B, L]
    return index[None, :] >= (total - lengths)[:, None]  # [B, L]


def key_padding_mask(lengths: torch.Tensor, total: int, side: str = "right") -> PaddingMask:
    """Bool ``[B, 1, 1, S]``: True at real keys. Queries are not masked (decode, cross-attention).

    A StructuredMask: kernels skip key tiles made only of padding.
    """
    return PaddingMask(None, _valid(lengths, total, side))  # [B, 1, 1, S]


def padding_mask(lengths: torch.Tensor, total: int, side: str = "right") -> PaddingMask:
    """Bool ``[B, 1, T, T]`` for self-attention: real queries see real keys; pad queries see nothing.

    A pad query row is all False, so causal_attention returns zeros there (never NaN). A StructuredMask:
    kernels skip tiles of padding.
    """
    valid = _valid(lengths, total, side)  # [B, L]
    return PaddingMask(valid, valid)  # [B, 1, T, T]


def padding_positions(lengths: torch.Tensor, total: int, side: str = "right") -> torch.Tensor:
    """Int64 ``[B, L]`` positions: real tokens count 0..len-1; pads get 0 (they are masked anyway)."""
    valid = _valid(lengths, total, side)  # [B, L]
    return torch.where(valid, valid.long().cumsum(dim=-1) - 1, 0)  # [B, L]
