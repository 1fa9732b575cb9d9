"""Kernel ``sdpa``: one call of PyTorch's fused CPU flash op, where its semantics fit exactly.

The op knows two visibility patterns, none and top-left ``is_causal``; ``causal_pattern``
(engine.kernels.visibility) says when the engine's rule equals one of them: all-visible (decode with default
positions, ``causal=False``) or plain prefill (T == S, equal increasing positions). Anything else (a mask,
chunked prefill, softcap, Dv != D) does not fit, and dispatch runs the next kernel that does (``sdpa_tiles``
for masks and offsets, ``tiled`` for softcap or Dv != D).
Readable twin: the ``reference`` kernel.
"""

from __future__ import annotations

from engine.inputs import AttentionInputs
from engine.kernels.common import DoesNotFit
from engine.kernels.nonfinite import run_guarded
from engine.kernels.sdpa.calls import Call
from engine.kernels.sdpa.fused_op import causal_call_fits, flash_fits
from engine.kernels.sdpa.run_calls import run_calls
from engine.kernels.tiles import CAUSAL, FULL
from engine.kernels.visibility import causal_pattern


def sdpa_fits(inputs: AttentionInputs) -> str | None:
    """Why one fused call cannot compute these inputs exactly (None: it can, given finite values)."""
    return _pattern(inputs)[1]


def _pattern(inputs: AttentionInputs) -> tuple[str | None, str | None]:
    """``(pattern, None)`` when one fused call fits, else ``(None, why not)``."""
    why_not = flash_fits(inputs)
    if why_not is not None:
        return None, why_not
    if inputs.allowed is not None:
        return None, "a mask is given (allowed): its tiles need sdpa_tiles or tiled"
    pattern = causal_pattern(inputs)
    if pattern is None:
        return None, ("the positions are not plain prefill (T == S, equal increasing positions) nor all-visible: "
                      "the rule needs a mask")
    if pattern == "causal" and not causal_call_fits(inputs.scale):
        return None, f"scale = {inputs.scale} <= 0: the fused is_causal call needs a positive scale (sdpa_tiles masks)"
    return pattern, None


def sdpa_attention(inputs: AttentionInputs, return_lse: bool = False):
    """Kernel ``"sdpa"``: ``(out [B, Hq, T, Dv], lse [B, Hq, T] in the compute dtype or None)``."""
    pattern, why_not = _pattern(inputs)
    if why_not is not None:
        raise DoesNotFit(why_not)
    batch, _, t, _ = inputs.q.shape
    call = Call(slice(0, batch), 0, t, 0, inputs.k.shape[2], FULL if pattern == "none" else CAUSAL)
    return run_guarded(inputs, return_lse, lambda x, lse: run_calls(x, [[call]], lse))
