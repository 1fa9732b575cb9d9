"""Batch invariance for every query count: ``set_batch_invariant(True)``, the engine's deterministic mode.

A decode step is batch-invariant always: the native decode kernel cuts each row's keys into work items at fixed
positions and sums every score in one order, so a request's result depends on its own keys alone, whatever shares
its batch and however its cache is laid out (docs/CONVENTIONS.md, "Batch invariance"). A prefill is not by
default: PyTorch's fused kernel blocks keys by the call's shape, so a prompt prefilled in chunks differs from the
same prompt prefilled whole in the last bits.

In batch-invariant mode a CPU inference call with any number of queries runs the native decode kernel, 16 queries
at a time: chunked or whole, alone or batched, contiguous or paged, a request's output is then bitwise the same (RL
users compare a sampler's log-probabilities with a trainer's, FlashInfer's fixed split size). It costs prefill
speed (docs/BENCHMARKS.md, "Batch invariance of prefill"); decode steps cost the same. A call the kernel cannot run
(gradients, fp64, softcap, ALiBi, a bias, CUDA) runs as usual, and ``explain`` says it is not invariant::

    previous = engine.set_batch_invariant(True)     # returns the previous mode
    ...
    engine.set_batch_invariant(previous)
"""

from __future__ import annotations

__all__ = ["set_batch_invariant", "is_batch_invariant"]

_mode = [False]


def set_batch_invariant(enabled: bool) -> bool:
    """Turn batch-invariant mode on or off for the whole process; returns the previous mode. Plans made in one mode
    are never reused in the other."""
    if not isinstance(enabled, bool):
        raise ValueError(f"set_batch_invariant takes True or False, got {enabled!r}")
    previous, _mode[0] = _mode[0], enabled
    return previous


def is_batch_invariant() -> bool:
    """True in batch-invariant mode (``set_batch_invariant``)."""
    return _mode[0]
