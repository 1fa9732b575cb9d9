"""Broadcasting of shapes, in plain Python: what ``torch.broadcast_shapes`` answers, without its ~13 us a call (it
goes through the symbolic-shape machinery of torch._refs), which a call's planning paid twice over."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def broadcast_shape(*shapes: Sequence[int]) -> torch.Size:
    """The shape all of ``shapes`` broadcast to (numpy's rule: trailing dims aligned, each 1 or one common size);
    a RuntimeError naming the shapes where they do not broadcast, as torch's."""
    if len(shapes) == 2 and tuple(shapes[0]) == tuple(shapes[1]):  # (a mask and its like: nothing to work out)
        return torch.Size(shapes[0])
    ndim = max((len(shape) for shape in shapes), default=0)
    out = []
    for dims in zip(*((1,) * (ndim - len(shape)) + tuple(shape) for shape in shapes)):
        sizes = {size for size in dims if size != 1}
        if len(sizes) > 1:
            raise RuntimeError(f"shapes {[list(shape) for shape in shapes]} do not broadcast together")
        out.append(sizes.pop() if sizes else 1)
    return torch.Size(out)


def broadcasts_to(shape: Sequence[int], full: Sequence[int]) -> bool:
    """True when ``shape`` broadcasts to ``full`` itself (no more dims; each of its dims 1 or full's)."""
    if len(shape) > len(full):
        return False
    return all(size in (1, want) for size, want in zip(shape, tuple(full)[len(full) - len(shape):]))
