"""Hugging Face transformers backend: ``attn_implementation="engine"`` runs every attention layer through
``engine.causal_attention``.

    import engine.integrations.transformers            # registers "engine" (pip install 'attention-engine[hf]')
    model = AutoModelForCausalLM.from_config(config, attn_implementation="engine")
    model.set_attn_implementation("engine")            # or switch a loaded model

Registration uses the library's own extension points, nothing is patched:
    - ``AttentionInterface.register("engine", engine_attention_forward)``: the attention function;
    - ``AttentionMaskInterface.register("engine", engine_mask)``: the mask builder.

How the library's arguments become the engine's (one convention: cache index = position within a row):

    library gives (per forward)               engine receives
    q_offset, q_length                        query_positions = q_offset + arange(T)      [T]
    kv_offset, kv_length                      key_positions   = kv_offset + arange(S)     [S]
    causal / bidirectional mask function      causal=True / causal=False
    sliding-window mask function (window w)   allowed = window_mask(...) (w keys, own included)
    2-D padding mask [B, N]                   allowed &= key_valid[:, None, None, :]      [B, 1, 1, S]
    scaling, softcap                          scale=scaling, softcap=softcap
    s_aux / sinks (gpt-oss) [Hq]              sinks=...
    position_bias (T5) [1|B, Hq, T, S]        bias=... (dropped when all zero and not learned)
    an additive float mask with a bias        allowed = not blocked, bias = the mask where not blocked
    dropout (training)                        dropout_p=dropout (torch's default generator)

No ``[B, 1, T, S]`` mask is built for these cases. Any other mask function (packed sequences, block
overlays, chunked attention, custom ``or``/``and`` functions) is evaluated by the library's ``sdpa_mask``
into a dense bool mask and passed as ``allowed`` with ``causal=False``: slower, never wrong.

A query row that sees no key (a left-pad token) returns 0, where eager returns an average of masked values;
real tokens are unaffected because pad keys are masked for them. Attention dropout (a module in training
mode) runs with the engine's own pattern (the same expectation as eager's, not the same random draws).
Attention weights are never materialised: ``output_attentions=True`` warns, and the attention function
returns None for them.

Continuous batching (``model.generate_batch``, ``init_continuous_batching``): transformers' manager accepts only
its own attention names; ``with continuous_batching(model): ...`` routes its calls to the engine
(engine.integrations.transformers.continuous).

A sliding-window cache may hand over more keys than its mask describes (transformers' dynamic sliding layer
keeps every key when ``sliding_window == 1``); the extra keys are the oldest ones, before every query's
window, so they are dropped. Any other disagreement between the mask and the keys raises.
"""

from __future__ import annotations

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("engine.integrations.transformers needs the optional extra: "
                      "pip install 'attention-engine[hf]'") from error

from engine.integrations.transformers.attention import UNSUPPORTED_ATTENTION_KWARGS, engine_attention_forward
from engine.integrations.transformers.continuous import continuous_batch_attention, continuous_batching
from engine.integrations.transformers.mask import EngineMask, engine_mask

__all__ = ["NAME", "UNSUPPORTED_ATTENTION_KWARGS", "EngineMask", "continuous_batch_attention", "continuous_batching",
           "engine_attention_forward", "engine_mask", "register"]

NAME = "engine"


def register(name: str = NAME) -> str:
    """Register the engine under ``name`` in the library's attention and mask registries; returns the name."""
    AttentionInterface.register(name, engine_attention_forward)
    AttentionMaskInterface.register(name, engine_mask)
    return name


register()
