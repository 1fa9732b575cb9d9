"""Kernel ``sdpa_tiles``: PyTorch's fused CPU flash op on the tiles the mask leaves, merged by log-sum-exp.

The plan (engine.kernels.sdpa.calls) covers the visible tiles with few fused calls: full spans without a
mask, exact top-left squares with the op's ``is_causal``, the rest with an additive mask of their span;
engine.kernels.sdpa.run_calls runs them and merges each query tile's parts by lse. Empty tiles are never read,
so windows and documents cost O(visible tiles). NaN/inf in K/V: engine.kernels.nonfinite.
Readable twin: the ``tiled`` kernel (the same tiles, online softmax in plain torch ops).
"""

from __future__ import annotations

from engine.inputs import AttentionInputs
from engine.kernels.common import DoesNotFit
from engine.kernels.nonfinite import run_guarded
from engine.kernels.sdpa.calls import BLOCK_K, BLOCK_Q, plan_calls
from engine.kernels.sdpa.fused_op import flash_fits
from engine.kernels.sdpa.run_calls import run_calls


def sdpa_tiles_fits(inputs: AttentionInputs) -> str | None:
    return flash_fits(inputs)


def sdpa_tiles_attention(inputs: AttentionInputs, return_lse: bool = False, block_q: int = BLOCK_Q,
                         block_k: int = BLOCK_K):
    """Kernel ``"sdpa_tiles"``: ``(out [B, Hq, T, Dv], lse [B, Hq, T] in the compute dtype or None)``."""
    why_not = flash_fits(inputs)
    if why_not is not None:
        raise DoesNotFit(why_not)
    return run_guarded(inputs, return_lse, lambda x, lse: run_calls(x, plan_calls(x, block_q, block_k), lse))
