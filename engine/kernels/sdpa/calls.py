"""The call plan of the ``sdpa_tiles`` kernel: which fused calls cover the tiles a mask leaves.

The tile plan (engine.kernels.tiles) sorts query tile x key tile pairs into EMPTY / FULL / PARTIAL. For each
query tile, consecutive non-empty key tiles of one kind form a *span*, and each span is one ``Call`` of the
fused op (which returns its log-sum-exp); the calls of one query tile are merged by lse::

    query tile 3 of a sliding window:   keys  [ empty | partial | full full | partial | empty ]
                                                         call 1     call 2      call 3
    call 1 and 3 carry an additive mask of their span only; call 2 carries none.

A PARTIAL span that is square and exactly top-left causal becomes a CAUSAL call (the op's ``is_causal``: no
mask to build or read); consecutive query tiles shaped ``[full a..c | causal c..c+tq]`` coalesce into one
taller group, so plain or chunked prefill and each packed document take two calls in all::

    tile 0:  full [a, c)      causal [c, c+256)           merged:  full [a, c)
    tile 1:  full [a, c+256)  causal [c+256, c+512)   ->           causal [c, c+512)

In the forward, ``batches`` folds a tile's touching spans into *one* masked call over their union when one
of them is masked (the op costs about the same per key with or without a mask, and its ``is_causal`` skips
nothing inside a 256-query square: both measured), and joins consecutive query tiles that are translated
copies of one masked call (a window is translation invariant) into one batched call::

    sliding window, w = 512:   [ partial 256 | full 256 | causal 256 ]  ->  [ partial 768 ]   no merge
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from engine.inputs import AttentionInputs
from engine.kernels.sdpa.fused_op import causal_call_fits
from engine.kernels.tiles import CAUSAL, FULL, PARTIAL, plan_tiles
from engine.kernels.visibility import visibility_mask
from engine.masks.structured import StructuredMask

BLOCK_Q = 256  # queries per tile
BLOCK_K = 128  # keys per tile; spans merge consecutive tiles, so calls stay few


class Call(NamedTuple):
    """One call of the fused op: batch rows x queries ``i0:i1`` x keys ``j0:j1``, of one kind.

    kind: FULL (no mask), CAUSAL (square, top-left: query i0 + r sees keys j0 .. j0 + r) or PARTIAL (an
    additive mask of the span, from the visibility mask's exact block).
    """

    rows: slice
    i0: int
    i1: int
    j0: int
    j1: int
    kind: str


def plan_calls(inputs: AttentionInputs, block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> list[list[Call]]:
    """Calls grouped by query tile (each group is merged); batch rows share calls unless the mask differs."""
    mask = visibility_mask(inputs)
    batch, _, t, _ = inputs.q.shape
    s = inputs.k.shape[2]
    shared = mask is None or not mask.batched()
    groups: list[list[Call]] = []
    for b in range(1 if shared else batch):
        rows = slice(0, batch) if shared else slice(b, b + 1)
        plan = plan_tiles(mask, b, t, s, block_q, block_k)
        for i0, i1, tiles in plan.query_tiles():
            calls = [Call(rows, i0, i1, j0, j1, FULL if full else _partial_kind(mask, b, i0, i1, j0, j1, inputs))
                     for j0, j1, full in plan.runs(tiles)]
            if not calls:
                continue
            merged = _coalesce(groups[-1], calls) if groups and groups[-1][0].rows == rows else None
            if merged is not None:
                groups[-1] = merged
            else:
                groups.append(calls)
    return groups


def single_call(groups: list[list[Call]], batch: int, t: int, s: int) -> Call | None:
    """The one unmasked call covering every row, query and key, if that is the whole plan (no merge needed)."""
    if len(groups) == 1 and len(groups[0]) == 1:
        call = groups[0][0]
        covers_all = call.rows == slice(0, batch) and (call.i0, call.i1, call.j0, call.j1) == (0, t, 0, s)
        if covers_all and call.kind != PARTIAL:
            return call
    return None


def span_visible(mask: StructuredMask, call: Call) -> torch.Tensor:
    """Bool ``[1, Hq|1, tq, tk]``: which keys of the call's span each of its queries sees (batch row rows.start)."""
    visible = mask.block(call.rows.start, call.i0, call.i1, call.j0, call.j1)  # [tq, tk] or [Hq|1, tq|1, tk|1]
    visible = visible.expand(*visible.shape[:-2], call.i1 - call.i0, call.j1 - call.j0)
    if visible.dim() == 2:
        visible = visible[None]  # [1, tq, tk]
    return visible[None]  # [1, Hq|1, tq, tk]


def _partial_kind(mask, b: int, i0: int, i1: int, j0: int, j1: int, inputs: AttentionInputs) -> str:
    """CAUSAL when a partial span is square and exactly top-left causal, else PARTIAL (always with a bias: it
    enters the same additive mask)."""
    if j1 - j0 != i1 - i0 or not causal_call_fits(inputs.scale) or inputs.modifiers.additive():
        return PARTIAL
    return CAUSAL if bool((mask.block(b, i0, i1, j0, j1) == _lower_triangle(i1 - i0)).all()) else PARTIAL


@functools.lru_cache(maxsize=8)
def _lower_triangle(n: int) -> torch.Tensor:
    """``[n, n]`` bool, query r sees keys 0..r (shared by every tile of that size: never written)."""
    return torch.ones(n, n, dtype=torch.bool).tril()


def _causal_shape(calls: list[Call]):
    """``(a, c, i0, i1)`` for calls shaped ``[full a..c]? + [causal c..c+tq]``, else None."""
    if len(calls) == 2 and calls[0].kind == FULL and calls[1].kind == CAUSAL and calls[0].j1 == calls[1].j0:
        return calls[0].j0, calls[1].j0, calls[1].i0, calls[1].i1
    if len(calls) == 1 and calls[0].kind == CAUSAL:
        return calls[0].j0, calls[0].j0, calls[0].i0, calls[0].i1
    return None


def _coalesce(previous: list[Call], calls: list[Call]) -> list[Call] | None:
    """One group for two consecutive query tiles sharing a full span start and a growing causal square."""
    before, after = _causal_shape(previous), _causal_shape(calls)
    if before is None or after is None:
        return None
    start, corner, first, middle = before  # full keys [start, corner), causal square from corner
    next_start, next_corner, next_first, last = after
    if next_start != start or next_first != middle or next_corner != corner + (middle - first):
        return None
    rows = previous[0].rows
    merged = [Call(rows, first, last, start, corner, FULL)] if corner > start else []
    return merged + [Call(rows, first, last, corner, corner + (last - first), CAUSAL)]


def _fold_partial(calls: list[Call]) -> list[Call]:
    """One masked call over a query tile's spans when they touch and one of them is masked (no merge)."""
    touching = all(before.j1 == after.j0 for before, after in zip(calls, calls[1:]))
    if len(calls) < 2 or not touching or all(call.kind != PARTIAL for call in calls):
        return calls
    first = calls[0]
    return [Call(first.rows, first.i0, first.i1, first.j0, calls[-1].j1, PARTIAL)]


def batches(mask: StructuredMask | None, groups: list[list[Call]], join: bool = True
            ) -> list[tuple[bool, list[Call]]]:
    """The groups folded (``_fold_partial``) as ``(False, group)``, and runs of translated copies of one masked
    call joined as ``(True, [one call per query tile])`` (unless ``join`` is False: a bias differs per tile).

    A run: query tiles back to back whose spans have the same sizes, kinds and offsets from the query tile
    and whose masked spans have the same mask blocks (checked exactly; full and causal spans are exact by
    their kind), so their folded calls share one mask.
    """
    if not join:
        return [(False, _fold_partial(group)) for group in groups]
    joined: list[tuple[bool, list[Call]]] = []
    run_shape, run_blocks = None, None
    for group in groups:
        folded = _fold_partial(group)
        rows, i0 = group[0].rows, group[0].i0
        shape = (rows.start, rows.stop, tuple((c.i1 - c.i0, c.j0 - c.i0, c.j1 - c.i0, c.kind) for c in group))
        if len(folded) != 1 or folded[0].kind != PARTIAL:
            joined.append((False, folded))
            run_shape = None
            continue
        blocks = None
        if shape == run_shape and i0 == joined[-1][1][-1].i1:
            blocks = _partial_blocks(mask, group)
            if all(torch.equal(a, b) for a, b in zip(blocks, run_blocks)):
                joined[-1] = (True, joined[-1][1] + folded)
                continue
        joined.append((False, folded))
        run_shape = shape
        run_blocks = blocks or _partial_blocks(mask, group)
    return joined


def _partial_blocks(mask: StructuredMask, group: list[Call]) -> list[torch.Tensor]:
    return [mask.block(c.rows.start, c.i0, c.i1, c.j0, c.j1) for c in group if c.kind == PARTIAL]
