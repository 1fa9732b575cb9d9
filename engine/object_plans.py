"""Plans kept for the objects a call was planned from: a model passes one step's positions and mask to each of its
layers, so ``causal_attention`` plans the first layer's call and every later layer finds that plan (decide once,
run many times) instead of deciding again from the same positions and mask.

A kept plan is found by identity: the call's positions and mask objects themselves (``Same``: kept alive with the
plan, so no other object takes their ids), its scalars and the tensors' signature (``planning.reuse``). It serves
while every tensor those objects hold is as it was when planned (``unwritten``: its values, or on a GPU its
version). Only small calls are kept: at most B * T * S = SMALL_CALL entries, whose positions and mask hold at most
KEEP_BYTES of storage (a view counts its whole buffer; int64 positions of 8 rows of 32k keys are 2 MiB), at most
KEPT plans at once, so what they keep alive stays small. A larger call's plan is cheap beside its work."""

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
    """``((tensor, then), ...)`` for every tensor in ``values`` (``tensors_in``), each once. ``then`` is a copy of its
    values for a CPU tensor (numpy or a data pointer may write one without moving its version counter) or an
    inference tensor (which has no version counter); its version counter for any other (on a GPU: comparing values
    would be a device sync in every layer)."""
    tensors = {id(x): x for x in tensors_in(values)}.values()
    return tuple((x, compact_clone(x) if x.device.type == "cpu" or x.is_inference() else x._version) for x in tensors)


def unwritten(state: tuple) -> bool:
    """Every tensor of ``snapshot``'s ``state`` is as it was then: the same values, or the same version."""
    return all(x._version == then if type(then) is int else torch.equal(x, then) for x, then in state)


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
