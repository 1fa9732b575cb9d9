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

A sliding-window cache may hand over more keys than its mask describes (transformers' dynamic sliding layer
keeps every key when ``sliding_window == 1``); the extra keys are the oldest ones, before every query's
window, so they are dropped. Any other disagreement between the mask and the keys raises.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field

import torch

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        AttentionMaskInterface,
        bidirectional_mask_function,
        causal_mask_function,
        sdpa_mask,
    )
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("engine.integrations.transformers needs the optional extra: "
                      "pip install 'attention-engine[hf]'") from error

from engine.attention import causal_attention
from engine.masks.padding import PaddingMask
from engine.masks.window import window_mask
from engine.planning import AttentionPlan, plan

__all__ = ["NAME", "EngineMask", "engine_attention_forward", "engine_mask", "register"]

NAME = "engine"


@dataclass(frozen=True)
class EngineMask:
    """What the mask builder hands to the attention function instead of a dense mask.

    query_positions: int64 ``[T]``; key_positions: int64 ``[S]`` (cache indices, the same for every row).
    causal: the position rule ``key_pos <= query_pos`` applies.
    window: keys seen per query counting itself, or None.
    key_valid: bool ``[B, S]`` (False at padding) or None when every key is real.
    dense: bool ``[B, 1, T, S]`` from the library's ``sdpa_mask`` for mask functions the engine does not
        recognise (then ``causal`` is False and ``dense`` is the whole rule), else None.
    """

    query_positions: torch.Tensor
    key_positions: torch.Tensor
    causal: bool
    window: int | None = None
    key_valid: torch.Tensor | None = None
    dense: torch.Tensor | None = None
    plans: dict = field(default_factory=dict, compare=False, repr=False)  # this step's plans (plan_for)

    ndim = 4  # with ``shape``, the library treats an EngineMask passed back into a model as a prepared 4-D mask

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, 1, T, S)``, the shape of the dense mask this object stands for (B = 1 without padding)."""
        batch = 1 if self.key_valid is None else self.key_valid.shape[0]
        return (batch, 1, self.query_positions.shape[0], self.key_positions.shape[0])

    def plan_for(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                 softcap: float | None, sinks: torch.Tensor | None, bias: torch.Tensor | None) -> AttentionPlan:
        """The plan of this step's attention calls with these shapes and arguments: made by the first layer that
        asks (positions resolved, mask and kernel decided once), reused by every other layer of the forward.
        A layer's own sinks or bias (a tensor per layer) gets a plan of its own."""
        grads = (query.requires_grad, key.requires_grad, value.requires_grad, torch.is_grad_enabled())
        plan_key = (query.shape, key.shape, value.shape, query.dtype, query.device, grads, scale, softcap, id(sinks),
                    id(bias))
        found = self.plans.get(plan_key)
        if found is None:
            found = plan(query, key, value, self.query_positions, self.key_positions, self.allowed(), scale,
                         causal=self.causal, softcap=softcap, sinks=sinks, bias=bias)
            self.plans[plan_key] = found
        return found

    def allowed(self) -> torch.Tensor | None:
        """Bool mask broadcastable to ``[B, Hq, T, S]`` for causal_attention, or None (position rule only)."""
        if self.dense is not None:
            return self.dense  # [B, 1, T, S]
        allowed = None
        if self.window is not None:
            allowed = window_mask(self.query_positions, self.key_positions, self.window)  # [T, S]
        if self.key_valid is not None:
            keys_ok = PaddingMask(None, self.key_valid)  # [B, 1, 1, S], a structured mask: pad tiles are skipped
            allowed = keys_ok if allowed is None else allowed & keys_ok  # [B, 1, T, S]
        return allowed


def _closure(fn) -> dict:
    try:
        return inspect.getclosurevars(fn).nonlocals
    except TypeError:
        return {}


def _sliding_window_of(mask_function) -> int | None:
    """The window w if ``mask_function`` is the library's ``and_masks(sliding_window_overlay(w), causal)``."""
    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    parts = tuple(_closure(mask_function).get("mask_functions", ()))
    if len(parts) != 2 or causal_mask_function not in parts:
        return None
    overlay = parts[0] if parts[1] is causal_mask_function else parts[1]
    if getattr(overlay, "__qualname__", "") != "sliding_window_overlay.<locals>.inner_mask":
        return None
    window = _closure(overlay).get("sliding_window")
    return window if isinstance(window, int) and window > 0 else None


def _recognise(mask_function, local_size: int | None) -> tuple[bool, int | None] | None:
    """``(causal, window)`` for the mask functions the engine expresses without a dense mask, else None."""
    if mask_function is causal_mask_function:
        return True, None
    if mask_function is bidirectional_mask_function:
        return False, None
    window = _sliding_window_of(mask_function)
    if window is not None and window == local_size:
        return True, window
    return None


def _key_valid(attention_mask: torch.Tensor | None, kv_length: int, kv_offset: int) -> torch.Tensor | None:
    """Bool ``[B, S]`` slice of the 2-D padding mask for the keys ``kv_offset .. kv_offset+S-1``; None if all real."""
    if attention_mask is None:
        return None
    padding = attention_mask.to(torch.bool)  # [B, N]
    missing = kv_offset + kv_length - padding.shape[-1]
    if missing > 0:  # static caches have slots past the mask: they are empty, so not real keys
        padding = torch.nn.functional.pad(padding, (0, missing), value=False)  # [B, kv_offset + S]
    key_valid = padding[:, kv_offset:kv_offset + kv_length]  # [B, S]
    return None if bool(key_valid.all()) else key_valid


def engine_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    device: torch.device | str = "cpu",
    **kwargs,
) -> EngineMask:
    """The library's mask-interface signature (see ``transformers.masking_utils.sdpa_mask``); returns an
    ``EngineMask`` of positions, window and key padding instead of a ``[B, 1, T, S]`` tensor when it can.

    attention_mask: the 2-D padding mask ``[B, N]`` (True/1 at real tokens), indexed by cache slot; or an
        EngineMask made earlier for the same step (``generate`` with a static cache builds masks ahead of the
        forward pass and hands them back to the model), which is returned unchanged.
    """
    if isinstance(attention_mask, EngineMask):
        return attention_mask
    if isinstance(q_offset, torch.Tensor):  # static caches give a 0-d tensor (no graph break under compile)
        if q_offset.numel() != 1 or q_offset.is_floating_point():
            raise ValueError(f"q_offset must be an int or a one-element integer tensor (one offset for every row), "
                             f"got a {q_offset.dtype} tensor of shape {tuple(q_offset.shape)}")
        q_offset = q_offset.reshape(())
    query_positions = q_offset + torch.arange(q_length, device=device)  # [T]
    key_positions = kv_offset + torch.arange(kv_length, device=device)  # [S]
    recognised = _recognise(mask_function, local_size)
    if recognised is None:
        dense = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                          kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                          allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                          use_vmap=kwargs.get("use_vmap", False), device=device)  # [B, 1, T, S]
        return EngineMask(query_positions, key_positions, causal=False, dense=dense)
    causal, window = recognised
    return EngineMask(query_positions, key_positions, causal=causal, window=window,
                      key_valid=_key_valid(attention_mask, kv_length, kv_offset))


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
UNSUPPORTED_ATTENTION_KWARGS = ("indices", "block_indices")


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
            bias ``[1|B, Hq, T, S]``).

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
        step_plan = attention_mask.plan_for(query, key, value, scaling, softcap, sinks, bias)
        out = step_plan.run(query, key, value)  # [B, Hq, T, Dv]
    else:  # a dropout call draws its own pattern per layer; a dense or absent mask is planned per call
        out = causal_attention(query, key, value, query_positions, key_positions, allowed, scaling, causal=causal,
                               softcap=softcap, sinks=sinks, bias=bias, dropout_p=dropout)  # [B, Hq, T, Dv]
    return out.transpose(1, 2).contiguous(), None  # [B, T, Hq, Dv]


def register(name: str = NAME) -> str:
    """Register the engine under ``name`` in the library's attention and mask registries; returns the name."""
    AttentionInterface.register(name, engine_attention_forward)
    AttentionMaskInterface.register(name, engine_mask)
    return name


register()
