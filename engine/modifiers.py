"""Score modifiers: what a call does to the scores between ``q @ k^T * scale`` and the softmax, validated.

The order, stated once (each step is optional)::

    s = q @ k^T * scale                                             [B, Hq, T, S]
    s = softcap * tanh(s / softcap)                                 softcap
    s = s + bias[b, h, i, j] - slope[b, h] * |key_pos - query_pos|  bias (dense or RelativePositionBias), ALiBi
    s = score_mod(s, batch, head, query_pos, key_pos)               any elementwise function of these tensors
    s = -inf where the rule hides the key                           positions, allowed
    p = exp(s - lse),  lse = log(sum_visible exp(s) [+ exp(sink[h])])   sinks: a key with no value
    out = (p * keep / (1 - dropout_p)) @ v                          dropout on the weights (lse unchanged)

ALiBi under the causal rule is ``slope * (key_pos - query_pos)`` (keys at or before the query); with
``causal=False`` the same ``-slope * |key_pos - query_pos|`` holds on both sides, which with default
positions (queries at the last T of S keys) is flash-attn's ``-slope * |i + S - T - j|``.

``prepare_modifiers`` checks each argument and returns one ``Modifiers`` record (``AttentionInputs.modifiers``);
``Modifiers.names()`` are the options a kernel must take (engine.kernels.dispatch). Sinks are no such
option: they act on each row's lse after any kernel (engine.kernels.sinks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.relative_bias import RelativePositionBias
from engine.shapes import broadcasts_to

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Modifiers:
    """The score modifiers of one call (all None / 0: plain attention).

    sinks ``[Hq]``; alibi_slopes ``[B|1, Hq]``; bias a float tensor ``[B|1, Hq|1, T|1, S|1]`` (padded to 4-D)
    or a RelativePositionBias; score_mod a callable; dropout_p in ``[0, 1)`` with the seed of its pattern.
    """

    sinks: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None
    bias: torch.Tensor | RelativePositionBias | None = None
    score_mod: ScoreMod | None = None
    dropout_p: float = 0.0
    dropout_seed: int = 0
    # the indices the dropout pattern hashes (int64 [T], [S]); None: 0 .. T-1 and 0 .. S-1. A context-parallel shard
    # call sets them to its global positions, so its pattern is the whole sequence's (engine.distributed)
    dropout_query_index: torch.Tensor | None = None
    dropout_key_index: torch.Tensor | None = None

    def names(self) -> set[str]:
        """The options these modifiers add to a call (sinks add none: every kernel returns the lse they need).

        ``"bias_grad"``: a bias whose gradient is wanted, dense or a RelativePositionBias's table (the fused
        ops' backward gives none)."""
        names = set()
        if self.alibi_slopes is not None:
            names.add("alibi")
        if self.bias is not None:
            names.add("bias")
            if self.learned_bias() is not None:
                names.add("bias_grad")
        if self.score_mod is not None:
            names.add("score_mod")
        if self.dropout_p > 0:
            names.add("dropout")
        return names

    def bias_tensor(self) -> torch.Tensor | None:
        """The bias's tensor: the dense bias, or a RelativePositionBias's table (None without a bias)."""
        return self.bias.table if isinstance(self.bias, RelativePositionBias) else self.bias

    def learned_bias(self) -> torch.Tensor | None:
        """``bias_tensor()`` when autograd wants its gradient (it requires grad, grad mode is on), else None."""
        bias = self.bias_tensor()
        return bias if bias is not None and bias.requires_grad and torch.is_grad_enabled() else None

    def additive(self) -> bool:
        """True when the scores get an additive term (ALiBi or a bias)."""
        return self.alibi_slopes is not None or self.bias is not None


NONE = Modifiers()


def prepare_modifiers(shape: tuple[int, int, int, int], device: torch.device, *, sinks=None, alibi_slopes=None,
                      bias=None, score_mod=None, dropout_p: float = 0.0,
                      generator: torch.Generator | None = None) -> Modifiers:
    """Check the modifier arguments of a call with scores ``shape = (B, Hq, T, S)``; a ValueError names what was
    expected and what was given. A dropout call draws its pattern's seed from ``generator`` (the default
    generator when None): the same generator state gives the same pattern."""
    batch, q_heads, _, _ = shape
    if sinks is not None:
        sinks = _float_tensor(sinks, "sinks", device)
        if tuple(sinks.shape) != (q_heads,):
            raise ValueError(f"sinks must have shape [Hq] = [{q_heads}] (one logit per query head), "
                             f"got {list(sinks.shape)}")
        _finite(sinks, "sinks", " (a sink of -inf is no sink: leave it out)")
    if alibi_slopes is not None:
        alibi_slopes = _float_tensor(alibi_slopes, "alibi_slopes", device)
        if alibi_slopes.requires_grad:
            raise ValueError("alibi_slopes requires grad: learned ALiBi slopes are not supported (their gradient "
                             "would be dropped); pass them detached")
        if tuple(alibi_slopes.shape) not in ((q_heads,), (batch, q_heads)):
            raise ValueError(f"alibi_slopes must have shape [Hq] = [{q_heads}] or [B, Hq] = [{batch}, {q_heads}], "
                             f"got {list(alibi_slopes.shape)}")
        _finite(alibi_slopes, "alibi_slopes")
        alibi_slopes = alibi_slopes.reshape(-1, q_heads)  # [B|1, Hq]
    if bias is not None:
        bias = _check_bias(bias, shape, device)
    if score_mod is not None and not callable(score_mod):
        raise ValueError(f"score_mod must be a callable (score, batch, head, query_pos, key_pos) -> score, "
                         f"got {type(score_mod).__name__}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    seed = 0
    if dropout_p > 0:
        seed = int(torch.randint(0, 2**62, (), generator=generator))
    return Modifiers(sinks, alibi_slopes, bias, score_mod, float(dropout_p), seed)


def check_score_mod_captures(score_mod: ScoreMod | None, query_positions: torch.Tensor,
                             key_positions: torch.Tensor, dtype: torch.dtype) -> None:
    """ValueError when ``score_mod`` returns scores that require grad from scores that do not: it captures a
    tensor that requires grad, and no kernel computes that tensor's gradient (gradients flow through score_mod
    to q and k only). Probed once per call on one score (batch 0, head 0, the first query and key), only in
    grad mode: under ``torch.no_grad()`` nothing is differentiated, and such a score_mod runs."""
    if score_mod is None or not torch.is_grad_enabled() or not query_positions.numel() or not key_positions.numel():
        return
    index = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=query_positions.device)  # [1, 1, 1, 1]
    score = torch.zeros(1, 1, 1, 1, dtype=dtype, device=query_positions.device)  # [1, 1, 1, 1]
    out = score_mod(score, index, index, query_positions[:1, :1, None, None], key_positions[:1, :1, None, None])
    if isinstance(out, torch.Tensor) and out.requires_grad:
        raise ValueError("score_mod captures a tensor that requires grad: no kernel computes that tensor's gradient "
                         "(gradients flow through score_mod to q and k only). Learn a bias with bias= (a dense "
                         "tensor or a RelativePositionBias table, both get their gradient), or detach the tensor, "
                         "or call under torch.no_grad()")


def _float_tensor(x, name: str, device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        kind = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a floating-point tensor, got {kind}")
    if x.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {x.device}")
    return x


def _finite(x: torch.Tensor, name: str, hint: str = "") -> None:
    """ValueError on NaN/inf: min and max are finite exactly when every entry is (one pass, no bool copy of x)."""
    if x.numel() and not all(bool(torch.isfinite(end)) for end in torch.aminmax(x.detach())):
        raise ValueError(f"{name} must be finite{hint}, got NaN/inf")


def _check_bias(bias, shape: tuple[int, int, int, int], device: torch.device):
    """A dense bias padded to 4-D ``[B|1, Hq|1, T|1, S|1]``, or a RelativePositionBias with ``Hq`` rows."""
    if isinstance(bias, RelativePositionBias):
        table = _float_tensor(bias.table, "bias.table", device)
        if not isinstance(bias.bidirectional, bool):
            raise ValueError(f"RelativePositionBias.bidirectional must be a bool, got {bias.bidirectional!r}")
        least = 4 if bias.bidirectional else 2  # per direction: at least one exact and one logarithmic bucket
        if table.dim() != 2 or table.shape[0] != shape[1] or table.shape[1] < least:
            raise ValueError(f"a RelativePositionBias table must be [Hq, num_buckets] = [{shape[1]}, >= {least}] "
                             f"(bidirectional={bias.bidirectional}: {least // 2} buckets per direction at least, "
                             f"one exact and one logarithmic), got {list(table.shape)}")
        if not (isinstance(bias.max_distance, int) and bias.max_distance > bias.exact_buckets):
            raise ValueError(f"RelativePositionBias.max_distance must be an int > {bias.exact_buckets} (the exact "
                             f"buckets: half of each direction's), got {bias.max_distance!r}")
        return bias
    bias = _float_tensor(bias, "bias", device)
    if not broadcasts_to(bias.shape, shape):
        raise ValueError(f"bias must be a float tensor broadcastable to [B, Hq, T, S] = {list(shape)} or a "
                         f"RelativePositionBias, got shape {list(bias.shape)}")
    _finite(bias, "bias", " (hide keys with allowed, not with a -inf bias)")
    return bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))  # [B|1, Hq|1, T|1, S|1]

