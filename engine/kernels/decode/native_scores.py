"""What the native decode kernel does to the scores beside the dot products: a softcap, ALiBi and a bias.

Each acts on every score in C++ before the softmax (``DecodeCall``'s softcap; alibi, queries, query_pos, key_pos;
bias), in the order of engine.modifiers: ``s = q.k * scale`` -> ``softcap * tanh(s / softcap)`` -> ``- slope *
|key_pos - query_pos|`` -> ``+ bias``. The kernel computes ALiBi's distances in fp32, so ALiBi takes positions below
2^24 in magnitude (exact in fp32: the distances the torch kernels compute in int64). The slopes and the bias (a dense
tensor, or a RelativePositionBias's block of the call's positions) are read at each run, as every kernel reads the
modifiers' tensors; the positions, the plan's own, are made fp32 once per plan (``ScoreOps``).
"""

from __future__ import annotations

import torch

from engine.inputs import AttentionInputs
from engine.masks.key_indices import split_listed

__all__ = ["MAX_POSITION", "ScoreOps", "scores_fit", "scores_unread"]

MAX_POSITION = 1 << 24  # |positions| below this are exact in fp32


def scores_fit(inputs: AttentionInputs) -> str | None:
    """Why the native kernel cannot add this call's ALiBi or bias (None: it can, or there is none). Reads the
    positions once (a plan's choice)."""
    mods = inputs.modifiers
    if mods.bias is not None and split_listed(inputs.allowed)[0] is not None:
        return "a bias with key_indices: the listed keys' biases are not read in place (the sparse kernel adds it)"
    if mods.alibi_slopes is None:
        return None
    if split_listed(inputs.allowed)[0] is not None:
        return "ALiBi with key_indices: the listed keys' positions are not read in place (the sparse kernel adds it)"
    largest = max(int(x.abs().max()) if x.numel() else 0 for x in (inputs.query_positions, inputs.key_positions))
    if largest >= MAX_POSITION:
        return f"ALiBi at position {largest}: the native kernel's fp32 distances are exact below 2^24"
    return None


def scores_unread(library, inputs: AttentionInputs) -> str | None:
    """Why ``library`` would ignore this call's softcap, ALiBi or bias (a build from a source before them, as run.py
    bench builds times): None where it reads them or the call has none."""
    for name, given, read in (("softcap", inputs.softcap is not None, library.softcap),
                              ("ALiBi", inputs.modifiers.alibi_slopes is not None, library.alibi),
                              ("bias", inputs.modifiers.bias is not None, library.bias)):
        if given and not read:
            return f"{library.path.name} was built from a source without the {name}: it would ignore it"
    return None


class ScoreOps:
    """A chunk's softcap, ALiBi and bias as the kernel reads them: queries ``i0 .. i1-1`` against keys ``j0 .. j1-1``.
    ``fill(call)`` at planning; where ``per_run``, ``read(call)`` at each run (the slopes' and the bias's fp32
    tensors, to keep while the call runs)."""

    def __init__(self, inputs: AttentionInputs, i0: int, i1: int, j0: int, j1: int) -> None:
        mods = inputs.modifiers
        self.softcap, self.queries = inputs.softcap, i1 - i0
        self.alibi, self.bias = mods.alibi_slopes, mods.bias  # [B|1, Hq]; [B|1, Hq|1, T|1, S|1] or a relative bias
        if self.alibi is not None or self.bias is not None:  # (the caller's tensors, read at each run)
            self.positions = (inputs.query_positions[:, i0:i1], inputs.key_positions[:, j0:j1])  # int64 [B, n]
            self.block, self.full = (i0, i1, j0, j1), (inputs.q.shape[0], inputs.q.shape[1])
            if self.alibi is not None:  # fp32 [B|1, n] and their batch strides (0: one row for every sequence)
                self.query_pos, self.key_pos = _rows(self.positions[0]), _rows(self.positions[1])

    @classmethod
    def paged(cls, softcap: float | None, alibi: torch.Tensor | None, query_positions: torch.Tensor,
              keys: int) -> ScoreOps:
        """A paged step's: ``query_positions [B, T]``, each sequence's key j at position j (``keys``: the longest); a
        paged call takes no dense bias."""
        ops = cls.__new__(cls)
        ops.softcap, ops.queries, ops.alibi, ops.bias = softcap, query_positions.shape[1], alibi, None
        if alibi is not None:
            ops.query_pos, ops.key_pos = _rows(query_positions), _rows(torch.arange(keys)[None])
        return ops

    @property
    def per_run(self) -> bool:
        """Whether each run reads something (ALiBi's slopes, a bias): else the plan's call holds all."""
        return self.alibi is not None or self.bias is not None

    def fill(self, call) -> None:
        call.softcap, call.queries = self.softcap or 0.0, self.queries
        if self.alibi is not None:
            call.query_pos, call.query_pos_stride = self.query_pos[0].data_ptr(), self.query_pos[1]
            call.key_pos, call.key_pos_stride = self.key_pos[0].data_ptr(), self.key_pos[1]

    def read(self, call) -> tuple:
        held = ()
        if self.alibi is not None:
            slopes = self.alibi.to(torch.float32).contiguous()  # [B|1, Hq] or [Hq]: a copy only where not fp32
            call.alibi, call.alibi_stride = slopes.data_ptr(), (slopes.shape[1] if slopes.dim() > 1 and
                                                                slopes.shape[0] > 1 else 0)
            held = (slopes,)
        if self.bias is not None:
            bias = self._bias()  # [B|1, Hq|1, t|1, n|1] fp32
            i0, i1, j0, j1 = self.block  # (strides of the broadcast axes 0: every query head, query and key its row's)
            call.bias, call.bias_strides[:] = bias.data_ptr(), bias.expand(*self.full, i1 - i0, j1 - j0).stride()
            held += (bias,)
        return held

    def _bias(self) -> torch.Tensor:
        """The bias of this chunk's queries and keys as it is now, fp32 (a view where it is fp32 already)."""
        i0, i1, j0, j1 = self.block
        if isinstance(self.bias, torch.Tensor):
            b = self.bias  # [B|1, Hq|1, T|1, S|1]
            rows, keys = (slice(i0, i1) if b.shape[2] > 1 else slice(None)), (slice(j0, j1) if b.shape[3] > 1 else
                                                                              slice(None))
            return b[:, :, rows, keys].to(torch.float32)
        return self.bias.block(*self.positions).to(torch.float32)  # RelativePositionBias: [B|1, Hq, t, n]


def _rows(positions: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``[B, n]`` int64 positions as fp32, one row where every sequence has the same ones; and the batch stride."""
    shared = positions.shape[0] == 1 or positions.stride(0) == 0 or bool((positions == positions[:1]).all())
    rows = (positions[:1] if shared else positions).to(torch.float32).contiguous()
    return rows, 0 if shared else rows.shape[1]
