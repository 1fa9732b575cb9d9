"""transformers' DeepSeek V2 / V3 weights decoded with the engine's absorbed MLA over a latent cache.

transformers runs MLA expanded: every step it rebuilds each head's keys and values from the cached latents (H (n + r
+ v) numbers per key and layer). ``generate_absorbed`` runs the same checkpoint's blocks (norms, MLP or MoE, head)
with each attention as an ``engine.latent.LatentAttention`` holding that layer's weights: the prompt expanded, every
decode step absorbed against a latent ``KVCache`` (or, ``page_size=``, a latent ``PagedKVCache`` read in place),
R + r numbers per key and layer::

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path)            # a DeepseekV3ForCausalLM (or V2)
    tokens = generate_absorbed(model, ids, max_new_tokens=16)     # greedy, as model.generate(do_sample=False)

Rows of ``ids`` are unpadded and of one length. RoPE must be plain (``rope_type`` "default"): a YaRN-scaled model
is refused rather than decoded with other frequencies.
"""

from __future__ import annotations

import torch

from engine.latent import LatentAttention
from engine.paged.step import begin_step

__all__ = ["latent_layers", "generate_absorbed"]


def latent_layers(model) -> list[LatentAttention]:
    """One ``LatentAttention`` per decoder layer of ``model`` (a transformers DeepSeek V2 / V3 model), holding that
    layer's attention weights, in the model's dtype and device."""
    config = model.config
    needed = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank")
    missing = [name for name in needed if not hasattr(config, name)]
    if missing:
        raise ValueError(f"this model has no multi-head latent attention (its config lacks {', '.join(missing)}): "
                         f"got {type(model).__name__}")
    rope = getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": config.rope_theta}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"generate_absorbed takes plain RoPE (rope_type 'default'), got {rope.get('rope_type')!r}: "
                         f"its frequencies would differ from the checkpoint's")
    layers = []
    for block in model.model.layers[: config.num_hidden_layers]:
        attention = block.self_attn
        weight = attention.kv_a_proj_with_mqa.weight
        layer = LatentAttention(config.hidden_size, config.num_attention_heads, config.kv_lora_rank,
                                config.q_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
                                config.v_head_dim, rope_base=float(rope["rope_theta"]),
                                rope_pairing="interleaved" if getattr(config, "rope_interleave", True) else "half",
                                scale=attention.scaling, eps=config.rms_norm_eps,
                                bias=bool(getattr(config, "attention_bias", False)))
        layer.load_state_dict(attention.state_dict())
        layers.append(layer.to(weight.dtype).to(weight.device).eval())
    return layers


@torch.no_grad()
def generate_absorbed(model, ids: torch.Tensor, max_new_tokens: int, page_size: int | None = None) -> torch.Tensor:
    """Greedy tokens ``[B, T + max_new_tokens]``: ``ids [B, T]`` then the new ones, the prompt expanded and each
    decode step absorbed over latent caches (``page_size``: a paged latent cache of every layer)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long or ids.shape[1] == 0:
        raise ValueError(f"ids must be an int64 tensor [B, T] with T >= 1, got "
                         f"{getattr(ids, 'dtype', type(ids).__name__)} {list(getattr(ids, 'shape', []))}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    layers = latent_layers(model)
    batch, total = ids.shape[0], ids.shape[1] + max_new_tokens
    if page_size is None:
        caches = [layer.new_cache(batch, total) for layer in layers]
    else:
        paged = layers[0].new_paged_cache(batch * -(-total // page_size), page_size, layers=len(layers))
        seqs = [paged.add() for _ in range(batch)]
    tokens, new = ids, ids
    for _ in range(max_new_tokens):
        hidden = model.model.embed_tokens(new)  # [B, t, E]
        if page_size is not None:
            t = new.shape[1]
            step = begin_step(paged, seqs, torch.arange(0, batch * t + 1, t))
            hidden = hidden.reshape(batch * t, -1)  # packed [B * t, E]
        for i, (block, layer) in enumerate(zip(model.model.layers, layers)):
            normed = block.input_layernorm(hidden)
            hidden = hidden + (layer(normed, cache=caches[i]) if page_size is None else
                               layer.forward_paged(normed, paged, step=step, layer=i))
            hidden = hidden + block.mlp(block.post_attention_layernorm(hidden))
        last = hidden[:, -1] if page_size is None else hidden.view(batch, new.shape[1], -1)[:, -1]
        new = model.lm_head(model.model.norm(last)).argmax(-1, keepdim=True)  # [B, 1]
        tokens = torch.cat([tokens, new], dim=1)
    return tokens
