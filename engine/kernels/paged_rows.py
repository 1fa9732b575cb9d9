"""The kernels that read a paged call's pools in place: their rows of the kernel table (``Kernel.paged``).

A paged call (engine.paged.inputs: packed queries, pools, validated tables) walks ``KERNELS`` as any call does; a
kernel reads it in place when its ``takes`` says ``paged`` and its paged row fits:

| kernel        | reads a paged call in place                                       | auto takes it            |
|---------------|-------------------------------------------------------------------|--------------------------|
| decode_native | a decode step (every sequence the same 1..16 new queries), CPU, no | always where it fits    |
|               | gradients; fp32 / bf16 / fp16 / int8 / fp8 pages, through the table|                          |
|               | (with key_indices any queries, only their listed keys read)        |                          |
| flex          | FlexAttention over the pools as one key axis, a BlockMask of pages | on CUDA (forced on CPU) |

A call no row fits runs the readable twin, which every row is tested against: each sequence's keys gathered from
its pages (a run of pages at a time past RUN_KEYS) and its own planned call (engine.paged.sequences).
A row's ``prepare(inputs)`` makes what the plan keeps; its ``run(q, k_pages, v_pages, return_lse)`` returns the
call's ``(out [Nq, Hq, Dv], lse [Nq, Hq])`` with sinks applied, or None where only the readable twin is exact (NaN
or inf in q, which it keeps to their rows; pools of other strides than planned; an overflow in Flex).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.kernels.decode.native_paged import NativeStep, native_paged_fits
from engine.kernels.decode.native_paged_listed import ListedStep
from engine.kernels.flex.paged import flex_paged_attention, flex_paged_fits
from engine.kernels.sinks import apply_sinks

if TYPE_CHECKING:
    from engine.paged.inputs import PagedInputs

__all__ = ["PagedRow", "NATIVE_PAGED", "FLEX_PAGED"]


class PagedRow(NamedTuple):
    """How a kernel reads a paged call in place: whether it can (fits), whether auto takes it (pays_off), what a
    plan keeps (prepare), and why it is taken."""

    fits: Callable[[PagedInputs], str | None]
    pays_off: Callable[[PagedInputs], str | None]
    prepare: Callable[[PagedInputs], object]
    why: str


class NativeInPlace:
    """The native decode step (engine.kernels.decode.native_paged) with the call's sinks after it."""

    def __init__(self, inputs: PagedInputs) -> None:
        self.step = NativeStep(inputs) if inputs.key_indices is None else ListedStep(inputs)
        self.sinks = inputs.sinks

    def run(self, q: torch.Tensor, k_pages, v_pages, return_lse: bool):
        result = self.step.run(q, k_pages, v_pages, return_lse or self.sinks is not None)
        if result is None or self.sinks is None:
            return result
        out, lse = result  # [Nq, Hq, Dv], [Nq, Hq] as apply_sinks' [B, Hq, T, ..]
        return tuple(x[:, :, 0] for x in apply_sinks(out[:, :, None], lse[:, :, None], self.sinks))


class FlexInPlace:
    """FlexAttention over the pools (engine.kernels.flex.paged), which applies sinks itself. On the CPU the lse is
    Flex's unfused path: where that is too large a call asking for the lse takes the readable twin."""

    def __init__(self, inputs: PagedInputs) -> None:
        self.inputs = inputs
        self.lse = _flex_fits(inputs, return_lse=True) is None

    def run(self, q: torch.Tensor, k_pages, v_pages, return_lse: bool):
        if return_lse and not self.lse:
            return None
        i = self.inputs
        return flex_paged_attention(q, k_pages, v_pages, i.tables, i.positions, i.window, i.softcap, i.scale, i.sinks,
                                    return_lse=return_lse)


def _native_pays_off(inputs: PagedInputs) -> str | None:
    return None  # the fastest reader of a decode step on the CPU wherever it fits (bench paged)


def _flex_fits(inputs: PagedInputs, return_lse: bool = False) -> str | None:
    i = inputs
    return flex_paged_fits(i.q, i.k_pages, i.v_pages, i.tables, i.softcap, i.alibi_slopes, i.sinks, i.grad,
                           return_lse=return_lse)


def _flex_pays_off(inputs: PagedInputs) -> str | None:
    if inputs.q.device.type == "cuda":
        return None
    return "auto takes it in place on CUDA only (on the CPU the native kernel and the fused op are faster, measured)"


NATIVE_PAGED = PagedRow(native_paged_fits, _native_pays_off, NativeInPlace,
                        "decode_native reads K/V in place through the page table (no gathered copy)")
FLEX_PAGED = PagedRow(_flex_fits, _flex_pays_off, FlexInPlace,
                      "Flex reads K/V in place from the pools (a BlockMask of each sequence's pages; no gathered copy)")
