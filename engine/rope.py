"""Rotary position embedding (RoPE): rotate pairs of features by an angle proportional to the position.

Convention, stated once (the "half" pairing, used by Llama, Qwen, Mistral and Gemma checkpoints):
    feature i is paired with feature i + D/2, for i < D/2, and the pair turns by ``position * theta_i``
    with ``theta_i = base ** (-2i / D)``:

        D = 8:   x = [x0 x1 x2 x3 | x4 x5 x6 x7]      pairs (x0, x4) (x1, x5) (x2, x6) (x3, x7)
        (a, b) -> (a cos - b sin,  a sin + b cos)      pair i at angle position * theta_i

    The other common layout, "interleaved" (GPT-J), pairs neighbours (x0, x1) (x2, x3) ...; it is the
    same rotation on a permuted feature axis (``pairing="interleaved"``).

Two facts make RoPE work, and the tests check both:
    - a rotation preserves norms: ``|rope(x, p)| == |x|``;
    - ``rope(q, m) . rope(k, n)`` depends on ``m - n`` only, so attention scores see relative positions.

RoPE goes on q and k (before k is cached), never on v.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "rope_angles", "rope_frequencies", "PAIRINGS"]

PAIRINGS = ("half", "interleaved")


def rope_frequencies(head_dim: int, base: float = 10000.0, device: torch.device | None = None) -> torch.Tensor:
    """fp64 ``[D/2]`` angular frequencies ``theta_i = base ** (-2i / D)`` (radians per position)."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"RoPE needs a positive even head dim, got {head_dim!r}")
    if not base > 1:
        raise ValueError(f"RoPE base must be a number > 1, got {base!r}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim  # [D/2]
    return base ** -exponents  # [D/2]


def rope_angles(positions: torch.Tensor, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each fp64 ``[..., D/2]``: the angle ``position * theta_i`` for every position and pair.

    positions: integer ``[T]`` or ``[B, T]``. Angles are formed in fp64 so that large positions
    (128k tokens) keep their low bits; callers cast the rotated result back to the input dtype.
    """
    if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.dtype == torch.bool:
        raise ValueError(f"positions must be an integer tensor [T] or [B, T], got {positions!r}")
    freqs = rope_frequencies(head_dim, base, positions.device)  # [D/2]
    angles = positions.to(torch.float64)[..., None] * freqs  # [..., T, D/2]
    return angles.cos(), angles.sin()


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0, pairing: str = "half"
) -> torch.Tensor:
    """Rotate ``x`` ``[B, H, T, D]`` by its positions; returns ``[B, H, T, D]`` in x's dtype.

    Args:
        x: queries or keys, ``[B, H, T, D]`` with ``D`` even.
        positions: integer ``[T]`` (shared by the batch) or ``[B, T]`` (per row: ragged or padded batches).
        base: the RoPE base (10000 for Llama-2, 500000 for Llama-3, 1e6 for Qwen).
        pairing: ``"half"`` pairs feature ``i`` with ``i + D/2``; ``"interleaved"`` pairs ``2i`` with ``2i+1``.

    The rotation runs in fp32 (fp64 for fp64 input) from fp64 angles.

    Example: with D = 2 the single pair turns by ``position`` radians (theta_0 = 1)::

        apply_rope(torch.tensor([[[[1., 0.]]]]), torch.tensor([1]))  ->  [[[[cos 1, sin 1]]]]
    """
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing must be one of {PAIRINGS}, got {pairing!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"x must be a float tensor [B, H, T, D], got {getattr(x, 'shape', type(x).__name__)}")
    batch, _, t, d = x.shape
    if positions.dim() == 1 and positions.shape[0] == t:
        positions = positions[None, :]  # [1, T]
    elif not (positions.dim() == 2 and positions.shape[1] == t and positions.shape[0] in (1, batch)):
        raise ValueError(f"positions must have shape [{t}] or [{batch}, {t}], got {tuple(positions.shape)}")
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = rope_angles(positions.to(x.device), d, base)  # [B or 1, T, D/2] each
    cos = cos.to(work)[:, None]  # [B or 1, 1, T, D/2]
    sin = sin.to(work)[:, None]  # [B or 1, 1, T, D/2]
    xw = x.to(work)
    if pairing == "half":
        a, b = xw[..., : d // 2], xw[..., d // 2:]  # [B, H, T, D/2] each: pairs (x_i, x_{i+D/2})
        out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)  # [B, H, T, D]
    else:
        a, b = xw[..., 0::2], xw[..., 1::2]  # [B, H, T, D/2] each: pairs (x_2i, x_2i+1)
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)  # [B, H, T, D]
    return out.to(x.dtype)
