"""Mask families as boolean predicates, one module each; compose them with ``&`` and ``|``.

Every helper returns a bool mask broadcastable to ``[B, Hq, T, S]`` (True = may attend), ready for
``causal_attention(..., allowed=...)``. It is a ``StructuredMask``: a predicate over positions, document
ids or lengths that kernels summarise per tile (to skip tiles without reading a dense ``[T, S]`` tensor)
and that behaves as the dense bool tensor wherever one is expected (``torch.equal``, indexing, ``&``).
The causal rule itself lives in causal_attention (positions); ``causal_mask`` spells it out for
inspection and plots.

| family     | helper                                   | hides                                    |
|------------|------------------------------------------|------------------------------------------|
| causal     | causal_mask(qpos, kpos)                  | keys after the query                     |
| window     | window_mask(qpos, kpos, w)               | keys outside the last w (own included)   |
| padding    | padding_mask / key_padding_mask(lengths) | pad keys (and pad queries)               |
| documents  | document_mask(query_ids, key_ids)        | keys of other packed documents           |
| none       | causal_attention(..., causal=False)      | nothing (encoders, cross-attention)      |
"""

from engine.masks.causal import CausalMask, causal_mask
from engine.masks.documents import DocumentMask, document_mask, document_positions
from engine.masks.padding import PaddingMask, key_padding_mask, padding_mask, padding_positions
from engine.masks.pairwise import PairwiseMask
from engine.masks.structured import AllOf, AnyOf, DenseMask, Not, StructuredMask, as_structured
from engine.masks.window import WindowMask, window_mask

__all__ = [
    "causal_mask",
    "window_mask",
    "padding_mask",
    "key_padding_mask",
    "padding_positions",
    "document_mask",
    "document_positions",
    "StructuredMask",
    "PairwiseMask",
    "CausalMask",
    "WindowMask",
    "DocumentMask",
    "PaddingMask",
    "DenseMask",
    "AllOf",
    "AnyOf",
    "Not",
    "as_structured",
]
