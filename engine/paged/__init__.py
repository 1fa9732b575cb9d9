"""A paged KV cache's attention: packed queries of many sequences against keys kept in fixed-size pages.

``paged_attention`` (engine.paged.attention) takes FlashInfer's / vLLM's layout (engine.paged.tables: pools
``[num_pages, page_size, Hkv, D]``, a page table, key lengths and query offsets per sequence) and applies the
engine's one rule with each sequence's positions; ``plan_paged`` (engine.paged.plan) plans such a step once for
every layer; ``PagedKVCache`` (engine.paged.cache) keeps the pools and each sequence's pages (add, append packed
tokens, fork with shared pages and copy on write, free, roll back).
"""

from engine.paged.attention import explain_paged, gather_keys, paged_attention
from engine.paged.cache import PagedKVCache
from engine.paged.plan import PagedPlan, plan_paged

__all__ = ["paged_attention", "plan_paged", "PagedPlan", "explain_paged", "gather_keys", "PagedKVCache"]
