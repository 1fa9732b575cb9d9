"""The mask builder of the transformers backend: ``engine_mask`` (the library's mask-interface signature) turns
the library's description of a step's mask into an ``EngineMask`` of positions, window and key padding (no
``[B, 1, T, S]`` tensor), and keeps the step's attention plans (engine.planning): the first layer plans, the
others reuse.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from transformers.masking_utils import bidirectional_mask_function, causal_mask_function, sdpa_mask

from engine.masks.padding import PaddingMask
from engine.masks.window import window_mask
from engine.planning import AttentionPlan, Same, plan, reuse

__all__ = ["EngineMask", "engine_mask"]


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
                 softcap: float | None, sinks: torch.Tensor | None, bias: torch.Tensor | None,
                 key_indices: torch.Tensor | None = None) -> AttentionPlan:
        """The plan of this step's attention calls with these shapes and arguments: made by the first layer that
        asks (positions resolved, mask and kernel decided once), reused by every other layer of the forward.
        A layer's own sinks, bias or top-k key indices (a tensor per layer) gets a plan of its own."""
        context = (scale, softcap, Same(sinks), Same(bias), getattr(bias, "requires_grad", False), Same(key_indices))
        indices = {} if key_indices is None else {"key_indices": key_indices}
        return reuse(self.plans, context, (query, key, value),
                     lambda: plan(query, key, value, self.query_positions, self.key_positions, self.allowed(), scale,
                                  causal=self.causal, softcap=softcap, sinks=sinks, bias=bias, **indices))

    def to_dense(self) -> torch.Tensor:
        """The rule as the bool ``[B|1, 1, T, S]`` tensor it stands for (True: visible), materialised: what a model
        that reads its mask (DeepSeek V3.2's indexer: ``attention_mask[:, 0]``) gets by indexing this object."""
        if self.dense is not None:
            return self.dense
        visible = torch.ones(self.query_positions.shape[0], self.key_positions.shape[0], dtype=torch.bool,
                             device=self.query_positions.device)  # [T, S]
        if self.causal:
            visible = self.key_positions[None, :] <= self.query_positions[:, None]
        allowed = self.allowed()
        if allowed is not None:
            visible = visible & (allowed.to_dense() if hasattr(allowed, "to_dense") else allowed)
        return visible.reshape((1,) * (4 - visible.dim()) + tuple(visible.shape))  # [B|1, 1, T, S]

    def __getitem__(self, index) -> torch.Tensor:
        return self.to_dense()[index]

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
