"""KV-cache buffers on transparent huge pages: ``zeros(*shape, dtype=..., device=...)``.

A decode step streams the whole cache through one core per thread. With 4 KiB pages that stream crosses a page every
16 rows of bf16 keys (every 8 of fp32), and each crossing costs a page walk, dearer still under a hypervisor's nested
paging. On 2 MiB pages the same read pays 1/512 of those walks (the gain: docs/BENCHMARKS.md, "Decode at the
bandwidth limit, round 2", cache buffers against the caller's tensors).

Linux gives an anonymous mapping huge pages when ``/sys/kernel/mm/transparent_hugepage/enabled`` says ``always``, or
``madvise`` and the range was marked with ``madvise(MADV_HUGEPAGE)`` before its pages were first touched. So a
buffer of at least 2 MiB is allocated with 2 MiB of slack, its 2 MiB-aligned part is marked, and only then zeroed.
The slack is never touched, so it costs address space, not memory. Anything else (another OS, a GPU, a small buffer,
THP turned off) gets a plain ``torch.zeros``: huge pages change the speed only, never a value.

Successive buffers start ``STAGGER`` bytes apart within their first huge page (``COLOURS`` offsets in turn), not all on
the 2 MiB boundary. A decode step reads a layer's K and V rows side by side, and a cache allocates its K and V
buffers one after the other. When the two start a multiple of 2 MiB apart, their streams conflict (measured, not
explained: 4 KiB or 1 MiB apart read nearly as fast as 2 KiB, 4 MiB as slowly as 0). On an AVX-512 Zen 4 VM, one
thread, B 1 S 32k bf16, K and V on 2 MiB boundaries took 1.6x the time of V 2 KiB past K (docs/BENCHMARKS.md,
"Decode at the bandwidth limit, round 10"). A buffer's first huge page then holds up to ``(COLOURS - 1) * STAGGER``
bytes before it.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import sys
from pathlib import Path

import torch

__all__ = ["COLOURS", "HUGE_PAGE", "STAGGER", "mode", "zeros"]

HUGE_PAGE = 2 << 20  # bytes: x86-64's and most aarch64 kernels' transparent huge page
STAGGER = 6 << 10  # bytes between successive buffers' offsets: 2 KiB modulo a 4 KiB page, so a cache's K and V differ
COLOURS = 64  # offsets taken in turn (0 .. 378 KiB past the boundary)
_turn = itertools.count()
_MADV_HUGEPAGE = 14  # <sys/mman.h>
_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def mode() -> str:
    """This machine's transparent-huge-page setting: ``always``, ``madvise``, ``never``, or ``unavailable`` (not
    Linux, or the setting cannot be read)."""
    if not sys.platform.startswith("linux"):
        return "unavailable"
    try:
        text = _SETTING.read_text()
    except OSError:
        return "unavailable"
    chosen = [word[1:-1] for word in text.split() if word.startswith("[") and word.endswith("]")]
    return chosen[0] if chosen else "unavailable"


@functools.cache
def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise


def zeros(*shape: int, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """``torch.zeros(*shape, dtype=dtype, device=device)``, contiguous; on a Linux CPU a buffer of 2 MiB or more
    starts a staggered offset past a 2 MiB boundary (the module's note) and its pages are asked to be huge before they
    are touched. ``shape`` is ints, or one
    tuple / ``torch.Size`` of them, as torch.zeros takes it."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise ValueError(f"huge_pages.zeros takes a shape of ints >= 0 (or one tuple / torch.Size of them), got "
                         f"{shape!r}")
    device = torch.device("cpu") if device is None else torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < HUGE_PAGE or mode() not in ("always", "madvise"):
        return torch.zeros(*shape, dtype=dtype, device=device)
    offset = next(_turn) % COLOURS * STAGGER
    raw = torch.empty(nbytes + offset + HUGE_PAGE, dtype=torch.uint8)  # untouched: its pages are not mapped yet
    boundary = -raw.data_ptr() % HUGE_PAGE
    whole = (offset + nbytes) // HUGE_PAGE * HUGE_PAGE  # the huge pages from the boundary (the tail: small pages)
    out = raw[boundary + offset:boundary + offset + nbytes].view(dtype).view(*shape)
    if mode() == "madvise":  # (a failure, e.g. EINVAL on an old kernel: small pages)
        _madvise()(raw.data_ptr() + boundary, whole, _MADV_HUGEPAGE)
    return out.zero_()  # the first touch: the kernel maps huge pages here
