"""The constructor arguments of ``MultiHeadAttention`` (engine.layer), validated: a ValueError names what was expected
and what was given."""

from __future__ import annotations

import math
import numbers

from engine.masks.window import check_window
from engine.rope import PAIRINGS

__all__ = ["check_layer_config"]


def check_layer_config(hidden_size, num_heads, num_kv_heads, head_dim, bias, rope_base, rope_pairing, window, causal,
                       scale, softcap) -> int:
    """ValueError for a bad constructor argument of MultiHeadAttention; returns the resolved head_dim."""
    for name, n in (("hidden_size", hidden_size), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim)):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n <= 0):
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads}) "
                             "unless head_dim is given")
        head_dim = hidden_size // num_heads
    for name, flag in (("bias", bias), ("causal", causal)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool, got {flag!r} ({type(flag).__name__})")
    if rope_base is not None and not (_is_real(rope_base) and 1 < rope_base < math.inf):
        raise ValueError(f"rope_base must be a finite number > 1 (e.g. 10000.0) or None for no RoPE, "
                         f"got {rope_base!r}")
    if rope_base is not None and head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    if rope_pairing not in PAIRINGS:
        raise ValueError(f"rope_pairing must be one of {PAIRINGS}, got {rope_pairing!r}")
    check_window(window)
    if window is not None and not causal:
        raise ValueError("window needs causal=True (the window counts keys at or before the query)")
    if scale is not None and not (_is_real(scale) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None (1 / sqrt(head_dim)), got {scale!r}")
    if softcap is not None and not (_is_real(softcap) and 0 < softcap < math.inf):
        raise ValueError(f"softcap must be a positive finite number or None (no cap), got {softcap!r}")
    return head_dim


def _is_real(value: object) -> bool:
    """A real number (int, float, numpy scalar), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
