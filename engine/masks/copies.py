"""The copies a plan keeps of what it decided from: a tensor copied with its broadcast dimensions kept broadcast,
and a mask's tensors copied whole (``StructuredMask.owned``), so that a change in place to the caller's tensors
after planning changes nothing the plan decided."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["compact_clone", "owned_copy", "tensors_in"]


def compact_clone(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` whose broadcast dimensions (stride 0, an ``expand``) stay broadcast: an expanded
    ``[B, T, S]`` mask copies one ``[T, S]`` row, and the copy has the same shape and the same zero strides."""
    index = tuple(slice(0, 1) if stride == 0 and size > 1 else slice(None)
                  for size, stride in zip(x.shape, x.stride()))
    return x[index].clone().expand(x.shape)


def owned_copy(value: Any) -> Any:
    """``value`` with its own copies of the tensors in it: a tensor (``compact_clone``), a structured mask (every
    tensor it holds, its parts' too: engine.masks.structured), a list or tuple of them; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return compact_clone(value)
    if _structured(value):
        copy = object.__new__(type(value))
        copy.__dict__.update({name: owned_copy(part) for name, part in value.__dict__.items()})
        return copy
    if isinstance(value, (list, tuple)):
        return type(value)(owned_copy(item) for item in value)
    return value


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor ``value`` reads: itself (a tensor), each one a structured mask holds (its parts' too), each of a
    list's or tuple's; none for anything else (None, a number)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if _structured(value):
        return [x for part in value.__dict__.values() for x in tensors_in(part)]
    if isinstance(value, (list, tuple)):
        return [x for item in value for x in tensors_in(item)]
    return []


def _structured(value: Any) -> bool:
    """A StructuredMask (engine.masks.structured, which imports this module): its tensors are its attributes'."""
    return hasattr(type(value), "tile_bounds") and hasattr(value, "__dict__")
