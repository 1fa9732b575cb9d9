"""Plan once, run many: everything an attention call decides before it reads q, k and v's values.

A model calls attention in every layer of every step with the same shapes, positions and masks; only q, k, v
change. ``plan(...)`` takes ``causal_attention``'s arguments (q, k, v are read for their shapes, dtypes,
device and whether they need gradients, never for their values), validates them, resolves positions and
chooses the kernel, once; ``plan.run(q, k, v)`` checks that the tensors are the ones planned for and runs::

    step_plan = engine.plan(q, k, v, query_positions, key_positions, allowed)   # once per step
    for layer in layers:
        out = step_plan.run(q_layer, k_layer, v_layer)                         # every layer

    print(step_plan)            # the kernel, why, and why not the faster ones (engine.explain shows the same)

What the plan keeps (``engine.inputs.Decisions``, named fields): the visibility mask, its causal pattern, the decode
kernels' span of keys and each row's visibility, the native kernel's call and the chosen kernel's prepared run; each
is made at its first use (choosing or explaining builds nothing) and every later run reuses it. ``sdpa_tiles`` and
``tiled`` still work out their tiles on each run. ``causal_attention`` is ``plan(...).run(q, k, v)``; a call with
default positions and no mask or modifier reuses a cached plan for its shapes, as does one whose positions hide no
key (engine.attention.hides_no_key). A paged step (page tables, key lengths, query offsets) is planned the same way
by ``engine.plan_paged`` (engine.paged.plan), whose runs compare the same ``Signature``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.inputs import AttentionInputs, prepare_inputs
from engine.kernels.common import DoesNotFit, needs_grad
from engine.kernels.dispatch import KernelChoice, check_kernel_name, choose, environment, execute, prepared
from engine.modifiers import NONE
from engine.quantized import QuantizedKV

__all__ = ["AttentionPlan", "Signature", "TensorSignature", "plan", "plan_for_call", "explain", "signature_of",
           "reuse", "Same"]

TENSORS = (torch.Tensor, QuantizedKV)  # what q, k, v may be


class TensorSignature(NamedTuple):
    """What a plan knows of one of q, k, v: a QuantizedKV or a tensor, its shape, its element dtype (a QuantizedKV's
    int8 / fp8 entries; its scales are fp32 by construction) and its device."""

    quantized: bool
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


class Signature(NamedTuple):
    """The tensors a plan is made for, whole: the one record the plan cache's key and ``AttentionPlan.run``
    compare. Strides are not in it: no kernel keeps a layout from planning (decode_native reads each run's strides;
    the others take any)."""

    q: TensorSignature
    k: TensorSignature
    v: TensorSignature


@dataclass(frozen=True)
class AttentionPlan:
    """A validated call with its kernel chosen: ``run(q, k, v)`` (or call it) for tensors of the planned shapes,
    dtypes and device, with or without gradients as planned.

    inputs: the validated arguments (positions resolved; q, k, v as meta placeholders: a plan holds no tensor
    of the call); choice: the kernel and the reasons (``print(plan)``); grad: planned for a call whose gradient
    autograd wants (of q, k, v or a learned bias); signature: each tensor's kind, shape, dtype and device planned
    for (``Signature``).
    """

    inputs: AttentionInputs
    choice: KernelChoice
    grad: bool
    signature: Signature

    @property
    def kernel(self) -> str:
        return self.choice.kernel

    @property
    def reason(self) -> str:
        return self.choice.reason

    @property
    def passed_over(self) -> dict[str, str]:
        return self.choice.passed_over

    @property
    def modifiers(self) -> list[str]:
        return self.choice.modifiers

    def run(self, q: torch.Tensor, k, v, *, return_lse: bool = False):
        """``out [B, Hq, T, Dv]`` in q's dtype (``(out, lse)`` with ``return_lse``), for q, k, v of the planned
        shapes, dtypes and device; a ValueError names what differs from the plan otherwise."""
        if not self.matches(q, k, v):
            self._refuse(q, k, v)
        return self._run_made_for(q, k, v, return_lse)

    __call__ = run

    def _run_made_for(self, q, k, v, return_lse: bool):
        """``run`` for the tensors this plan was made or found for (``causal_attention``: no check to repeat)."""
        fast = self.inputs.decided("prepared", lambda: prepared(self.inputs, self.choice.kernel))
        if fast is not None:
            try:
                out, lse = fast(q, k, v, return_lse)
                return (out, lse) if return_lse else out
            except DoesNotFit:  # found while running (NaN in q): the general path below falls back as it does
                pass
        out, lse = execute(self.inputs.with_tensors(q, k, v), self.choice.kernel, return_lse)
        return (out, lse) if return_lse else out

    def matches(self, q, k, v) -> bool:
        """True when q, k, v are tensors this plan was made for (each one's kind, shape, dtype and device, and the
        gradient need)."""
        if not (isinstance(q, torch.Tensor) and isinstance(k, TENSORS) and isinstance(v, TENSORS)):
            return False
        return signature_of(q, k, v) == self.signature and _wants_grad(self.inputs, q, k, v) == self.grad

    def _refuse(self, q, k, v) -> None:
        for name, x, kinds in (("q", q, torch.Tensor), ("k", k, TENSORS), ("v", v, TENSORS)):
            if not isinstance(x, kinds):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        given = signature_of(q, k, v)
        for name, planned, got in zip(Signature._fields, self.signature, given):
            for what, want, have in zip(TensorSignature._fields, planned, got):
                if want != have:
                    if what == "quantized":
                        what, want, have = "kind", _kind(want), _kind(have)
                    want, have = (list(x) if isinstance(x, torch.Size) else x for x in (want, have))
                    raise ValueError(f"this plan was made for {name}'s {what} {want}, got {have}: make a plan for "
                                     f"these tensors (engine.plan)")
        state = "need" if self.grad else "do not need"
        raise ValueError(f"this plan was made for tensors that {state} gradients, got the other kind (its kernel, "
                         f"{self.kernel}, was chosen for that): make a plan under the same grad mode, with tensors "
                         f"that require grad as these do")

    def __str__(self) -> str:
        x = self.inputs
        planned = (f"  planned for: q {list(x.q.shape)}, k {list(x.k.shape)}, v {list(x.v.shape)} "
                   f"{str(x.q.dtype)[6:]} on {self.signature.q.device}{', with gradients' if self.grad else ''}")
        return f"{self.choice}\n{planned}"


def plan(q, k, v, query_positions=None, key_positions=None, allowed=None, scale=None, *, causal: bool = True,
         softcap: float | None = None, kernel: str = "auto", **modifiers) -> AttentionPlan:
    """Validate a call and choose its kernel (``causal_attention``'s arguments; q, k, v are read for their shapes,
    dtypes, device and gradient needs, not their values). ``modifiers``: sinks, alibi_slopes, bias, score_mod,
    dropout_p, generator; a dropout plan draws its pattern's seed here, once (each run then drops the same
    weights: plan each step).

    A plan owns what it decides from: it keeps copies of the positions and of ``allowed`` (broadcast rows stay
    broadcast), so changing those tensors in place after planning changes none of its results, whatever kernel it
    runs; plan again for new positions. The modifiers' tensors (sinks, slopes, a bias: learned, updated in place by
    an optimizer) are read at each run."""
    return _planned(q, k, v, query_positions, key_positions, allowed, scale, causal, softcap, kernel, modifiers,
                    own=True)


def plan_for_call(q, k, v, query_positions=None, key_positions=None, allowed=None, scale=None, *,
                  causal: bool = True, softcap: float | None = None, kernel: str = "auto",
                  **modifiers) -> AttentionPlan:
    """``plan``'s plan for one call that runs it at once (``causal_attention``): nothing can change its positions or
    mask before it runs, so they are not copied."""
    return _planned(q, k, v, query_positions, key_positions, allowed, scale, causal, softcap, kernel, modifiers,
                    own=False)


def _planned(q, k, v, query_positions, key_positions, allowed, scale, causal, softcap, kernel: str, modifiers: dict,
             own: bool) -> AttentionPlan:
    """Validate, (``own``: copy the positions and mask), choose the kernel and record the signature."""
    check_kernel_name(kernel)
    inputs = prepare_inputs(q, k, v, query_positions, key_positions, allowed, scale, causal=causal, softcap=softcap,
                            **modifiers)
    inputs = inputs.owning() if own else inputs
    choice = choose(inputs, kernel)
    template = inputs.with_tensors(*(placeholder(x) for x in (q, k, v)))
    signature = Signature(*(TensorSignature(*part) for part in signature_of(q, k, v)))
    return AttentionPlan(template, choice, _wants_grad(inputs, q, k, v), signature)


PLAN_CACHE_SIZE = 256
_plans: dict[tuple, AttentionPlan] = {}


def reuse(plans: dict, context, tensors: tuple, make, *, size: int | None = None, current=None, keep=None):
    """The plan in ``plans`` for ``context`` and these tensors, or ``make()``'s, kept there: the one key under which
    every plan is reused (the plain-call cache here, a forward's layers, a transformers mask's step, a ring's steps, a
    paged step, a continuous-batching forward). The key is ``(context, the tensors' Signature, the grad mode and
    need)``: ``context`` names what the call decides on besides its tensors (tensors in it as ``Same(x)``), and a
    plan is never found for tensors it was not made for. ``current(plan)``: False when a kept plan is stale (made
    from a tensor since written); ``size``: at most this many kept (the store is emptied when full); ``keep(plan)``:
    False when a plan just made is to serve this call alone."""
    key = (context, signature_of(*tensors), torch.is_grad_enabled(), needs_grad(*tensors))
    found = plans.get(key)
    if found is None or (current is not None and not current(found)):
        found = make()
        if keep is not None and not keep(found):
            return found
        if size is not None and len(plans) >= size:
            plans.clear()
        plans[key] = found
    return found


class Same:
    """A tensor (or any object) as part of a plan's context, by identity: equal only to itself, kept alive while the
    plan is (so no other object takes its ``id``)."""

    __slots__ = ("x",)

    def __init__(self, x) -> None:
        self.x = x

    def __hash__(self) -> int:
        return id(self.x)

    def __eq__(self, other) -> bool:
        return isinstance(other, Same) and other.x is self.x


def plan_for_shapes(q, k, v, scale=None, causal: bool = True, softcap: float | None = None,
                    kernel: str = "auto") -> AttentionPlan:
    """The plan of a call with default positions and no mask or modifier, where shapes decide everything: made on
    the first call with this signature, kept (at most PLAN_CACHE_SIZE of them) and reused."""
    if not (plain_number(scale) and plain_number(softcap) and isinstance(causal, bool) and isinstance(kernel, str)
            and isinstance(q, torch.Tensor) and isinstance(k, TENSORS) and isinstance(v, TENSORS)):
        return plan_for_call(q, k, v, None, None, None, scale, causal=causal, softcap=softcap,
                             kernel=kernel)  # validates
    return reuse(_plans, (scale, causal, softcap, kernel, environment()), (q, k, v),
                 lambda: plan_for_call(q, k, v, None, None, None, scale, causal=causal, softcap=softcap,
                                       kernel=kernel), size=PLAN_CACHE_SIZE)


def explain(q, k, v, query_positions=None, key_positions=None, allowed=None, scale=None, *, causal: bool = True,
            softcap: float | None = None, kernel: str = "auto", **modifiers) -> AttentionPlan:
    """Which kernel ``causal_attention`` with these arguments runs, and why (nothing is computed, nothing built).

    Example::

        >>> print(explain(q, k, v, allowed=window_mask(pos, pos, 512)))
        kernel: sdpa_tiles (the fused flash kernel on the tiles the mask leaves, merged by log-sum-exp)
          not decode_native: T = 4096 queries: decode serves T <= 16
          ...
          planned for: q [1, 8, 4096, 64], k [1, 8, 4096, 64], v [1, 8, 4096, 64] float32 on cpu

    NaN/inf in q (or in K/V when gradients are needed) is found only while running: such a call runs the
    ``tiled`` kernel whatever this says. A dropout call here draws nothing from ``generator``.
    """
    if modifiers.get("dropout_p") and isinstance(modifiers.get("generator"), (torch.Generator, type(None))):
        modifiers["generator"] = torch.Generator()  # explain computes nothing: it leaves the caller's generator be
    return plan(q, k, v, query_positions, key_positions, allowed, scale, causal=causal, softcap=softcap,
                kernel=kernel, **modifiers)


def plain_number(x) -> bool:
    """None or a finite Python int/float (not a bool, not a tensor whose value may change): a cache key part."""
    return x is None or (type(x) in (int, float) and x == x and abs(x) != float("inf"))


def _wants_grad(inputs: AttentionInputs, q, k, v) -> bool:
    """Autograd will want a gradient from this call: of q, k, v or of a learned bias (the kernel depends on it)."""
    return needs_grad(q, k, v) or (inputs.modifiers is not NONE and inputs.modifiers.learned_bias() is not None)


def signature_of(q, k, v) -> tuple:
    """``Signature``'s fields as plain tuples (the hot path builds no record): each tensor's kind, shape, element
    dtype and device."""
    return _part(q), _part(k), _part(v)


def _part(x) -> tuple:
    if type(x) is QuantizedKV:
        data = x.data
        return True, data.shape, data.dtype, data.device
    return False, x.shape, x.dtype, x.device


def _kind(quantized: bool) -> str:
    return "QuantizedKV" if quantized else "tensor"


def placeholder(x):
    """A meta tensor (or QuantizedKV of meta tensors) standing for ``x`` in a plan: its shape, dtype and strides,
    no memory, so a plan never keeps a call's tensors alive."""
    if isinstance(x, QuantizedKV):
        return QuantizedKV(placeholder(x.data), placeholder(x.scale))
    return _meta(x.shape, x.stride(), x.dtype)


@functools.lru_cache(maxsize=512)
def _meta(shape: torch.Size, stride: tuple, dtype: torch.dtype) -> torch.Tensor:
    """One meta tensor per layout, shared by the plans that stand for tensors of it (nothing writes a placeholder)."""
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
