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


# Matmul-like ops by overload packet: which two arguments are multiplied (in-place and out variants too).
_OPERANDS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "addmm_": (1, 2), "baddbmm": (1, 2), "baddbmm_": (1, 2),
             "addbmm": (1, 2), "addbmm_": (1, 2), "mv": (0, 1), "addmv": (1, 2), "addmv_": (1, 2), "dot": (0, 1),
             "vdot": (0, 1)}
_FUSED_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                    "_scaled_dot_product_efficient_attention"}


def matmul_flops(func, args: tuple) -> int:
    """FLOPs of the matmul-like aten ops (2 per multiply-add); 0 for everything else.

    ``[..., m, k] @ [..., k, n]`` costs ``2 * (batch * m * k) * n``; a fused attention op costs
    ``2 * B * Hq * T * S * (D + Dv)`` (q.k and the weighted sum of v over the full T x S, masks ignored).
    """
    name = func.overloadpacket.__name__
    if name in _OPERANDS:
        first, second = (args[i] for i in _OPERANDS[name])
        columns = second.shape[-1] if second.dim() >= 2 else 1  # mv and dot: the vector has one column
        return 2 * first.numel() * columns
    if name in _FUSED_ATTENTION:
        q, k, v = args[0], args[1], args[2]  # [B, Hq, T, D], [B, Hkv, S, D], [B, Hkv, S, Dv]
        batch, q_heads, t, d = q.shape
        return 2 * batch * q_heads * t * k.shape[2] * (d + v.shape[-1])
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
        self.flops += matmul_flops(func, args)
        return out
