"""Plans kept for the objects a call was planned from: a model passes one step's positions and mask to each of its
layers, so ``causal_attention`` plans the first layer's call and every later layer finds that plan (decide once,
run many times) instead of deciding again from the same positions and mask.

A kept plan is found by identity: the call's positions and mask objects themselves (``Same``: kept alive with the
plan, so no other object takes their ids), its scalars and the tensors' signature (``planning.reuse``). It serves
while every tensor those objects hold has the values it had when planned (``unwritten``: compared with a copy). Only
small calls are kept: at most B * T * S = SMALL_CALL entries, whose positions and mask hold at most KEEP_BYTES of
storage (a view counts its whole buffer; int64 positions of 8 rows of 32k keys are 2 MiB), at most KEPT plans at
once, so what they keep alive stays small. A larger call's plan is cheap beside its work."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.dispatch import environment
from engine.masks.copies import compact_clone, tensors_in
from engine.planning import TENSORS, AttentionPlan, Same, plain_number, plan_for_call, reuse

__all__ = ["plan_for_objects", "snapshot", "unwritten"]

KEPT = 8  # plans kept at once (the store is emptied when full)
SMALL_CALL = 1 << 20  # B * T * S at most, for a call's plan to be kept
KEEP_BYTES = 2 << 20  # the storage its positions' and mask's tensors hold at most, for a call's plan to be kept

_kept: dict = {}


@dataclass(frozen=True)
class KeptPlan:
    plan: AttentionPlan
    state: tuple | None  # snapshot() of the positions' and mask's tensors when planned (None: too large to keep)


def snapshot(values) -> tuple:
    """``((tensor, copy), ...)`` for every tensor in ``values`` (``tensors_in``): a copy of its values (its version
    counter would not do: an inference tensor has none, and a write through numpy or a data pointer moves none)."""
    return tuple((x, compact_clone(x)) for x in {id(x): x for x in tensors_in(values)}.values())  # (each once)


def unwritten(state: tuple) -> bool:
    """Every tensor of ``snapshot``'s ``state`` holds the values it held then."""
    return all(torch.equal(x, copy) for x, copy in state)


def plan_for_objects(q, k, v, query_positions, key_positions, allowed, scale, causal, softcap, kernel) -> AttentionPlan:
    """``plan_for_call``'s plan for a call given positions or a mask (no modifier), kept for those very objects while
    they are unwritten (a small call), else made for this call alone."""
    def make() -> AttentionPlan:
        return plan_for_call(q, k, v, query_positions, key_positions, allowed, scale, causal=causal, softcap=softcap,
                             kernel=kernel)

    if not _small(q, k, v) or not (plain_number(scale) and plain_number(softcap) and isinstance(causal, bool)
                                   and isinstance(kernel, str)):
        return make()  # (validates)
    objects = (query_positions, key_positions, allowed)
    kept = reuse(_kept, (*(Same(x) for x in objects), scale, causal, softcap, kernel, environment()), (q, k, v),
                 lambda: KeptPlan(make(), snapshot(objects) if _storage_bytes(objects) <= KEEP_BYTES else None),
                 size=KEPT, current=lambda made: unwritten(made.state), keep=lambda made: made.state is not None)
    return kept.plan


def _storage_bytes(objects) -> int:
    """The bytes of storage the objects' tensors would keep alive (each buffer once: a view counts its whole one)."""
    return sum({x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in tensors_in(objects)}.values())


def _small(q, k, v) -> bool:
    return (type(q) is torch.Tensor and isinstance(k, TENSORS) and isinstance(v, TENSORS) and q.dim() == 4
            and k.dim() == 4 and q.shape[0] * q.shape[2] * k.shape[2] <= SMALL_CALL)
