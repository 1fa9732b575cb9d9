"""Choose the kernel that runs a causal_attention call, say why, and hold the one fallback order.

Every kernel computes the same thing (the reference's results) for every input it fits; they differ in
speed. ``KERNELS`` lists them fastest first. Each says, through its ``fits``, whether it can compute the
inputs exactly, and through ``pays_off`` whether ``auto`` should take it when it can:

| kernel       | what it is                                                  | fits                            |
|--------------|-------------------------------------------------------------|---------------------------------|
| decode_native| few queries against a cache in C++: each K/V row read once, | T <= 16, no gradients, CPU, a   |
|              | converted in registers; int8 / fp8; softcap, ALiBi, a bias; | compiler (built on first run);  |
|              | with key_indices only the listed keys (a page table)        | any T with key_indices          |
| sparse       | top-k sparse: each query's listed keys gathered, O(T K D)   | key_indices; S >= K(10 + 27/G)  |
| decode       | split-KV over a long cache, merged by lse (ALiBi, biases)   | T <= 16, no grad, S >= 512      |
| sdpa         | one call of PyTorch's fused CPU flash op                    | no mask beyond top-left causal  |
| sdpa_cuda    | one call of PyTorch's fused CUDA SDPA (flash/cuDNN/eff.)    | as sdpa, on CUDA                |
| sdpa_tiles   | that fused op on the tiles the mask leaves, lse-merged      | no softcap, Dv == D, CPU;       |
|              | (ALiBi and biases enter its per-tile additive masks)        | takes alibi, bias               |
| flex         | FlexAttention on a BlockMask from the mask's tile bounds    | CPU (forced; no grad), CUDA     |
| tiled        | online softmax over tiles in torch ops, skips empty tiles   | everything (every modifier)     |
| dequantized  | quantized K/V dequantised a chunk at a time (readable twin) | QuantizedKV k, v                |
| reference    | dense scores ``[B, Hq, T, S]`` (the oracle)                 | everything, small sizes only    |

Paged K/V is a third source beside dense and quantized K/V: a paged call walks the same table, and the kernels whose
``takes`` has ``paged`` (decode_native, flex) read its pools in place through their ``paged`` row (engine.kernels
.paged_rows; engine.paged.plan's ``choose_paged``). Where none does, each sequence's keys are gathered and its own
call planned (engine.paged.sequences), the readable twin. Batch-invariant mode (engine.invariance): decode_native
takes any T, 16 queries at a time.

Score modifiers (engine.modifiers) are options a kernel takes or not (``takes``); sinks act on each row's lse
after whichever kernel ran (engine.kernels.sinks).

``auto`` takes the first kernel that fits and pays off (never the reference). A forced kernel runs when it
fits; otherwise, and when a kernel finds while running that its fast path cannot be exact (NaN/inf in q:
``DoesNotFit``), the call goes down the same order to the next kernel that fits, so a forced kernel never
changes a result. No kernel calls another. ``choose`` walks the order once per plan (engine.planning) and
``execute`` runs the choice; ``engine.explain(...)`` (same arguments as causal_attention) shows the walk; the
logger ``engine.kernels`` logs each choice at DEBUG level; forcing the materialising reference at a size where
it is slow warns with ``SlowPathWarning``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.inputs import AttentionInputs
from engine.invariance import is_batch_invariant
from engine.kernels.common import DoesNotFit, empty_result
from engine.kernels.cuda.sdpa_cuda import sdpa_cuda_attention, sdpa_cuda_fits
from engine.kernels.decode import decode_native
from engine.kernels.decode.decode import decode_attention, decode_fits, decode_pays_off
from engine.kernels.decode.decode_native import (
    native_decode_attention,
    native_decode_fits,
    native_decode_pays_off,
    native_decode_runner,
)
from engine.kernels.decode.dequantized import dequantized_attention, dequantized_fits
from engine.kernels.decode.native_notes import native_decode_notes
from engine.kernels.flex.flex import flex_attention, flex_fits, flex_pays_off
from engine.kernels.paged_rows import FLEX_PAGED, NATIVE_PAGED, PagedRow
from engine.kernels.reference import reference_attention
from engine.kernels.sdpa.sdpa import sdpa_attention, sdpa_fits
from engine.kernels.sdpa.sdpa_tiles import sdpa_tiles_attention, sdpa_tiles_fits
from engine.kernels.sinks import apply_sinks
from engine.kernels.sparse.sparse import sparse_attention, sparse_fits, sparse_pays_off
from engine.kernels.tiled.tiled import tiled_attention

logger = logging.getLogger("engine.kernels")

# A kernel: (inputs, return_lse) -> (out [B, Hq, T, Dv] in q's dtype, lse [B, Hq, T] or None);
# the lse is in the compute dtype (fp32, fp64 for fp64 inputs).
Run = Callable[[AttentionInputs, bool], tuple[torch.Tensor, "torch.Tensor | None"]]
# Why a kernel cannot (fits) or should not (pays_off) run these inputs; None: it can / it should.
Check = Callable[[AttentionInputs], "str | None"]


def _always(inputs: AttentionInputs) -> str | None:
    return None


def _never_auto(inputs: AttentionInputs) -> str | None:
    return "the reference materialises the [B, Hq, T, S] scores: only run when forced"


class Kernel(NamedTuple):
    """One kernel: how to run it, when it is exact, when auto takes it, what it is for, and which optional
    parts of a call (``AttentionInputs.options()``: softcap, ...) it computes; it fits no call with another."""

    run: Run
    fits: Check
    pays_off: Check
    why: str
    takes: frozenset[str] = frozenset()
    # for a plan's runs: inputs -> run(q, k, v, return_lse), with what depends only on the plan decided once
    # (a kernel without one runs through ``run`` with the plan's decisions)
    prepare: Callable[[AttentionInputs], Callable] | None = None
    # how it reads a paged call in place (engine.kernels.paged_rows), for a kernel whose ``takes`` has "paged"
    paged: PagedRow | None = None


# Fastest first: the order auto walks and the fallback order of a forced kernel.
KERNELS: dict[str, Kernel] = {
    "decode_native": Kernel(native_decode_attention, native_decode_fits, native_decode_pays_off,
                            "few queries against a long cache, in C++: each K/V row read once for its query group, "
                            "converted in registers",
                            takes=frozenset("quantized_kv paged allowed key_indices softcap alibi bias".split()),
                            prepare=native_decode_runner, paged=NATIVE_PAGED),
    "sparse": Kernel(sparse_attention, sparse_fits, sparse_pays_off,
                     "top-k sparse attention: only each query's listed keys gathered and read (O(T K D))",
                     takes=frozenset({"softcap"})),
    "decode": Kernel(decode_attention, decode_fits, decode_pays_off,
                     "few queries against a long cache: reads each K/V byte once, split across chunks",
                     takes=frozenset({"alibi", "bias"})),
    "sdpa": Kernel(sdpa_attention, sdpa_fits, _always,
                   "PyTorch's fused flash kernel fits exactly (no mask beyond top-left causal)"),
    "sdpa_cuda": Kernel(sdpa_cuda_attention, sdpa_cuda_fits, _always,
                        "PyTorch's fused CUDA attention (flash/cuDNN/efficient) fits exactly (no mask beyond "
                        "top-left causal)"),
    "sdpa_tiles": Kernel(sdpa_tiles_attention, sdpa_tiles_fits, _always,
                         "the fused flash kernel on the tiles the mask leaves, merged by log-sum-exp",
                         takes=frozenset({"alibi", "bias"})),
    "flex": Kernel(flex_attention, flex_fits, flex_pays_off,
                   "FlexAttention, compiled, on a BlockMask from the mask's tile bounds (masks, per-row positions, "
                   "softcap, GQA)", takes=frozenset({"softcap", "paged"}), paged=FLEX_PAGED),
    "tiled": Kernel(tiled_attention, _always, _always,
                    "the general tiled kernel (softcap, score modifiers, Dv != D, per-head masks, any device)",
                    takes=frozenset({"softcap", "alibi", "bias", "bias_grad", "score_mod", "dropout"})),
    "dequantized": Kernel(dequantized_attention, dequantized_fits, _always,
                          "a quantized KV cache, dequantised a chunk of keys at a time (readable twin)",
                          takes=frozenset({"softcap", "quantized_kv"})),
    "reference": Kernel(reference_attention, _always, _never_auto, "the dense reference (the oracle)",
                        takes=frozenset({"softcap", "alibi", "bias", "bias_grad", "score_mod", "dropout",
                                         "quantized_kv"})),
}


class SlowPathWarning(UserWarning):
    """A call runs the materialising reference at a size where it is slow and memory-hungry."""


SLOW_REFERENCE_SCORES = 1 << 26  # B * Hq * T * S above this (256 MiB of fp32 scores) warns


@dataclass
class KernelChoice:
    """The kernel a call runs, why, and why each faster kernel was passed over."""

    kernel: str
    reason: str
    passed_over: dict[str, str] = field(default_factory=dict)
    modifiers: list[str] = field(default_factory=list)  # where each score modifier of the call is computed

    def __str__(self) -> str:
        lines = [f"kernel: {self.kernel} ({self.reason})"]
        lines += [f"  not {name}: {why}" for name, why in self.passed_over.items()]
        lines += [f"  {line}" for line in self.modifiers]
        return "\n".join(lines)


def _walk(inputs: AttentionInputs, start: str | None = None, forced: bool = False) -> KernelChoice:
    """Walk ``KERNELS`` from ``start`` (default: the fastest): the first kernel that fits (and, unless forced,
    pays off) wins; the others are listed with the reason they were passed over. Forced, only exactness
    counts: the forced kernel runs where it fits, and the fallbacks after it are exact too."""
    names = list(KERNELS)
    passed_over: dict[str, str] = {}
    for name in names[names.index(start) if start else 0:]:
        kernel = KERNELS[name]
        why_not = untaken(kernel, inputs) or kernel.fits(inputs) or (None if forced else kernel.pays_off(inputs))
        if why_not is None:
            return KernelChoice(name, kernel.why, passed_over)
        passed_over[name] = why_not
    if not forced:  # no kernel auto takes fits this call (a combination of options only the reference computes)
        choice = _walk(inputs, start, forced=True)
        return KernelChoice(choice.kernel, f"{KERNELS[choice.kernel].why}; no kernel auto takes fits this call",
                            passed_over)
    raise AssertionError("the reference kernel fits every input and takes every option")


def untaken(kernel: Kernel, inputs: AttentionInputs) -> str | None:
    """Why ``kernel`` cannot run a call with options it does not compute (None: it takes them all)."""
    untaken = sorted(inputs.options() - kernel.takes)
    return f"{', '.join(untaken)}: not computed by this kernel" if untaken else None


def select_kernel(inputs: AttentionInputs) -> tuple[str, str]:
    """Return ``(kernel name, reason)`` for inputs under ``kernel="auto"``."""
    choice = _walk(inputs)
    return choice.kernel, choice.reason


def _forced(inputs: AttentionInputs, kernel: str) -> KernelChoice:
    """The forced kernel if it fits, else the next one down the order that fits."""
    choice = _walk(inputs, start=kernel, forced=True)
    if choice.kernel == kernel:
        return KernelChoice(kernel, f"forced by kernel={kernel!r}")
    return KernelChoice(choice.kernel, f"forced kernel={kernel!r} does not fit ({choice.passed_over[kernel]}); "
                                       f"the next exact kernel runs", choice.passed_over)


def choose(inputs: AttentionInputs, kernel: str = "auto") -> KernelChoice:
    """The kernel ``inputs`` run with ``kernel`` (``"auto"`` or a name), why, and why not the others: the one
    place the fits checks run (once per plan). A forced kernel that is not auto's choice says what auto
    would pick."""
    auto = _walk(inputs)
    if kernel == "auto":
        choice = auto
    else:
        check_kernel_name(kernel)
        choice = _forced(inputs, kernel)
        if choice.kernel != auto.kernel:
            choice.reason += f"; auto would pick {auto.kernel}: {auto.reason}"
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("planned: kernel=%s (%s), q %s, k %s", choice.kernel, choice.reason, tuple(inputs.q.shape),
                     tuple(inputs.k.shape))
    return _with_modifiers(choice, inputs)


def _with_modifiers(choice: KernelChoice, inputs: AttentionInputs) -> KernelChoice:
    """The choice with a line on where the call's options and sinks are computed."""
    options = sorted(inputs.options())
    if options:
        choice.modifiers.append(f"{', '.join(options)}: computed by {choice.kernel}")
    if inputs.modifiers.sinks is not None:
        choice.modifiers.append(f"sinks: applied to {choice.kernel}'s out and lse after it runs (any kernel)")
    if choice.kernel == "decode_native":
        choice.modifiers += native_decode_notes(inputs)
    if is_batch_invariant():
        why_not = choice.passed_over.get("decode_native", "forced away from it")
        choice.modifiers.append("batch-invariant mode: " + ("decode_native, 16 queries at a time" if choice.kernel ==
                                "decode_native" else f"NOT batch-invariant, decode_native does not run it ({why_not})"))
    return choice


def environment() -> tuple:
    """What kernel choices depend on besides a call's inputs (the native library's availability): part of the key
    under which plans are reused."""
    return (decode_native.native_unavailable(), is_batch_invariant())


def check_kernel_name(kernel: str) -> None:
    if kernel != "auto" and kernel not in KERNELS:
        raise ValueError(f"kernel must be 'auto' or one of {sorted(KERNELS)}, got {kernel!r}")


def execute(inputs: AttentionInputs, name: str, return_lse: bool = False):
    """Run kernel ``name`` (chosen by ``choose``), or the next exact one down the order when it finds while
    running that it cannot be exact (``DoesNotFit``); sinks act on its out and lse afterwards.
    ``(out [B, Hq, T, Dv], lse [B, Hq, T] or None)``."""
    sinks = inputs.modifiers.sinks
    if sinks is not None:  # a step after the kernel, on its out and lse (engine.kernels.sinks)
        out, lse = _run_kernel(inputs, name, return_lse=True)
        out, lse = apply_sinks(out, lse, sinks)
        return out, (lse if return_lse else None)
    return _run_kernel(inputs, name, return_lse)


def prepared(inputs: AttentionInputs, name: str) -> Callable | None:
    """Kernel ``name``'s run for a plan (``Kernel.prepare``), or None: it has none, a step comes after the kernel
    (sinks), there is nothing to compute, or it cannot be prepared here (then ``execute`` falls back)."""
    kernel = KERNELS[name]
    batch, q_heads, t, _ = inputs.q.shape
    if kernel.prepare is None or inputs.modifiers.sinks is not None or batch * q_heads * t == 0 or \
            inputs.k.shape[2] == 0:
        return None
    try:
        return kernel.prepare(inputs)
    except DoesNotFit:
        return None


def _run_kernel(inputs: AttentionInputs, name: str, return_lse: bool):
    batch, q_heads, t, _ = inputs.q.shape
    if batch * q_heads * t == 0 or inputs.k.shape[2] == 0:  # nothing to attend to (or from): no kernel runs
        return empty_result(inputs, return_lse)
    if name == "reference":
        _warn_if_slow(inputs)
    while True:
        try:
            return KERNELS[name].run(inputs, return_lse)
        except DoesNotFit as why_not:  # found while running (NaN/inf): the next kernel that fits
            name = _walk(inputs, start=why_not.resume or _next(name), forced=True).kernel
            logger.debug("causal_attention: %s, falling back to kernel=%s", why_not, name)


def _next(name: str) -> str:
    return list(KERNELS)[list(KERNELS).index(name) + 1]


def _warn_if_slow(inputs: AttentionInputs) -> None:
    batch, q_heads, t, _ = inputs.q.shape
    if batch * q_heads * t * inputs.k.shape[2] > SLOW_REFERENCE_SCORES:
        warnings.warn(f"the materialising reference kernel builds a [B, Hq, T, S] = "
                      f"{[batch, q_heads, t, inputs.k.shape[2]]} score tensor; use kernel='auto'",
                      SlowPathWarning, stacklevel=6)  # the caller of causal_attention
