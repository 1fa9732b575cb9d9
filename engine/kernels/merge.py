"""Merge attention results computed over disjoint key sets, exactly, by their log-sum-exp.

If part a attended over keys A and part b over keys B (A and B disjoint), then over A + B::

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

Example: keys split 3 + 2, lse_a = log 3 (three scores of 0), lse_b = log 1 (two scores, one of them
-inf): lse = log 4, weights 3/4 and 1/4. A part that saw no key (lse -inf) gets weight 0; if every part
is empty the merged row is 0 with lse -inf, never NaN. This is the basis of split-KV decoding.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.kernels.common import NEG_INF, compute_dtype


def merge_attention_states(outputs: Iterable[torch.Tensor], lses: Iterable[torch.Tensor]
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine partial attention results over disjoint key sets.

    Args:
        outputs: partial outputs ``[..., Dv]`` (e.g. ``[B, Hq, T, Dv]``), one per key set, float tensors
            of one shape, dtype and device; any iterable (a list, a tuple, a generator), not one tensor.
        lses: their log-sum-exps ``[...]`` = ``output.shape[:-1]`` (base e, ``-inf`` where a part saw no
            key), float tensors on the outputs' device, one per output.

    Returns:
        ``(out [..., Dv] in the outputs' dtype, lse [...])``; the merge runs in fp32 (fp64 for fp64
        outputs) and the lse keeps that dtype, so merges chain without rounding.

    Raises ValueError, naming what was expected and what was given, on any other input.
    """
    outputs, lses = _check_parts(outputs, lses)
    compute = compute_dtype(outputs[0].dtype)
    lse_all = torch.stack([lse.to(compute) for lse in lses])  # [P, ...]
    top = lse_all.amax(dim=0)  # [...]
    top = top.masked_fill(top == NEG_INF, 0.0)  # every part empty: weights exp(-inf) = 0, no NaN
    weights = torch.exp(lse_all - top)  # [P, ...]
    total = weights.sum(dim=0)  # [...]
    seen = total > 0
    shares = weights / torch.where(seen, total, 1.0)  # [P, ...], summing to 1 (0 where no part saw a key)
    merged = torch.zeros(outputs[0].shape, dtype=compute, device=outputs[0].device)  # [..., Dv]
    for share, out in zip(shares, outputs):  # a convex combination: never beyond the parts' range (no overflow)
        merged += share[..., None] * out.to(compute)  # an empty part (out 0, share 0) adds exactly 0
    lse = torch.where(seen, top + torch.log(total), NEG_INF)  # [...]
    return merged.to(outputs[0].dtype), lse


def merge_into(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """The running form of ``merge_attention_states`` for two parts: ``out [..., Dv]`` and ``lse [...]`` (compute
    dtype, the merge so far) updated in place with a part over disjoint keys. No temporary of the output's size: the
    weights are ``[...]``, the part is added with ``addcmul_`` (a ring step's merge keeps one output in memory)."""
    top = torch.maximum(lse, part_lse.to(lse.dtype))  # [...]
    top = top.masked_fill_(top == NEG_INF, 0.0)  # both empty: weights exp(-inf) = 0, no NaN
    old = (lse - top).exp_()  # [...]
    new = (part_lse.to(lse.dtype) - top).exp_()
    total = old + new
    seen = total > 0
    scale = torch.where(seen, total, 1.0)
    out.mul_((old / scale)[..., None]).addcmul_(part_out, (new / scale)[..., None])  # a convex combination
    lse.copy_(torch.where(seen, top + torch.log(total), NEG_INF))


def _as_list(parts: Iterable[torch.Tensor], name: str) -> list[torch.Tensor]:
    """The parts as a list (a generator is read once); one tensor is refused, not split along its axis 0."""
    if isinstance(parts, torch.Tensor) or not isinstance(parts, Iterable):
        raise ValueError(f"{name} must be an iterable of tensors, one per key set (e.g. a list), "
                         f"got {type(parts).__name__}")
    return list(parts)


def _check_parts(outputs: Iterable[torch.Tensor], lses: Iterable[torch.Tensor]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parts as lists; a ValueError naming the first bad part if they are not well formed."""
    outputs, lses = _as_list(outputs, "outputs"), _as_list(lses, "lses")
    if not _well_formed(outputs, lses):
        _explain_bad_parts(outputs, lses)
    return outputs, lses


def _well_formed(outputs: list[torch.Tensor], lses: list[torch.Tensor]) -> bool:
    """One quick pass (the kernels' split-KV merges take this path): float outputs [..., Dv] of one shape,
    dtype and device, float lses [...] on that device, as many lses as outputs, at least one."""
    first = outputs[0] if outputs else None
    return (len(outputs) == len(lses) and isinstance(first, torch.Tensor) and first.is_floating_point()
            and first.dim() > 0 and all(
                isinstance(out, torch.Tensor) and out.shape == first.shape and out.dtype == first.dtype
                and out.device == first.device and isinstance(lse, torch.Tensor) and lse.is_floating_point()
                and lse.shape == first.shape[:-1] and lse.device == first.device
                for out, lse in zip(outputs, lses)))


def _explain_bad_parts(outputs: list[torch.Tensor], lses: list[torch.Tensor]) -> None:
    """Raise a ValueError naming the first part that is not as expected, and what it is instead
    (it finds one for every input that ``_well_formed`` refuses)."""
    if len(outputs) != len(lses) or not outputs:
        raise ValueError(f"need as many outputs as lses, at least one; got {len(outputs)} and {len(lses)}")
    for i, (out, lse) in enumerate(zip(outputs, lses)):
        for name, x in ((f"outputs[{i}]", out), (f"lses[{i}]", lse)):
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                kind = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{name} must be a floating-point tensor, got {kind}")
        if out.dim() == 0:
            raise ValueError(f"outputs[{i}] must have at least one axis [..., Dv], got a 0-d tensor")
        first = outputs[0]
        for what, given, expected in (("shape", tuple(out.shape), tuple(first.shape)),
                                      ("dtype", out.dtype, first.dtype), ("device", out.device, first.device)):
            if given != expected:
                raise ValueError(f"every output must have the {what} of outputs[0], {expected}; "
                                 f"outputs[{i}] has {given}")
        if tuple(lse.shape) != tuple(out.shape[:-1]):
            raise ValueError(f"each lse must have its output's shape without the last axis, "
                             f"{tuple(out.shape[:-1])} for output {tuple(out.shape)}; lses[{i}] has "
                             f"{tuple(lse.shape)}")
        if lse.device != out.device:
            raise ValueError(f"each lse must be on its output's device {out.device}; lses[{i}] is on {lse.device}")
