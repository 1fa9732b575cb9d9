"""A paged KV cache's attention: packed queries of many sequences against keys kept in fixed-size pages.

``paged_attention`` (engine.paged.attention) takes FlashInfer's / vLLM's layout (engine.paged.tables: pools
``[num_pages, page_size, Hkv, D]``, a page table, key lengths and query offsets per sequence) and applies the
engine's one rule with each sequence's positions.
"""

from engine.paged.attention import explain_paged, gather_keys, paged_attention

__all__ = ["paged_attention", "explain_paged", "gather_keys"]
