"""The inputs of an attention call: validated, with defaults resolved, before any kernel is chosen.

``prepare_inputs`` turns ``causal_attention``'s arguments into one ``AttentionInputs`` record (no copies of
q, k, v) or raises a ``ValueError`` naming what was expected and what was given. Everything downstream
(dispatch, planning, kernels, merging) reads that record; nothing here imports a kernel.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engine.masks.copies import compact_clone, owned_copy
from engine.masks.key_indices import key_index_mask
from engine.masks.structured import StructuredMask
from engine.modifiers import NONE, Modifiers, check_score_mod_captures, prepare_modifiers
from engine.quantized import QuantizedKV, checked_as_tensors
from engine.shapes import broadcasts_to

__all__ = ["AttentionInputs", "Decisions", "SUPPORTED_DTYPES", "check_allowed", "prepare_inputs", "resolve_positions",
           "resolve_scale"]


UNDECIDED = object()  # a decision not made yet (None is a decision: "no mask", "no prepared run")


class Decisions:
    """What a plan decides once and every run reuses, by name; each is made at its first use, so choosing a kernel
    or explaining a call builds nothing (engine.kernels.visibility, engine.kernels.decode.decode_native,
    engine.planning)."""

    __slots__ = ("visibility_mask", "causal_pattern", "decode_rows", "native_runner", "prepared")

    visibility_mask: Any  # the call's visibility as one structured mask, or None (no mask)
    causal_pattern: Any  # "none" / "causal" / None: what the position rule leaves (no pass over positions when known)
    decode_rows: Any  # the decode kernels' (j0, j1, visible): the span some row sees and each row's visibility
    native_runner: Any  # decode_native's run with its DecodeCall, built at the first run
    prepared: Any  # the chosen kernel's run for a plan (Kernel.prepare), or None

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, UNDECIDED)

    def __repr__(self) -> str:
        made = [name for name in self.__slots__ if getattr(self, name) is not UNDECIDED]
        return f"Decisions(made: {', '.join(made) or 'none'})"


@dataclass(frozen=True)
class AttentionInputs:
    """Validated arguments of causal_attention with defaults resolved.

    q ``[B, Hq, T, D]``, k ``[B, Hkv, S, D]``, v ``[B, Hkv, S, Dv]``; query_positions ``[B, T]`` and
    key_positions ``[B, S]`` (int64, possibly expanded views); allowed is None, a bool tensor
    broadcastable to ``[B, Hq, T, S]``, or a StructuredMask (engine.masks) of such a shape. k and v may
    both be ``QuantizedKV`` (engine.quantized: int8 / fp8 with per-token scales): the option ``"quantized_kv"``;
    modifiers: sinks, ALiBi, bias, score_mod, dropout (engine.modifiers).
    """

    q: torch.Tensor
    k: torch.Tensor | QuantizedKV
    v: torch.Tensor | QuantizedKV
    query_positions: torch.Tensor
    key_positions: torch.Tensor
    allowed: torch.Tensor | None
    scale: float
    causal: bool
    softcap: float | None
    modifiers: Modifiers = NONE
    default_positions: bool = False  # both positions were left to their defaults (queries at the last T keys)
    # Decisions that depend on shapes, positions, masks and modifiers only (never on q, k, v's values): made
    # once, then shared by every AttentionInputs that ``with_tensors`` derives from this one (one plan's runs).
    # ``dataclasses.replace`` starts an empty one, so inputs with other positions or masks never see them.
    decisions: Decisions = field(default_factory=lambda: Decisions(), init=False, repr=False, compare=False)

    def with_tensors(self, q=None, k=None, v=None) -> AttentionInputs:
        """These inputs with other q, k, v of the same shapes (a plan's run, sanitized or rescaled values, autograd's
        saved tensors), sharing the decisions made so far."""
        new = object.__new__(AttentionInputs)  # a copy of every field, decisions included (a plan's hot path:
        new.__dict__.update(self.__dict__)  # dataclasses.replace would validate and rebuild them all)
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x is not None:
                object.__setattr__(new, name, x)
        return new

    def owning(self) -> AttentionInputs:
        """These inputs with their own copies of the positions and the mask (a plan's: what it decides from them is
        then its own, and changing the caller's tensors in place afterwards changes no result of it, whichever
        kernel runs). Broadcast rows stay broadcast; q, k, v and the modifiers' tensors (learned sinks, slopes,
        biases: read at run time) are not copied."""
        return replace(self, query_positions=compact_clone(self.query_positions),
                       key_positions=compact_clone(self.key_positions), allowed=owned_copy(self.allowed))

    def decided(self, name: str, decide: Callable[[], Any]) -> Any:
        """Decision ``name`` (a field of ``Decisions``): ``decide()``, computed once for these inputs and every
        ``with_tensors`` copy."""
        decisions = self.decisions
        value = getattr(decisions, name)  # (an unknown name is an AttributeError: the fields are the list)
        if value is UNDECIDED:
            value = decide()
            setattr(decisions, name, value)
        return value

    def options(self) -> frozenset[str]:
        """The optional parts of this call, by name (``"softcap"``, ...): each kernel lists in ``KERNELS`` the
        options it computes, and a kernel that does not take every option of a call does not fit it. A new
        option is one name here and one in the ``takes`` of each kernel that computes it."""
        names = set()
        if self.softcap is not None:
            names.add("softcap")
        if isinstance(self.k, QuantizedKV):
            names.add("quantized_kv")
        names |= self.modifiers.names()  # alibi, bias, bias_grad, score_mod, dropout
        return frozenset(names)


def prepare_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions: torch.Tensor | None,
    key_positions: torch.Tensor | None,
    allowed: torch.Tensor | None,
    scale: float | None,
    *,
    causal: bool = True,
    softcap: float | None = None,
    **modifiers,
) -> AttentionInputs:
    """Validate the arguments of causal_attention and resolve their defaults (no copies of q, k, v);
    ``modifiers``: sinks, alibi_slopes, bias, score_mod, dropout_p, generator (engine.modifiers)."""
    _check_qkv(q, *checked_as_tensors(q, k, v))
    key_indices = modifiers.pop("key_indices", None)
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool (True: the position rule applies), got {causal!r} "
                         f"({type(causal).__name__})")
    batch, q_heads, t, d = q.shape
    s = k.shape[2]
    query_pos = resolve_positions(query_positions, batch, t, s - t, q.device, "query_positions")  # [B, T]
    key_pos = resolve_positions(key_positions, batch, s, 0, q.device, "key_positions")  # [B, S]
    if allowed is not None:
        check_allowed(allowed, (batch, q_heads, t, s))
        if isinstance(allowed, torch.Tensor) and allowed.device != q.device:  # a dense mask is read where q is
            raise ValueError(f"allowed must be on q's device {q.device}, got {allowed.device}")
    if key_indices is not None:  # top-k sparse attention: a mask family like any other (engine.masks.key_indices)
        listed = key_index_mask(key_indices, s, q_heads)
        if listed.shape[0] not in (1, batch) or listed.shape[2] != t or listed.device != q.device:
            raise ValueError(f"key_indices must be [B|1, Hkv|1, T, K] = [{batch}, .., {t}, K] on {q.device}, got "
                             f"{list(key_indices.shape)} on {key_indices.device}")
        allowed = listed if allowed is None else listed & allowed
    scale = resolve_scale(scale, d)
    if softcap is not None:
        softcap = _real_number(softcap, "softcap")
        if not (softcap > 0 and math.isfinite(softcap)):
            raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
    mods = prepare_modifiers((batch, q_heads, t, s), q.device, **modifiers) if modifiers else NONE
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    check_score_mod_captures(mods.score_mod, query_pos, key_pos, compute)
    return AttentionInputs(q, k, v, query_pos, key_pos, allowed, scale, causal, softcap, mods,
                           default_positions=query_positions is None and key_positions is None)


def resolve_scale(scale, head_dim: int) -> float:
    """The score multiplier as a Python float: ``scale`` (any finite real number: int, float, numpy scalar, 0-d
    tensor without gradient) or ``1 / sqrt(D)`` for None; a ValueError names what was given otherwise (a bool, a
    string, a learned tensor whose gradient would be dropped, inf, NaN)."""
    if scale is None:
        if head_dim == 0:
            raise ValueError("head dim D = 0: the default scale 1 / sqrt(D) is undefined; pass scale explicitly")
        return 1.0 / math.sqrt(head_dim)
    scale = _real_number(scale, "scale")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    return scale


def _real_number(value: object, name: str) -> float:
    """A Python float from a real number (int, float, numpy scalar or 0-d tensor); bools are refused."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        if value.requires_grad:
            raise ValueError(f"{name} is a tensor that requires grad: a learned {name} is not supported "
                             f"(its gradient would be dropped); fold it into q or pass a number")
        if value.device.type == "meta":
            raise ValueError(f"{name} is a meta tensor: it has no value; pass a number")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    return float(value)


# The dtypes every kernel computes exactly (scores in fp32, fp64 for fp64); fp8 and others are refused.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            layout = "[B, Hq, T, D]" if name == "q" else "[B, Hkv, S, D]" if name == "k" else "[B, Hkv, S, Dv]"
            raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(x.shape)}")
        if x.dtype not in SUPPORTED_DTYPES:
            supported = ", ".join(str(dtype).removeprefix("torch.") for dtype in SUPPORTED_DTYPES)
            raise ValueError(f"{name} must have dtype {supported}, got {x.dtype} (cast fp8 or integer inputs first)")
        if x.device.type == "meta":
            raise ValueError(f"{name} is a meta tensor: attention needs its values (got device {x.device})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    batch, q_heads, _, d = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"batch size mismatch: q has B={batch}, k has B={k.shape[0]}, v has B={v.shape[0]}")
    kv_heads, s = k.shape[1], k.shape[2]
    if v.shape[1] != kv_heads:
        raise ValueError(f"k and v must have the same number of heads, got Hkv={kv_heads} and {v.shape[1]}")
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"Query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    if k.shape[3] != d:
        raise ValueError(f"head dim mismatch: q has D={d}, k has D={k.shape[3]}")
    if v.shape[2] != s:
        raise ValueError(f"key length mismatch: k has S={s}, v has S={v.shape[2]}")


def resolve_positions(
    positions: torch.Tensor | None, batch: int, length: int, start: int, device: torch.device, name: str
) -> torch.Tensor:
    """Return int64 positions of shape ``[B, length]``; ``None`` means ``start .. start+length-1``."""
    if positions is None:
        return torch.arange(start, start + length, device=device).expand(batch, length)  # [B, L]
    check_positions(positions, batch, length, name)
    return positions.to(device=device, dtype=torch.long).expand(batch, length)  # [B, L]


def check_positions(positions: object, batch: int, length: int, name: str) -> None:
    """ValueError unless ``positions`` is an integer tensor of shape ``[length]`` or ``[batch, length]`` with values
    (not a meta tensor)."""
    if not isinstance(positions, torch.Tensor):
        raise ValueError(f"{name} must be an integer tensor of shape [{length}] or [{batch}, {length}], "
                         f"got {type(positions).__name__}")
    dtype = positions.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise ValueError(f"{name} must have an integer dtype, got {dtype}")
    if positions.is_meta:
        raise ValueError(f"{name} is a meta tensor: positions need values (got device {positions.device})")
    if not ((positions.dim() == 1 and positions.shape[0] == length)
            or (positions.dim() == 2 and tuple(positions.shape) == (batch, length))):
        raise ValueError(f"{name} must have shape [{length}] or [{batch}, {length}], got {tuple(positions.shape)}")


def check_allowed(allowed: torch.Tensor | StructuredMask, full: tuple[int, int, int, int]) -> None:
    """ValueError unless ``allowed`` is a bool tensor or StructuredMask broadcastable to ``full`` = [B, Hq, T, S]."""
    if not isinstance(allowed, (torch.Tensor, StructuredMask)) or allowed.dtype != torch.bool:
        kind = allowed.dtype if isinstance(allowed, torch.Tensor) else type(allowed).__name__
        raise ValueError(f"allowed must be a bool tensor broadcastable to [B, Hq, T, S] = {list(full)}, "
                         f"got {kind}")
    if not broadcasts_to(allowed.shape, full):
        raise ValueError(f"allowed must be broadcastable to [B, Hq, T, S] = {list(full)}, "
                         f"got shape {list(allowed.shape)}")
