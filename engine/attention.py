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

import torch

from engine.inputs import check_positions
from engine.masks.window import window_mask
from engine.modifiers import ScoreMod
from engine.object_plans import plan_for_objects
from engine.planning import plan_for_call, plan_for_shapes
from engine.quantized import QuantizedKV
from engine.relative_bias import RelativePositionBias

__all__ = ["causal_attention", "split_heads", "merge_heads", "window_mask"]


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
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    bias: torch.Tensor | RelativePositionBias | None = None,
    score_mod: ScoreMod | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    key_indices: torch.Tensor | None = None,
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
        sinks: keyword-only ``[Hq]`` float; one logit per query head added to each row's softmax denominator
            with no value (gpt-oss); differentiable. The returned lse includes it.
        alibi_slopes: keyword-only ``[Hq]`` or ``[B, Hq]``; adds ``-slope * |key_pos - query_pos|`` to the scores
            (``slope * (key_pos - query_pos)`` under the causal rule).
        bias: keyword-only; a float tensor broadcastable to ``[B, Hq, T, S]`` added to the scores (differentiable),
            or an ``engine.RelativePositionBias`` (a bucketed table read per tile from positions).
        score_mod: keyword-only callable ``(score, batch, head, query_pos, key_pos) -> score`` on broadcastable
            tensors (``[b, Hq, tq, tk]``, ``[b,1,1,1]``, ``[1,Hq,1,1]``, ``[b,1,tq,1]``, ``[b,1,1,tk]``).
        dropout_p: keyword-only; drop each attention weight with this probability and scale the kept ones by
            ``1 / (1 - dropout_p)``; the pattern's seed is drawn from ``generator`` (default: torch's).
        (The order of softcap, bias, ALiBi, score_mod, sinks and dropout: engine.modifiers.)
        return_lse: keyword-only; also return the log-sum-exp of each row's visible scores,
            ``[B, Hq, T]`` in the compute dtype (fp32, fp64 for fp64 inputs; base e, ``-inf`` for rows
            that see nothing).
        key_indices: int ``[B, Hkv|1, T, K]``, top-k sparse attention: query i sees only the keys listed for it
            (-1: none; duplicates count once), with the rule and ``allowed`` (engine.masks.key_indices).
        kernel: keyword-only; ``"auto"`` picks the fastest exact kernel (see ``engine.explain``),
            or a kernel name forces one.

    Returns:
        ``[B, Hq, T, Dv]`` in q's dtype, or ``(out, lse)`` when ``return_lse``.

    Example (the seed's cached decode): one new query at position 57 against 58 cached keys::

        out = causal_attention(q1, k58, v58)              # default positions: query at 57
    """
    unmodified = (sinks is None and alibi_slopes is None and bias is None and score_mod is None and not dropout_p
                  and key_indices is None)
    plain = unmodified and query_positions is None and key_positions is None and allowed is None
    if plain:  # only shapes decide: the plan made for the first call of these shapes serves this one
        call_plan = plan_for_shapes(q, k, v, scale, causal, softcap, kernel)
    elif (unmodified and allowed is None and causal is True
          and hides_no_key(q, k, query_positions, key_positions)):  # positions that decide nothing: shapes decide
        call_plan = plan_for_shapes(q, k, v, scale, False, softcap, kernel)
    elif unmodified:  # positions and a mask decide: a plan kept for these objects (a model's later layers) serves
        call_plan = plan_for_objects(q, k, v, query_positions, key_positions, allowed, scale, causal, softcap, kernel)
    else:
        call_plan = plan_for_call(q, k, v, query_positions, key_positions, allowed, scale, causal=causal,
                                  softcap=softcap, kernel=kernel, sinks=sinks, alibi_slopes=alibi_slopes, bias=bias,
                                  score_mod=score_mod, dropout_p=dropout_p, generator=generator,
                                  **({} if key_indices is None else {"key_indices": key_indices}))
    return call_plan._run_made_for(q, k, v, return_lse)  # (made or found for these very tensors: no check again)


def hides_no_key(q, k, query_positions: torch.Tensor | None, key_positions: torch.Tensor | None) -> bool:
    """True when the rule hides no key from any query: in each row, the greatest key position is at most the least
    query position (a decode step at the end of its cache, its positions passed as a model's layers pass them). Such
    a call is the same call with ``causal=False`` (the same kernel, the same results), whose plan is made once for
    its shapes; two small reductions at most decide it (~5 us). False for anything else, bad input included (the
    full planning names what is wrong)."""
    if not (type(q) is torch.Tensor and isinstance(k, (torch.Tensor, QuantizedKV)) and q.dim() == 4 and k.dim() == 4):
        return False
    batch, _, t, _ = q.shape
    s = k.shape[2]
    if t == 0 or s == 0:
        return False
    try:  # (validated as the full planning does; a bad argument is left to it, to be named)
        first_query = _bound(query_positions, batch, t, s - t, "query_positions", True, q.device)  # [B] or int
        last_key = _bound(key_positions, batch, s, 0, "key_positions", False, q.device)
    except ValueError:
        return False
    if isinstance(first_query, int) and isinstance(last_key, int):
        return last_key <= first_query
    return bool((torch.as_tensor(last_key) <= first_query).all())


def _bound(positions, batch: int, length: int, start: int, name: str, lowest: bool, device: torch.device):
    """Each row's least (``lowest``) or greatest position: an int where every row has the same positions (default
    ones read off the shapes), else ``[B]``."""
    if positions is None:
        return start if lowest else start + length - 1
    check_positions(positions, batch, length, name)
    if positions.numel() == 1:  # (one query of one row: a decode step)
        return int(positions)
    if positions.dim() == 1 or batch == 1:
        return int(positions.min() if lowest else positions.max())
    return (torch.amin if lowest else torch.amax)(positions.to(device, torch.long), dim=-1)  # [B]


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
