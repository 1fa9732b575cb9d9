"""attention-engine: attention from first principles, readable references and fast exact kernels.

Glossary (every shape comment in the package uses it):
    B   batch                     T   queries (new tokens)
    Hq  query heads               S   keys (cached + new tokens)
    Hkv key/value heads           D   head dim of q and k;  Dv  head dim of v
    G = Hq // Hkv: query head h reads KV head h // G.

Visibility, stated once: key j is visible to query i iff key_positions[j] <= query_positions[i]
(and allowed[i, j]); rows that see nothing output 0.

The transformers backend is opt-in: ``import engine.integrations.transformers`` registers "engine".
"""

from engine.attention import causal_attention, merge_heads, split_heads, window_mask
from engine.invariance import is_batch_invariant, set_batch_invariant
from engine.kernels import KernelChoice, SlowPathWarning, merge_attention_states
from engine.kv_cache import KVCache, kv_cache_bytes
from engine.layer import MultiHeadAttention
from engine.masks import (
    causal_mask,
    document_mask,
    document_positions,
    key_padding_mask,
    padding_mask,
    padding_positions,
)
from engine.masks.structured import StructuredMask, as_structured
from engine.paged import PagedKVCache, PagedPlan, explain_paged, paged_attention, plan_paged
from engine.planning import AttentionPlan, explain, plan
from engine.relative_bias import RelativePositionBias
from engine.rope import apply_rope, rope_frequencies
from engine.softmax import naive_softmax, online_softmax, stable_softmax

__all__ = [
    "causal_attention",
    "plan",
    "AttentionPlan",
    "explain",
    "set_batch_invariant",
    "is_batch_invariant",
    "paged_attention",
    "plan_paged",
    "PagedPlan",
    "explain_paged",
    "PagedKVCache",
    "merge_attention_states",
    "KernelChoice",
    "SlowPathWarning",
    "split_heads",
    "merge_heads",
    "causal_mask",
    "window_mask",
    "padding_mask",
    "key_padding_mask",
    "padding_positions",
    "document_mask",
    "document_positions",
    "StructuredMask",
    "as_structured",
    "RelativePositionBias",
    "MultiHeadAttention",
    "KVCache",
    "kv_cache_bytes",
    "apply_rope",
    "rope_frequencies",
    "stable_softmax",
    "naive_softmax",
    "online_softmax",
]
