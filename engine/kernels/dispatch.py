"""Choose the kernel that runs a causal_attention call, and say why.

Every kernel computes the same thing (the reference's results) for every input; they differ in speed.
A kernel whose fast path does not fit some input (softcap for the fused kernel, NaN in K/V, ...) hands
the call to an exact fallback, so a forced kernel never changes a result. ``select_kernel`` walks the
kernels fastest-first and takes the first whose fast path fits the inputs exactly; ``explain(...)``
(same arguments as causal_attention) shows that walk; the logger ``engine.kernels`` logs each choice
at DEBUG level; forcing the materialising reference at a size where
it is slow warns with ``SlowPathWarning``.

| kernel       | what it is                                                  | fits                            |
|--------------|-------------------------------------------------------------|---------------------------------|
| decode       | few queries against a long cache: split-KV, merged by lse   | T <= 16, S >= 512, no gradients |
| sdpa         | one call of PyTorch's fused CPU flash kernel                | no mask beyond top-left causal  |
| sdpa_tiles   | that fused kernel on the tiles the mask leaves, lse-merged  | no softcap, Dv == D, CPU        |
| tiled        | online softmax over tiles in torch ops, skips empty tiles   | everything                      |
| reference    | dense scores ``[B, Hq, T, S]`` (the oracle)                 | everything, small sizes only    |
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.kernels.common import compute_dtype

logger = logging.getLogger("engine.kernels")


@dataclass(frozen=True)
class AttentionInputs:
    """Validated arguments of causal_attention with defaults resolved.

    q ``[B, Hq, T, D]``, k ``[B, Hkv, S, D]``, v ``[B, Hkv, S, Dv]``; query_positions ``[B, T]`` and
    key_positions ``[B, S]`` (int64, possibly expanded views); allowed is None, a bool tensor
    broadcastable to ``[B, Hq, T, S]``, or a StructuredMask (engine.masks) of such a shape.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    query_positions: torch.Tensor
    key_positions: torch.Tensor
    allowed: torch.Tensor | None
    scale: float
    causal: bool
    softcap: float | None


# A kernel: (inputs, return_lse) -> (out [B, Hq, T, Dv] in q's dtype, lse [B, Hq, T] or None);
# the lse is in the compute dtype (fp32, fp64 for fp64 inputs).
Kernel = Callable[[AttentionInputs, bool], tuple[torch.Tensor, "torch.Tensor | None"]]
# Why a kernel cannot run these inputs exactly (None: it can)
Fit = Callable[[AttentionInputs], "str | None"]


class SlowPathWarning(UserWarning):
    """A call runs the materialising reference at a size where it is slow and memory-hungry."""


SLOW_REFERENCE_SCORES = 1 << 26  # B * Hq * T * S above this (256 MiB of fp32 scores) warns


def _reference(inputs: AttentionInputs, return_lse: bool):
    from dataclasses import replace

    from engine.kernels.reference import dense_attention

    allowed = inputs.allowed
    if allowed is not None and not isinstance(allowed, torch.Tensor):
        inputs = replace(inputs, allowed=allowed.to_dense())  # a StructuredMask, materialised
    return dense_attention(inputs, return_lse=return_lse)


def _tiled(inputs: AttentionInputs, return_lse: bool):
    from engine.kernels.tiled import tiled_attention

    return tiled_attention(inputs, return_lse)


def _sdpa(inputs: AttentionInputs, return_lse: bool):
    from engine.kernels.sdpa import sdpa_attention

    return sdpa_attention(inputs, return_lse)


def _sdpa_tiles(inputs: AttentionInputs, return_lse: bool):
    from engine.kernels.sdpa_tiles import sdpa_tiles_attention

    return sdpa_tiles_attention(inputs, return_lse)


def _decode(inputs: AttentionInputs, return_lse: bool):
    from engine.kernels.decode import decode_attention

    return decode_attention(inputs, return_lse)


def _fits_sdpa(inputs: AttentionInputs) -> str | None:
    from engine.kernels.sdpa import sdpa_fits

    return sdpa_fits(inputs)


def _fits_sdpa_tiles(inputs: AttentionInputs) -> str | None:
    from engine.kernels.sdpa_tiles import sdpa_tiles_fits

    return sdpa_tiles_fits(inputs)


def _fits_decode(inputs: AttentionInputs) -> str | None:
    from engine.kernels.decode import decode_fits

    return decode_fits(inputs)


def _fits_always(inputs: AttentionInputs) -> str | None:
    return None


# Every kernel by name; `causal_attention(..., kernel=name)` forces one.
KERNELS: dict[str, Kernel] = {
    "decode": _decode,
    "sdpa": _sdpa,
    "sdpa_tiles": _sdpa_tiles,
    "tiled": _tiled,
    "reference": _reference,
}
# When each kernel's fast path fits exactly; "auto" tries them in this order (fastest first), first fit wins.
FITS: dict[str, Fit] = {
    "decode": _fits_decode,
    "sdpa": _fits_sdpa,
    "sdpa_tiles": _fits_sdpa_tiles,
    "tiled": _fits_always,
}
WHY = {
    "decode": "few queries against a long cache: reads each K/V byte once, split across chunks",
    "sdpa": "PyTorch's fused flash kernel fits exactly (no mask beyond top-left causal)",
    "sdpa_tiles": "the fused flash kernel on the tiles the mask leaves, merged by log-sum-exp",
    "tiled": "the general tiled kernel (softcap, Dv != D, per-head masks, any device)",
}


@dataclass
class KernelChoice:
    """The kernel a call runs, why, and why each faster kernel was passed over."""

    kernel: str
    reason: str
    passed_over: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"kernel: {self.kernel} ({self.reason})"]
        lines += [f"  not {name}: {why}" for name, why in self.passed_over.items()]
        return "\n".join(lines)


def choose_kernel(inputs: AttentionInputs) -> KernelChoice:
    """Walk FITS fastest-first; the first kernel whose semantics fit the inputs exactly wins."""
    passed_over: dict[str, str] = {}
    for name, fits in FITS.items():
        why_not = fits(inputs)
        if why_not is None:
            return KernelChoice(name, WHY[name], passed_over)
        passed_over[name] = why_not
    raise AssertionError("the tiled kernel fits every input")


def select_kernel(inputs: AttentionInputs) -> tuple[str, str]:
    """Return ``(kernel name, reason)`` for inputs under ``kernel="auto"``."""
    choice = choose_kernel(inputs)
    return choice.kernel, choice.reason


def explain(q, k, v, query_positions=None, key_positions=None, allowed=None, scale=None, *,
            causal: bool = True, softcap: float | None = None, kernel: str = "auto") -> KernelChoice:
    """Which kernel ``causal_attention`` with these arguments runs, and why (nothing is computed).

    Example::

        >>> print(explain(q, k, v, allowed=window_mask(pos, pos, 512)))
        kernel: sdpa_tiles (the fused flash kernel on the tiles the mask leaves, merged by log-sum-exp)
          not decode: T = 4096 queries: decode serves T <= 16
          not sdpa: a mask is given (allowed): its semantics need the tiled kernels
    """
    from engine.attention import prepare_inputs

    inputs = prepare_inputs(q, k, v, query_positions, key_positions, allowed, scale, causal=causal, softcap=softcap)
    auto = choose_kernel(inputs)
    if kernel != "auto":
        _check_name(kernel)
        note = "" if kernel == auto.kernel else f"; auto would pick {auto.kernel}: {auto.reason}"
        why_not = FITS.get(kernel, _fits_always)(inputs)
        if why_not is not None and kernel != "reference":
            note += f"; its fast path does not apply ({why_not}), it hands the call to an exact fallback"
        return KernelChoice(kernel, f"forced by kernel={kernel!r}{note}")
    return auto


def _check_name(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be 'auto' or one of {sorted(KERNELS)}, got {kernel!r}")


def run_attention(inputs: AttentionInputs, kernel: str = "auto", return_lse: bool = False):
    """Run the chosen kernel; returns ``(out [B, Hq, T, Dv], lse [B, Hq, T] or None)``."""
    if kernel == "auto":
        kernel, reason = select_kernel(inputs)
    else:
        _check_name(kernel)
        reason = "forced"
    batch, q_heads, t, _ = inputs.q.shape
    if batch * q_heads * t == 0 or inputs.k.shape[2] == 0:  # nothing to attend to (or from): no kernel runs
        return _empty_result(inputs, return_lse)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("causal_attention: kernel=%s (%s), q %s, k %s", kernel, reason,
                     tuple(inputs.q.shape), tuple(inputs.k.shape))
    if kernel == "reference":
        batch, q_heads, t, _ = inputs.q.shape
        if batch * q_heads * t * inputs.k.shape[2] > SLOW_REFERENCE_SCORES:
            warnings.warn(f"the materialising reference kernel builds a [B, Hq, T, S] = "
                          f"{[batch, q_heads, t, inputs.k.shape[2]]} score tensor; use kernel='auto'",
                          SlowPathWarning, stacklevel=3)
    return KERNELS[kernel](inputs, return_lse)


def _empty_result(inputs: AttentionInputs, return_lse: bool):
    """B, Hq or T of 0 gives an empty output; S = 0 gives rows that see nothing: zeros and lse -inf."""
    batch, q_heads, t, _ = inputs.q.shape
    out = inputs.q.new_zeros(batch, q_heads, t, inputs.v.shape[3])  # [B, Hq, T, Dv]
    lse = None
    if return_lse:
        lse = torch.full((batch, q_heads, t), float("-inf"), dtype=compute_dtype(inputs.q.dtype),
                         device=inputs.q.device)  # [B, Hq, T]
    return out, lse
