"""Kernel ``sdpa_tiles``: PyTorch's fused CPU flash kernel on the tiles the mask leaves, merged by lse.

The tile plan (engine.kernels.tiles) sorts query tile x key tile pairs into empty / full / partial. For
each query tile, consecutive non-empty key tiles of one kind form a *span*, and each span is one call of
the fused kernel (which returns its log-sum-exp)::

    query tile 3 of a sliding window:   keys  [ empty | partial | full full | partial | empty ]
                                                         call 1     call 2      call 3
    call 1 and 3 carry an additive mask of their span only (0 where visible, -inf elsewhere);
    call 2 carries none. merge_attention_states combines the three (out, lse) pairs exactly.

In the forward, a tile whose spans touch (no empty tile between them) and include a masked one runs as
*one* masked call over their union (the backward keeps the spans). The fused kernel costs about the same
per key with or without a mask, and its ``is_causal`` skips nothing inside a 256-query square (both
measured), so the union computes no more than the spans did and saves their merge::

    sliding window, w = 512:   [ masked 256 | full 256 | causal 256 ]  ->  [ masked 768 ]   no merge

Consecutive query tiles that are each one masked call of the same shape, at the same key offset and with
the same mask (a window is translation invariant) run as one batched call: the query tiles and their
overlapping key spans become strided views ``[n, Hq, tq, D]`` / ``[n, Hkv, tk, D]`` with one shared mask.

Empty tiles are never read, so windows and documents cost O(visible tiles). Gradients: the fused
kernel's backward applied per span, fed the *merged* output and lse, gives each span's exact share of
dq, dk, dv (the flash backward only needs the softmax weights ``exp(s - lse)`` and
``delta = rowsum(dout * out)``, both global). The fast path needs no softcap and Dv == D on CPU;
otherwise the call goes to the ``tiled`` kernel, which is exact everywhere. NaN/inf: engine.kernels.nonfinite.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from engine.kernels.common import NEG_INF, compute_dtype
from engine.kernels.dispatch import AttentionInputs
from engine.kernels.merge import merge_attention_states
from engine.kernels.tiles import plan_tiles, visibility_mask

BLOCK_Q = 256  # queries per tile
BLOCK_K = 128  # keys per tile; spans merge consecutive tiles, so calls stay few

FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)

# A call of the fused kernel: (batch rows, query range, key range, kind); kind is "full" (no mask),
# "causal" (square, top-left: query i sees keys j <= i) or "masked" (additive mask from the plan).
Call = tuple[slice, int, int, int, int, str]


def flash_fits(inputs: AttentionInputs) -> str | None:
    """Why the fused CPU kernel cannot run these inputs (None: it can, given finite values)."""
    if FLASH is None or FLASH_BACKWARD is None:
        return "this torch build has no fused CPU flash kernel"
    if inputs.q.device.type != "cpu":
        return f"the fused flash kernel used here is the CPU one; inputs are on {inputs.q.device}"
    if inputs.softcap is not None:
        return "softcap: the fused kernel has no score cap"
    if inputs.v.shape[3] != inputs.q.shape[3]:
        return f"Dv = {inputs.v.shape[3]} != D = {inputs.q.shape[3]}: the fused kernel needs equal head dims"
    if inputs.q.shape[2] == 0 or inputs.k.shape[2] == 0:
        return "no queries or no keys"
    if inputs.q.shape[3] == 0 or inputs.v.shape[3] == 0:
        return "D = 0 or Dv = 0: the fused kernel needs non-empty head dims"
    return None


def sdpa_tiles_fits(inputs: AttentionInputs) -> str | None:
    return flash_fits(inputs)


def sdpa_tiles_attention(inputs: AttentionInputs, return_lse: bool = False, block_q: int = BLOCK_Q,
                         block_k: int = BLOCK_K):
    """Kernel ``"sdpa_tiles"``: ``(out [B, Hq, T, Dv], lse [B, Hq, T] in the compute dtype or None)``."""
    if flash_fits(inputs) is not None:
        from engine.kernels.tiled import tiled_attention

        return tiled_attention(inputs, return_lse)
    from engine.kernels.nonfinite import run_guarded

    return run_guarded(inputs, return_lse, lambda x, lse: run_calls(x, plan_calls(x, block_q, block_k), lse))


def plan_calls(inputs: AttentionInputs, block_q: int, block_k: int) -> list[list[Call]]:
    """Calls grouped by query tile (each group is merged); batch rows share calls unless the mask differs.

    A square partial span whose mask is exactly the top-left triangle becomes an ``is_causal`` call (no
    mask to build or read), and consecutive query tiles shaped ``[full a..c | causal c..c+tq]`` coalesce
    into one taller group, so plain or chunked prefill and each packed document take two calls in all::

        tile 0:  full [a, c)      causal [c, c+256)           merged:  full [a, c)
        tile 1:  full [a, c+256)  causal [c+256, c+512)   ->           causal [c, c+512)
    """
    mask = visibility_mask(inputs)
    batch, _, t, _ = inputs.q.shape
    s = inputs.k.shape[2]
    shared = mask is None or not mask.batched()
    groups: list[list[Call]] = []
    for b in range(1 if shared else batch):
        rows = slice(0, batch) if shared else slice(b, b + 1)
        plan = plan_tiles(mask, b, t, s, block_q, block_k)
        for i0, i1, tiles in plan.query_tiles():
            calls = [(rows, i0, i1, j0, j1,
                      "full" if full else _partial_kind(mask, b, i0, i1, j0, j1, inputs.scale))
                     for j0, j1, full in plan.runs(tiles)]
            if not calls:
                continue
            merged = _coalesce(groups[-1], calls) if groups and groups[-1][0][0] == rows else None
            if merged is not None:
                groups[-1] = merged
            else:
                groups.append(calls)
    return groups


def causal_call_fits(scale: float) -> bool:
    """The fused kernel's ``is_causal`` gives NaN for ``scale <= 0`` (it scales its own -inf), so with such a
    scale a causal square is a masked call instead (an additive mask is added after scaling: exact)."""
    return scale > 0


def _partial_kind(mask, b: int, i0: int, i1: int, j0: int, j1: int, scale: float) -> str:
    """``"causal"`` when a partial span is square and exactly top-left causal, else ``"masked"``."""
    if j1 - j0 != i1 - i0 or not causal_call_fits(scale):
        return "masked"
    return "causal" if bool((mask.block(b, i0, i1, j0, j1) == _lower_triangle(i1 - i0)).all()) else "masked"


@functools.lru_cache(maxsize=8)
def _lower_triangle(n: int) -> torch.Tensor:
    """``[n, n]`` bool, query r sees keys 0..r (shared by every tile of that size: never written)."""
    return torch.ones(n, n, dtype=torch.bool).tril()


def _fold_masked(calls: list[Call]) -> list[Call]:
    """One masked call over a query tile's spans when they touch and one of them is masked (no merge)."""
    touching = all(before[4] == after[3] for before, after in zip(calls, calls[1:]))
    if len(calls) < 2 or not touching or all(call[5] != "masked" for call in calls):
        return calls
    rows, i0, i1 = calls[0][:3]
    return [(rows, i0, i1, calls[0][3], calls[-1][4], "masked")]


def _causal_shape(calls: list[Call]):
    """``(a, c, i0, i1)`` for calls shaped ``[full a..c]? + [causal c..c+tq]``, else None."""
    if len(calls) == 2 and calls[0][5] == "full" and calls[1][5] == "causal" and calls[0][4] == calls[1][3]:
        return calls[0][3], calls[1][3], calls[1][1], calls[1][2]
    if len(calls) == 1 and calls[0][5] == "causal":
        return calls[0][3], calls[0][3], calls[0][1], calls[0][2]
    return None


def _coalesce(previous: list[Call], calls: list[Call]) -> list[Call] | None:
    """One group for two consecutive query tiles sharing a full span start and a growing causal square."""
    before, after = _causal_shape(previous), _causal_shape(calls)
    if before is None or after is None:
        return None
    a, c, i0, i1 = before
    a2, c2, i0_2, i1_2 = after
    if a2 != a or i0_2 != i1 or c2 != c + (i1 - i0):
        return None
    rows = previous[0][0]
    merged: list[Call] = [(rows, i0, i1_2, a, c, "full")] if c > a else []
    return merged + [(rows, i0, i1_2, c, c + (i1_2 - i0), "causal")]


def run_calls(inputs: AttentionInputs, groups: list[list[Call]], return_lse: bool):
    """Run planned calls, with autograd when q, k or v need gradients."""
    q, k, v = inputs.q, inputs.k, inputs.v
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _FlashTiles.apply(q, k, v, inputs, groups)
    else:
        out, lse, _ = flash_forward(inputs, groups)
    return out, (lse if return_lse else None)


class _FlashTiles(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, inputs, groups):
        inputs = dataclasses.replace(inputs, q=q, k=k, v=v)
        out, lse, out_ct = flash_forward(inputs, groups)
        ctx.save_for_backward(q, k, v, out_ct, lse)
        ctx.inputs, ctx.groups = inputs, groups
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out_ct, lse = ctx.saved_tensors
        inputs = dataclasses.replace(ctx.inputs, q=q, k=k, v=v)
        if grad_out is None and grad_lse is None:
            return None, None, None, None, None
        if grad_lse is not None and bool((grad_lse != 0).any()):  # the fused backward has no lse input
            from engine.kernels.tiled import BLOCK_K as TILED_K
            from engine.kernels.tiled import BLOCK_Q as TILED_Q
            from engine.kernels.tiled_backward import tiled_backward

            dq, dk, dv = tiled_backward(inputs, out_ct, lse, grad_out, grad_lse, TILED_Q, TILED_K)
        else:
            dq, dk, dv = flash_backward(inputs, ctx.groups, out_ct, lse, grad_out)
        return dq, dk, dv, None, None


def _span_mask(mask, call: Call, q_heads: int, dtype: torch.dtype):
    """``(additive mask [1, Hq|1, tq, tk], visible rows [1, Hq|1, tq])`` of a masked span of batch row b."""
    rows, i0, i1, j0, j1, _ = call
    visible = mask.block(rows.start, i0, i1, j0, j1)  # [tq, tk] or [Hq|1, tq|1, tk|1]
    visible = visible.expand(*visible.shape[:-2], i1 - i0, j1 - j0)
    if visible.dim() == 2:
        visible = visible[None]  # [1, tq, tk]
    additive = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, NEG_INF)
    return additive[None], visible.any(dim=-1)[None]  # [1, H|1, tq, tk], [1, H|1, tq]


def flash_forward(inputs: AttentionInputs, groups: list[list[Call]]):
    """``(out in q's dtype, lse in the compute dtype, out as saved for the backward)``.

    bf16/fp16 q, K, V go to the fused kernel as they are (no up-cast copy); partial outputs, their merge
    and the lse run in fp32. Rows no call covers stay 0 / -inf.
    """
    q, k, v = inputs.q, inputs.k, inputs.v
    batch, q_heads, t, _ = q.shape
    ct = compute_dtype(q.dtype)
    qc, kc, vc = flash_operands(q, k, v)
    if len(groups) == 1 and len(groups[0]) == 1 and _covers_all(groups[0][0], q, k):  # one call: no merging
        rows, i0, i1, j0, j1, kind = groups[0][0]
        if kind != "masked":
            o, part_lse = FLASH(qc, kc, vc, 0.0, kind == "causal", scale=inputs.scale)
            return o.to(q.dtype), part_lse.to(ct), o
    mask = visibility_mask(inputs)
    covered = sum((g[0][0].stop - g[0][0].start) * (g[0][2] - g[0][1]) for g in groups) == batch * t  # disjoint
    alloc = torch.empty if covered else torch.zeros  # rows no call covers stay 0
    out = alloc(batch, q_heads, t, v.shape[3], dtype=ct, device=q.device)  # [B, Hq, T, Dv]
    lse = torch.full((batch, q_heads, t), NEG_INF, dtype=ct, device=q.device)  # [B, Hq, T]
    for batched, group in _batches(mask, groups):
        if batched:  # query tiles sharing one masked call shape and mask
            _run_batch(qc, kc, vc, mask, group, inputs.scale, out, lse)
            continue
        parts_out, parts_lse = [], []
        for call in group:
            rows, i0, i1, j0, j1, kind = call
            additive = None
            if kind == "masked":
                additive, row_seen = _span_mask(mask, call, q_heads, qc.dtype)
            o, part_lse = FLASH(qc[rows, :, i0:i1], kc[rows, :, j0:j1], vc[rows, :, j0:j1], 0.0, kind == "causal",
                          attn_mask=additive, scale=inputs.scale)  # [b, Hq, tq, Dv], [b, Hq, tq]
            if kind == "masked":  # rows of the span that see nothing: the fused kernel says lse 0, we say -inf
                part_lse = part_lse.masked_fill(~row_seen, NEG_INF)
                o = o.masked_fill(~row_seen[..., None], 0.0)
            parts_out.append(o.to(ct))  # merged in fp32: only each part's output is rounded
            parts_lse.append(part_lse.to(ct))
        o, part_lse = (parts_out[0], parts_lse[0]) if len(group) == 1 else merge_attention_states(parts_out, parts_lse)
        rows, i0, i1 = group[0][0], group[0][1], group[0][2]
        out[rows, :, i0:i1] = o
        lse[rows, :, i0:i1] = part_lse
    return out.to(q.dtype), lse, out


def _batches(mask, groups: list[list[Call]]) -> list[tuple[bool, list[Call]]]:
    """The groups folded (``_fold_masked``) as ``(False, group)``, and runs of translated copies of one masked
    call joined as ``(True, [one call per query tile])``.

    A run: query tiles back to back whose spans have the same sizes, kinds and offsets from the query tile
    and whose masked spans have the same mask blocks (checked exactly; full and causal spans are exact by
    their kind), so their folded calls share one mask.
    """
    joined: list[tuple[bool, list[Call]]] = []
    run_shape, run_blocks = None, None
    for group in groups:
        folded = _fold_masked(group)
        rows, i0 = group[0][0], group[0][1]
        shape = (rows.start, rows.stop, tuple((i1 - i0, j0 - i0, j1 - i0, kind) for _, _, i1, j0, j1, kind in group))
        if len(folded) != 1 or folded[0][5] != "masked":
            joined.append((False, folded))
            run_shape = None
            continue
        blocks = None
        if shape == run_shape and i0 == joined[-1][1][-1][2]:
            blocks = [mask.block(rows.start, *call[1:5]) for call in group if call[5] == "masked"]
            if all(torch.equal(a, b) for a, b in zip(blocks, run_blocks)):
                joined[-1] = (True, joined[-1][1] + folded)
                continue
        joined.append((False, folded))
        run_shape = shape
        run_blocks = blocks or [mask.block(rows.start, *call[1:5]) for call in group if call[5] == "masked"]
    return joined


def _run_batch(qc, kc, vc, mask, calls: list[Call], scale, out: torch.Tensor, lse: torch.Tensor) -> None:
    """One fused call for n translated copies of a masked call; writes their rows of out and lse."""
    rows, i0, i1, j0, j1, _ = calls[0]
    n, tq, tk, end = len(calls), i1 - i0, j1 - j0, calls[-1][2]
    batch, q_heads = qc[rows].shape[:2]
    q_tiles = qc[rows, :, i0:end].unflatten(2, (n, tq)).permute(2, 0, 1, 3, 4)  # [n, b, Hq, tq, D]
    k_spans = kc[rows, :, j0:j0 + (n - 1) * tq + tk].unfold(2, tk, tq).permute(2, 0, 1, 4, 3)  # [n, b, Hkv, tk, D]
    v_spans = vc[rows, :, j0:j0 + (n - 1) * tq + tk].unfold(2, tk, tq).permute(2, 0, 1, 4, 3)  # [n, b, Hkv, tk, Dv]
    additive, row_seen = _span_mask(mask, calls[0], q_heads, qc.dtype)  # [1, H|1, tq, tk], [1, H|1, tq]
    o, part_lse = FLASH(q_tiles.flatten(0, 1), k_spans.flatten(0, 1), v_spans.flatten(0, 1), 0.0, False,
                        attn_mask=additive, scale=scale)  # [n*b, Hq, tq, Dv], [n*b, Hq, tq]
    if not bool(row_seen.all()):  # rows of the span that see nothing: lse -inf, output 0
        part_lse = part_lse.masked_fill(~row_seen, NEG_INF)
        o = o.masked_fill(~row_seen[..., None], 0.0)
    out[rows, :, i0:end] = o.unflatten(0, (n, batch)).permute(1, 2, 0, 3, 4).flatten(2, 3)  # [b, Hq, n*tq, Dv]
    lse[rows, :, i0:end] = part_lse.unflatten(0, (n, batch)).permute(1, 2, 0, 3).flatten(2, 3)  # [b, Hq, n*tq]


def flash_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k, v as the fused kernel takes them, copied only where it needs a copy.

    dtype: fp32/fp64 as they are, and bf16/fp16 too (it accumulates scores, softmax and sums in fp32 and returns
    an fp32 lse), so no up-cast copy of K/V. Layout: the fused kernel reads each head-dim vector as contiguous
    memory (it ignores ``stride(-1)``), so a tensor whose last axis is strided (``x[..., ::2]``, an ``expand``
    along D, a permuted layout) is copied; any strides on the other axes are fine (contiguous, ``[B, S, H, D]``
    transposed, KV-cache slices, expanded batch or heads), so those layouts are passed as they are.
    """
    return tuple(_unit_last_stride(x.detach()) for x in (q, k, v))


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _covers_all(call: Call, q: torch.Tensor, k: torch.Tensor) -> bool:
    rows, i0, i1, j0, j1, _ = call
    return rows == slice(0, q.shape[0]) and (i0, i1, j0, j1) == (0, q.shape[2], 0, k.shape[2])


def flash_backward(inputs: AttentionInputs, groups: list[list[Call]], out_ct: torch.Tensor, lse: torch.Tensor,
                   grad_out: torch.Tensor | None):
    """Each call's share of ``(dq, dk, dv)`` from the fused backward, fed the merged out and lse."""
    q, k, v = inputs.q, inputs.k, inputs.v
    ct = compute_dtype(q.dtype)
    qc, kc, vc = flash_operands(q, k, v)
    kt = qc.dtype  # the dtype the fused kernel runs in; its out and grad inputs must match it
    grad = torch.zeros_like(out_ct, dtype=kt) if grad_out is None else grad_out.to(kt)  # [B, Hq, T, Dv]
    out_k = out_ct.to(kt)  # [B, Hq, T, Dv]
    if len(groups) == 1 and len(groups[0]) == 1 and _covers_all(groups[0][0], q, k) and groups[0][0][5] != "masked":
        g_q, g_k, g_v = FLASH_BACKWARD(grad.contiguous(), qc, kc, vc, out_k, lse.to(ct), 0.0,
                                        groups[0][0][5] == "causal", scale=inputs.scale)
        return g_q.to(q.dtype), g_k.to(k.dtype), g_v.to(v.dtype)
    lse_use = lse.to(ct).masked_fill(lse == NEG_INF, float("inf"))  # empty rows: weights exp(s - inf) = 0
    mask = visibility_mask(inputs)
    dq, dk, dv = (torch.zeros_like(x, dtype=ct) for x in (qc, kc, vc))  # spans' shares summed in fp32
    for group in groups:
        for call in group:
            rows, i0, i1, j0, j1, kind = call
            additive = None if kind != "masked" else _span_mask(mask, call, q.shape[1], kt)[0]
            g_q, g_k, g_v = FLASH_BACKWARD(
                grad[rows, :, i0:i1].contiguous(), qc[rows, :, i0:i1], kc[rows, :, j0:j1], vc[rows, :, j0:j1],
                out_k[rows, :, i0:i1], lse_use[rows, :, i0:i1].contiguous(), 0.0, kind == "causal",
                attn_mask=additive, scale=inputs.scale)
            dq[rows, :, i0:i1] += g_q
            dk[rows, :, j0:j1] += g_k
            dv[rows, :, j0:j1] += g_v
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

