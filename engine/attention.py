"""causal_attention: one visibility rule for training, cached decode, chunked prefill and ragged batches.

Glossary (used in every shape comment of the package):
    B batch, Hq query heads, Hkv key/value heads, G = Hq // Hkv, T queries, S keys,
    D head dim of q and k, Dv head dim of v.

The rule, stated once:
    key j is visible to query i  <=>  key_positions[j] <= query_positions[i]  (and allowed[i, j])

    Default positions put the T queries at the *last* T of the S key positions:
        S = 5, T = 2:   key positions   0 1 2 3 4
                        query positions       3 4
                        query 3 sees keys 0..3, query 4 sees keys 0..4.
    (If T > S the first T - S queries sit at negative positions and see nothing.)

    Query head h reads KV head h // G:  Hq = 4, Hkv = 2  ->  [K0, K0, K1, K1].

    A query row with no visible key returns zeros (its log-sum-exp is -inf) and a zero gradient.
    Scores and the softmax are computed in fp32 (fp64 inputs stay fp64); the output has q's dtype.
"""

from __future__ import annotations

import math
import numbers

import torch

from engine.kernels.dispatch import AttentionInputs, run_attention
from engine.masks.structured import StructuredMask
from engine.masks.window import window_mask

__all__ = ["causal_attention", "split_heads", "merge_heads", "window_mask", "resolve_positions"]


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    causal: bool = True,
    softcap: float | None = None,
    return_lse: bool = False,
    kernel: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention with the position rule ``key_pos <= query_pos``.

    Args:
        q: ``[B, Hq, T, D]`` queries: float16, bfloat16, float32 or float64; any strides.
        k: ``[B, Hkv, S, D]`` keys, same dtype as q; ``Hq`` must be a multiple of ``Hkv``.
        v: ``[B, Hkv, S, Dv]`` values, same dtype as q (``Dv`` may differ from ``D``).
        query_positions: integer ``[T]`` or ``[B, T]``; defaults to ``S-T .. S-1``.
        key_positions: integer ``[S]`` or ``[B, S]``; defaults to ``0 .. S-1``.
        allowed: optional bool mask broadcastable to ``[B, Hq, T, S]``; True means "may attend".
            Combined with the position rule by ``&`` (sliding windows, documents, padding, sparsity).
            The mask helpers of ``engine.masks`` return structured masks that behave as bool tensors and
            let kernels skip whole tiles without reading a dense ``[T, S]`` mask.
        scale: multiplier of ``q @ k^T``, any finite real number (0 averages the visible values uniformly;
            a negative scale is a positive one on ``-q``); defaults to ``1 / sqrt(D)``.
        causal: keyword-only; False drops the position rule so only ``allowed`` restricts
            (encoders, cross-attention).
        softcap: keyword-only; if set, scores become ``softcap * tanh(scores / softcap)`` after scaling.
        return_lse: keyword-only; also return the log-sum-exp of each row's visible scores,
            ``[B, Hq, T]`` in the compute dtype (fp32, fp64 for fp64 inputs; base e, ``-inf`` for rows
            that see nothing).
        kernel: keyword-only; ``"auto"`` picks the fastest exact kernel (see ``engine.explain``),
            or a kernel name forces one.

    Returns:
        ``[B, Hq, T, Dv]`` in q's dtype, or ``(out, lse)`` when ``return_lse``.

    Example (the seed's cached decode): one new query at position 57 against 58 cached keys::

        out = causal_attention(q1, k58, v58)              # default positions: query at 57
    """
    inputs = prepare_inputs(q, k, v, query_positions, key_positions, allowed, scale,
                            causal=causal, softcap=softcap)
    out, lse = run_attention(inputs, kernel=kernel, return_lse=return_lse)
    return (out, lse) if return_lse else out


def prepare_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions: torch.Tensor | None,
    key_positions: torch.Tensor | None,
    allowed: torch.Tensor | None,
    scale: float | None,
    *,
    causal: bool = True,
    softcap: float | None = None,
) -> AttentionInputs:
    """Validate the arguments of causal_attention and resolve their defaults (no copies of q, k, v)."""
    _check_qkv(q, k, v)
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool (True: the position rule applies), got {causal!r} "
                         f"({type(causal).__name__})")
    batch, q_heads, t, d = q.shape
    s = k.shape[2]
    qp = resolve_positions(query_positions, batch, t, s - t, q.device, "query_positions")  # [B, T]
    kp = resolve_positions(key_positions, batch, s, 0, q.device, "key_positions")  # [B, S]
    if allowed is not None:
        check_allowed(allowed, (batch, q_heads, t, s))
    if scale is None:
        if d == 0:
            raise ValueError("head dim D = 0: the default scale 1 / sqrt(D) is undefined; pass scale explicitly")
        scale = 1.0 / math.sqrt(d)
    scale = _real_number(scale, "scale")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if softcap is not None:
        softcap = _real_number(softcap, "softcap")
        if not (softcap > 0 and math.isfinite(softcap)):
            raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
    return AttentionInputs(q, k, v, qp, kp, allowed, scale, causal, softcap)


def _real_number(value: object, name: str) -> float:
    """A Python float from a real number (int, float, numpy scalar or 0-d tensor); bools are refused."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        if value.requires_grad:
            raise ValueError(f"{name} is a tensor that requires grad: a learned {name} is not supported "
                             f"(its gradient would be dropped); fold it into q or pass a number")
        if value.device.type == "meta":
            raise ValueError(f"{name} is a meta tensor: it has no value; pass a number")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    return float(value)


# The dtypes every kernel computes exactly (scores in fp32, fp64 for fp64); fp8 and others are refused.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            layout = "[B, Hq, T, D]" if name == "q" else "[B, Hkv, S, D]" if name == "k" else "[B, Hkv, S, Dv]"
            raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(x.shape)}")
        if x.dtype not in SUPPORTED_DTYPES:
            supported = ", ".join(str(dtype).removeprefix("torch.") for dtype in SUPPORTED_DTYPES)
            raise ValueError(f"{name} must have dtype {supported}, got {x.dtype} (cast fp8 or integer inputs first)")
        if x.device.type == "meta":
            raise ValueError(f"{name} is a meta tensor: attention needs its values (got device {x.device})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    batch, q_heads, _, d = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"batch size mismatch: q has B={batch}, k has B={k.shape[0]}, v has B={v.shape[0]}")
    kv_heads, s = k.shape[1], k.shape[2]
    if v.shape[1] != kv_heads:
        raise ValueError(f"k and v must have the same number of heads, got Hkv={kv_heads} and {v.shape[1]}")
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"Query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    if k.shape[3] != d:
        raise ValueError(f"head dim mismatch: q has D={d}, k has D={k.shape[3]}")
    if v.shape[2] != s:
        raise ValueError(f"key length mismatch: k has S={s}, v has S={v.shape[2]}")


def resolve_positions(
    positions: torch.Tensor | None, batch: int, length: int, start: int, device: torch.device, name: str
) -> torch.Tensor:
    """Return int64 positions of shape ``[B, length]``; ``None`` means ``start .. start+length-1``."""
    if positions is None:
        return torch.arange(start, start + length, device=device).expand(batch, length)  # [B, L]
    if not isinstance(positions, torch.Tensor):
        raise ValueError(f"{name} must be an integer tensor of shape [{length}] or [{batch}, {length}], "
                         f"got {type(positions).__name__}")
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(f"{name} must have an integer dtype, got {positions.dtype}")
    if positions.dim() == 1 and positions.shape[0] == length:
        return positions.to(device=device, dtype=torch.long).expand(batch, length)  # [B, L]
    if positions.dim() == 2 and tuple(positions.shape) == (batch, length):
        return positions.to(device=device, dtype=torch.long)  # [B, L]
    raise ValueError(f"{name} must have shape [{length}] or [{batch}, {length}], got {tuple(positions.shape)}")


def check_allowed(allowed: torch.Tensor | StructuredMask, full: tuple[int, int, int, int]) -> None:
    """ValueError unless ``allowed`` is a bool tensor or StructuredMask broadcastable to ``full`` = [B, Hq, T, S]."""
    if not isinstance(allowed, (torch.Tensor, StructuredMask)) or allowed.dtype != torch.bool:
        kind = allowed.dtype if isinstance(allowed, torch.Tensor) else type(allowed).__name__
        raise ValueError(f"allowed must be a bool tensor broadcastable to [B, Hq, T, S] = {list(full)}, "
                         f"got {kind}")
    try:
        ok = allowed.dim() <= 4 and torch.broadcast_shapes(tuple(allowed.shape), full) == torch.Size(full)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"allowed must be broadcastable to [B, Hq, T, S] = {list(full)}, "
                         f"got shape {list(allowed.shape)}")


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[B, T, H*Dh] -> [B, H, T, Dh]``: split the last axis into heads, then make heads a batch axis.

    The transpose is not optional: ``x.reshape(B, H, T, Dh)`` has the right shape and the wrong data
    (it interleaves tokens and heads). With H = 2, Dh = 4, head 1 of token 2 is ``x[:, 2, 4:8]``.
    """
    if x.dim() != 3:
        raise ValueError(f"split_heads expects [B, T, H*Dh], got shape {tuple(x.shape)}")
    batch, t, width = x.shape
    if num_heads <= 0 or width % num_heads:
        raise ValueError(f"last dim ({width}) must be a multiple of num_heads ({num_heads})")
    return x.view(batch, t, num_heads, width // num_heads).transpose(1, 2)  # [B, H, T, Dh]


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, Dh] -> [B, T, H*Dh]``: the inverse of split_heads (transpose back, then concatenate)."""
    if x.dim() != 4:
        raise ValueError(f"merge_heads expects [B, H, T, Dh], got shape {tuple(x.shape)}")
    batch, heads, t, dh = x.shape
    return x.transpose(1, 2).reshape(batch, t, heads * dh)  # [B, T, H*Dh]
