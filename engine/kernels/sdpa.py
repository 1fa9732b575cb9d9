"""Kernel ``sdpa``: one call of PyTorch's fused CPU flash kernel, where its semantics fit exactly.

The fused kernel knows two visibility patterns: none (every key visible) and ``is_causal``, which is
aligned to the *top-left* corner (query i sees keys j <= i). The engine's rule ``key_pos <= query_pos``
equals one of them when:

    every key is visible           max(key_pos) <= min(query_pos) in each row, or causal=False
                                   (e.g. one-token decode with default positions)
    top-left causal                T == S, query_pos == key_pos and strictly increasing in each row
                                   (plain prefill with default positions)

    chunked prefill  T=2, S=4:  queries at 2, 3 see keys 0..2 / 0..3 (bottom-right): neither pattern,
    so such calls go to sdpa_tiles, which splits them into a full span and a causal-square span.

Anything else (a mask, softcap, Dv != D) goes to ``sdpa_tiles`` / ``tiled``.
"""

from __future__ import annotations

import torch

from engine.kernels.dispatch import AttentionInputs
from engine.kernels.nonfinite import run_guarded
from engine.kernels.sdpa_tiles import causal_call_fits, flash_fits, run_calls


def causal_pattern(inputs: AttentionInputs) -> str | None:
    """``"none"`` (every key visible), ``"causal"`` (top-left) or None (the rule needs a mask)."""
    if not inputs.causal:
        return "none"
    qp, kp = inputs.query_positions, inputs.key_positions  # [B, T], [B, S]
    if bool((kp.amax(dim=-1) <= qp.amin(dim=-1)).all()):
        return "none"
    if qp.shape[1] == kp.shape[1] and torch.equal(qp, kp) and bool((kp.diff(dim=-1) > 0).all()):
        return "causal"
    return None


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
        from engine.kernels.sdpa_tiles import sdpa_tiles_attention

        return sdpa_tiles_attention(inputs, return_lse)
    batch, _, t, _ = inputs.q.shape
    call = (slice(0, batch), 0, t, 0, inputs.k.shape[2], "full" if pattern == "none" else "causal")
    return run_guarded(inputs, return_lse, lambda x, lse: run_calls(x, [[call]], lse))
