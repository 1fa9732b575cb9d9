"""Count the calls that read a tensor back to the host (a device sync on a GPU): ``.tolist()``, ``.item()``,
``.cpu()``, ``bool()`` / ``int()`` / ``float()`` of a tensor, ``.nonzero()``, and ``torch.tensor(list)`` (a host
list made into a tensor, what a planned step must not rebuild per layer)."""

from __future__ import annotations

import contextlib
from collections import Counter

import torch

METHODS = ("tolist", "item", "cpu", "__bool__", "__int__", "__float__", "nonzero")


@contextlib.contextmanager
def counted_host_syncs():
    """Within the block, every such call is counted (by name) in the Counter it yields."""
    counts: Counter = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in METHODS}
    make = torch.tensor

    def counting(name, method):
        def call(self, *args, **kwargs):
            counts[name] += 1
            return method(self, *args, **kwargs)
        return call

    def tensor(*args, **kwargs):
        counts["torch.tensor"] += 1
        return make(*args, **kwargs)

    try:
        for name, method in saved.items():
            setattr(torch.Tensor, name, counting(name, method))
        torch.tensor = tensor
        yield counts
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
        torch.tensor = make
