"""Count what a function actually does, op by op: bytes of the tensors each aten op reads and writes, and FLOPs.

``TrafficCounter`` is a ``TorchDispatchMode``: every aten op that runs inside it is seen with its real
arguments, so the counts follow the implementation (a ``repeat_interleave`` copy, an fp32 cast, a score
matrix written and read back) rather than a formula.

    with TrafficCounter(inputs=(q, k, v)) as traffic:
        attention(q, k, v)
    traffic.input_bytes_read      # bytes read from q, k, v (the KV cache is most of it at decode)
    traffic.other_bytes_read      # bytes read from tensors made inside (scores, casts, copies)
    traffic.flops                 # 2 * m * k * n per matmul; 4 * B * Hq * T * S * D per fused attention op

What it is and is not:
- It counts bytes *requested* by each op (distinct elements of each tensor argument; a broadcast view counts
  once), not DRAM traffic: repeated reads served by the caches count each time, and a fused op (torch's SDPA)
  shows only its arguments, never its internal tiles.
- Ops that only make views (view, expand, transpose, ...) move no data and count nothing.
- FLOPs are matmul FLOPs (the seeds' convention); exp, max and sums are not counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

# Ops that reinterpret memory without moving it (their schemas do not all say so).
_NO_DATA = {aten._unsafe_view.default, aten.detach.default, aten.lift_fresh.default}


def distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements of ``t``: an expanded (stride-0) axis is stored, and read, once."""
    if t.numel() == 0:
        return 0
    elements = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            elements *= size
    return elements * t.element_size()


def matmul_flops(func, args: tuple, out) -> int:
    """FLOPs of the matmul-like aten ops (2 per multiply-add); 0 for everything else."""
    if func in (aten.mm.default, aten.bmm.default):
        a, b = args[0], args[1]  # [..., m, k] @ [..., k, n]
        return 2 * a.numel() * b.shape[-1]
    if func in (aten.addmm.default, aten.baddbmm.default):
        a, b = args[1], args[2]
        return 2 * a.numel() * b.shape[-1]
    if func is aten._scaled_dot_product_flash_attention_for_cpu.default:
        q, k, v = args[0], args[1], args[2]  # [B, Hq, T, D], [B, Hkv, S, D], [B, Hkv, S, Dv]
        batch, q_heads, t, d = q.shape
        s = k.shape[2]
        return 2 * batch * q_heads * t * s * (d + v.shape[-1])  # Q K^T and P V over the full T x S
    return 0


def _moves_no_data(func) -> bool:
    if func in _NO_DATA:
        return True
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class TrafficCounter(TorchDispatchMode):
    """Dispatch mode that sums bytes read, bytes written and matmul FLOPs over the aten ops run inside it.

    ``inputs``: tensors whose reads are reported apart as ``input_bytes_read`` (q, k, v: the compulsory
    traffic); every other read is ``other_bytes_read``.
    """

    def __init__(self, inputs: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._input_storages = {t.untyped_storage().data_ptr() for t in inputs}
        self.input_bytes_read = 0
        self.other_bytes_read = 0
        self.bytes_written = 0
        self.flops = 0
        self.ops: Counter[str] = Counter()

    @property
    def bytes_read(self) -> int:
        return self.input_bytes_read + self.other_bytes_read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _moves_no_data(func):
            return out
        self.ops[str(func.overloadpacket.__name__)] += 1
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                if t.untyped_storage().data_ptr() in self._input_storages:
                    self.input_bytes_read += distinct_bytes(t)
                else:
                    self.other_bytes_read += distinct_bytes(t)
        self.bytes_written += sum(distinct_bytes(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        self.flops += matmul_flops(func, args, out)
        return out
