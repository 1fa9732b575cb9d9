"""The attention function of the transformers backend: ``engine_attention_forward`` (the library's attention-function
signature) runs each layer's attention on the engine, through its step's plan when the mask is an ``EngineMask``.
"""

from __future__ import annotations

import warnings

import torch

from engine.attention import causal_attention
from engine.integrations.transformers.mask import EngineMask
from engine.masks.window import window_mask

__all__ = ["UNSUPPORTED_ATTENTION_KWARGS", "engine_attention_forward"]


def _dense_to_allowed(mask: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A 4-D mask from the caller as ``(allowed, bias or None)``: bool as is; an additive float mask's very
    negative entries hide their keys, and any other value it holds is a bias on the visible ones."""
    if mask.dim() != 4:
        raise ValueError(f"a tensor attention_mask must be 4-D [B, 1, T, S], got shape {tuple(mask.shape)}")
    if mask.shape[-1] < s:  # a last dimension of 1 would broadcast one key's entry over every key
        raise ValueError(f"a 4-D attention_mask must cover the S={s} keys in its last dimension, "
                         f"got shape {tuple(mask.shape)}")
    mask = mask[..., :s]  # [B, 1 or H, T, S]
    if mask.dtype == torch.bool:
        return mask, None
    blocked = mask <= torch.finfo(mask.dtype).min / 2  # [B, 1 or H, T, S]
    if bool(((mask == 0) | blocked).all()):
        return ~blocked, None
    return ~blocked, mask.masked_fill(blocked, 0.0)  # [B, 1 or H, T, S]: the bias on the visible keys


def _keys_the_mask_describes(mask: EngineMask, key: torch.Tensor, value: torch.Tensor, t: int
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``key``/``value`` cut to the S keys ``mask`` describes, or a ValueError saying what disagrees.

    A sliding-window cache may return more keys than its mask sizes announce: transformers'
    ``DynamicSlidingWindowLayer`` keeps the last ``sliding_window - 1`` keys with the slice ``[-w + 1:]``, which
    for ``w == 1`` is ``[0:]``, every key. The mask's keys are then the last S (the cache is the newest part of
    the row), and the extra keys come before ``key_positions[0]``; when that is at most
    ``min(query_positions) - w + 1`` they lie outside every query's window and dropping them changes nothing::

        w = 1, decode at position 12: keys 0 1 ... 11 12   mask: kv_offset=12, S=1   ->  keep key 12
    """
    mask_t, mask_s, s = mask.query_positions.shape[0], mask.key_positions.shape[0], key.shape[2]
    if mask_t == t and mask_s == s:
        return key, value
    extra = s - mask_s
    older_than_every_window = (
        mask_t == t > 0 and extra > 0 and mask.causal and mask.window is not None and mask.dense is None
        and int(mask.key_positions[0]) <= int(mask.query_positions.min()) - mask.window + 1)
    if older_than_every_window:
        return key[:, :, extra:], value[:, :, extra:]  # [B, Hkv, S_mask, D]
    raise ValueError(
        f"the attention mask was built for T={mask_t} queries and S={mask_s} keys but the layer got T={t} queries "
        f"and S={s} keys; extra keys are dropped only when they are older than every query's sliding window "
        f"(window={mask.window}), and these are not. Build the mask for this forward pass (let the model build it "
        "from its cache), or run without a cache (use_cache=False)")


# Keywords some models pass to their attention function that change the result; the engine refuses them.
UNSUPPORTED_ATTENTION_KWARGS = ("block_indices",)


def _bias_of(position_bias: torch.Tensor | None, s: int) -> torch.Tensor | None:
    """T5's ``position_bias [1|B, Hq, T, S']`` for the S keys the layer attends to (its last S), or None when it
    is all zero and not learned (T5's layers without a relative bias pass zeros)."""
    if position_bias is None:
        return None
    if position_bias.dim() != 4 or position_bias.shape[-1] < s:
        raise ValueError(f"position_bias must be 4-D [B, Hq, T, S] covering the S={s} keys, "
                         f"got shape {tuple(position_bias.shape)}")
    bias = position_bias[..., position_bias.shape[-1] - s:]  # [1|B, Hq, T, S]
    if not bias.requires_grad and not bool(bias.any()):
        return None
    return bias


def engine_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: EngineMask | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The library's attention-function signature, computed by ``causal_attention``.

    Args:
        query: ``[B, Hq, T, D]``; key: ``[B, Hkv, S, D]``; value: ``[B, Hkv, S, Dv]`` (cache included).
        attention_mask: an ``EngineMask`` (from ``engine_mask``), a 4-D bool/additive mask, or None
            (then ``is_causal`` / ``module.is_causal`` and ``sliding_window`` decide, with the queries at
            the last T key positions).
        dropout: attention dropout probability (training).
        scaling: score multiplier; softcap: Gemma-2 score cap.
        kwargs: ``s_aux`` or ``sinks`` ``[Hq]`` (gpt-oss attention sinks), ``position_bias`` (T5's relative
            bias ``[1|B, Hq, T, S]``), ``indices`` int ``[B, T, topk]`` (DeepSeek V3.2's / GLM-MoE-DSA's top-k keys
            per query: the engine's ``key_indices``, never a dense mask).

    Returns:
        ``(out [B, T, Hq, Dv], None)``: attention weights are never materialised for the caller
        (``output_attentions=True`` warns; use ``attn_implementation="eager"`` to get them).
    """
    if kwargs.get("output_attentions"):
        warnings.warn("attn_implementation='engine' never materialises attention weights: output_attentions=True "
                      "gives None / an empty tuple for them. To get the weights, run that call with "
                      "attn_implementation='eager' (model.set_attn_implementation('eager'))", UserWarning,
                      stacklevel=2)
    for name in UNSUPPORTED_ATTENTION_KWARGS:  # each changes the scores: ignoring it would be silently wrong
        if kwargs.get(name) is not None:
            raise ValueError(f"the engine attention does not support {name!r} (a score bias, attention sinks or a "
                             "sparse selection); use attn_implementation='eager' for this model")
    t = query.shape[2]
    query_positions = key_positions = allowed = mask_bias = None
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    key_indices = kwargs.get("indices")  # [B, T, topk] (DeepSeek V3.2's indexer): one list for every head
    key_indices = None if key_indices is None else key_indices[:, None]  # [B, 1, T, topk]
    if isinstance(attention_mask, EngineMask):
        key, value = _keys_the_mask_describes(attention_mask, key, value, t)  # [B, Hkv, S, D]
        query_positions, key_positions = attention_mask.query_positions, attention_mask.key_positions
        causal = attention_mask.causal
        allowed = None if not dropout else attention_mask.allowed()  # planned calls build it once, in plan_for
    elif attention_mask is None:
        s = key.shape[2]
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        if sliding_window is not None and not causal:
            raise ValueError(f"sliding_window={sliding_window} with is_causal=False and no attention_mask: the engine "
                             "applies a window without a mask only to causal attention (a bidirectional window has "
                             "other conventions); pass the model's 4-D attention_mask")
        if sliding_window is not None:  # queries at the last T key positions, as causal_attention's default
            allowed = window_mask(torch.arange(s - t, s, device=query.device),
                                  torch.arange(s, device=query.device), sliding_window)  # [T, S]
    elif isinstance(attention_mask, torch.Tensor):
        causal = False  # the mask holds the whole rule
        allowed, mask_bias = _dense_to_allowed(attention_mask, key.shape[2])
    else:
        raise ValueError(f"attention_mask must be an EngineMask, a 4-D tensor or None, "
                         f"got {type(attention_mask).__name__}")
    bias = _bias_of(kwargs.get("position_bias"), key.shape[2])
    if mask_bias is not None:
        bias = mask_bias if bias is None else bias + mask_bias
    if isinstance(attention_mask, EngineMask) and not dropout:  # planned once per forward, run by every layer
        step_plan = attention_mask.plan_for(query, key, value, scaling, softcap, sinks, bias, key_indices)
        out = step_plan.run(query, key, value)  # [B, Hq, T, Dv]
    else:  # a dropout call draws its own pattern per layer; a dense or absent mask is planned per call
        out = causal_attention(query, key, value, query_positions, key_positions, allowed, scaling, causal=causal,
                               softcap=softcap, sinks=sinks, bias=bias, dropout_p=dropout,
                               key_indices=key_indices)  # [B, Hq, T, Dv]
    return out.transpose(1, 2).contiguous(), None  # [B, T, Hq, Dv]
