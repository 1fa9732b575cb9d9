"""Packed documents: a query sees only keys of its own document.

Several documents packed into one training row, described by per-token document ids::

    document_ids = [0, 0, 1, 1, 1, 2]       # offsets [0, 2, 5, 6]
    document_mask(ids) & causal  ->  block-diagonal lower triangles

Compose with the causal rule of causal_attention (global positions) or pass
``document_positions(ids)`` as positions so that each document restarts at position 0 (for RoPE).
"""

from __future__ import annotations

import torch

from engine.masks.pairwise import PairwiseMask


class DocumentMask(PairwiseMask):
    """``query_id == key_id``. Per tile: some pair may match if the id ranges overlap; every pair matches if
    both sides hold one and the same id."""

    name = "document"

    def relate(self, q, k):
        return q == k

    def bounds(self, q_lo, q_hi, k_lo, k_hi):
        return (q_lo <= k_hi) & (k_lo <= q_hi), (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)


def document_mask(query_document_ids: torch.Tensor, key_document_ids: torch.Tensor | None = None) -> DocumentMask:
    """Bool ``[T, S]`` (``[B, 1, T, S]`` for ``[B, L]`` ids): True where the two tokens share a document.

    A StructuredMask: with contiguous documents, kernels skip every tile that spans two different ones.
    """
    if key_document_ids is None:
        key_document_ids = query_document_ids
    return DocumentMask(query_document_ids, key_document_ids)


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 at each document start: ids ``[0, 0, 1, 1, 1]`` -> ``[0, 1, 0, 1, 2]``.

    Ids must be non-decreasing along the last axis (documents are contiguous).
    """
    if document_ids.dim() not in (1, 2):
        raise ValueError(f"document_ids must be [L] or [B, L], got shape {tuple(document_ids.shape)}")
    if bool((document_ids.diff(dim=-1) < 0).any()):
        raise ValueError("document_ids must be non-decreasing along the sequence (contiguous documents)")
    length = document_ids.shape[-1]
    index = torch.arange(length, device=document_ids.device).expand_as(document_ids)  # [..., L]
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]  # first token of each document
    start_index = torch.where(starts, index, 0).cummax(dim=-1).values  # index of the document's first token
    return index - start_index
