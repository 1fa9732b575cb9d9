"""Attention over a paged KV cache: a mixed batch of decodes, chunked prefills and prefills in one call.

Each sequence's keys live in fixed-size pages of one pool (engine.paged.tables states the layout); its queries are
packed rows of q. The rule is the engine's one rule with positions: key j of a sequence sits at position j, its
queries by default at its last ``q_len`` positions (``query_positions`` overrides), and key j is visible to a query
iff ``j <= query_pos`` (and ``query_pos - j < window``)::

    page_size 2, sequence 0: kv_len 5, 1 query (decode at position 4); sequence 1: kv_len 3, 3 queries (a prefill)
    q rows:  [ s0 q@4 | s1 q@0 s1 q@1 s1 q@2 ]        query_indptr = [0, 1, 4]

``paged_attention`` is ``plan_paged(...).run(q, k_pages, v_pages)`` (engine.paged.plan: plan a step once, run it in
every layer). The paths, which ``explain_paged`` (or ``print(plan)``) names with the reason:

    shared prefix   sequences whose tables begin with the same pages (forks of one prompt): the prefix read once for
                    all their queries, merged by lse with one paged call on the suffixes (engine.paged.cascade)
    flex            ``kernel="flex"`` (and auto on CUDA): FlexAttention over the pools as one key axis, a BlockMask of
                    each sequence's pages (engine.kernels.flex.paged)
    in place        a decode step (every sequence the same 1..16 new queries, CPU, no gradients, softcap or ALiBi):
                    the native decode kernel reads K/V through the page table (engine.kernels.decode.native_paged)
    mixed step      decodes beside prefills or chunks: the largest group of sequences with the same 1..16 new queries
                    read in place as one call, every other sequence its own planned call (below)
    runs of pages   a sequence with more than RUN_KEYS keys: one planned call per run of its pages, merged by lse, no
                    copy of the whole sequence (engine.paged.runs)
    gathered        the readable path: the sequence's keys gathered from its pages, then its own call with its
                    positions, planned once per step, its kernel chosen as for any call; the oracle of the others
                    (``kernel="reference"`` always takes it; engine.paged.sequences)

Only the slots a sequence owns are read, so a NaN in a slot no sequence owns never reaches an output. Sinks join
once per row, after every part. Pools may be int8 / fp8 ``QuantizedKV`` pools (a quantized cache's): every path reads
them (the others as QuantizedKV runs, which the ``dequantized`` kernel takes when ``decode_native`` does not). A page
table entry -1 is a page a sliding-window cache released: allowed only outside every query's window
(engine.paged.tables).
"""

from __future__ import annotations

import torch

from engine.paged.explain import describe
from engine.paged.plan import plan_paged
from engine.paged.sequences import gather_keys

__all__ = ["paged_attention", "explain_paged", "gather_keys"]


def paged_attention(q: torch.Tensor, k_pages, v_pages, page_table: torch.Tensor, kv_lens: torch.Tensor,
                    query_indptr: torch.Tensor, query_positions: torch.Tensor | None = None, *,
                    window: int | None = None, softcap: float | None = None, scale: float | None = None,
                    sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
                    allowed: torch.Tensor | None = None, score_mod=None, return_lse: bool = False,
                    kernel: str = "auto", cascade: bool | None = None, key_indices: torch.Tensor | None = None):
    """Attention of packed queries to their sequences' paged keys.

    Args:
        q: ``[Nq, Hq, D]``, sequence b's queries are rows ``query_indptr[b] .. query_indptr[b+1]-1``.
        k_pages, v_pages: ``[num_pages, page_size, Hkv, D | Dv]`` pools (q's dtype), or int8 / fp8 ``QuantizedKV``
            pools.
        page_table: int ``[B, max_pages]`` (-1: a released page); kv_lens: int ``[B]`` (the new keys included);
            query_indptr: int ``[B + 1]`` (engine.paged.tables).
        query_positions: int ``[Nq]``; default: sequence b's queries at positions ``kv_len - q_len .. kv_len - 1``.
        window: keys seen per query, its own included (sliding-window attention), or None.
        allowed: bool ``[Nq, K]`` (K >= every kv_len): key j of its sequence visible to query row i only where
            ``allowed[i, j]`` (ANDed with the position rule and the window: a speculative tree's ancestors), or None.
        score_mod: ``(score, sequence, head, query_pos, key_pos) -> score`` as in ``causal_attention`` (its batch
            index the sequence's), or None: each sequence's own call computes it.
        key_indices: int ``[Nq, Hkv|1, K]``: top-k sparse attention, each query row sees only its listed keys of its
            sequence (-1: none; a repeat counts once), with the rule, the window and ``allowed``; or None.
        softcap, scale, sinks ``[Hq]``, alibi_slopes ``[Hq]``: as in ``causal_attention``; kernel: ``"auto"`` or a
            kernel name, for each sequence's call.
        cascade: read a prefix shared by several sequences once for all of them (engine.paged.cascade); None: when
            one of at least CASCADE_MIN_KEYS keys is found.

    Returns:
        ``out [Nq, Hq, Dv]`` in q's dtype (``(out, lse [Nq, Hq])`` with ``return_lse``); a query that sees no key
        gives 0 and lse -inf.
    """
    step = plan_paged(q, k_pages, v_pages, page_table, kv_lens, query_indptr, query_positions, window=window,
                      softcap=softcap, scale=scale, sinks=sinks, alibi_slopes=alibi_slopes, allowed=allowed,
                      score_mod=score_mod, kernel=kernel, cascade=cascade, key_indices=key_indices)
    return step.run(q, k_pages, v_pages, return_lse=return_lse)


def explain_paged(q, k_pages, v_pages, page_table, kv_lens, query_indptr, query_positions=None, *,
                  window: int | None = None, softcap: float | None = None, scale: float | None = None,
                  kernel: str = "auto", cascade: bool | None = None, **modifiers) -> str:
    """Which path ``paged_attention`` with these arguments takes, and each sequence's kernel with the reason."""
    modifiers.pop("return_lse", None)
    step = plan_paged(q, k_pages, v_pages, page_table, kv_lens, query_indptr, query_positions, window=window,
                      softcap=softcap, scale=scale, kernel=kernel, cascade=cascade, sinks=modifiers.get("sinks"),
                      alibi_slopes=modifiers.get("alibi_slopes"), allowed=modifiers.get("allowed"),
                      score_mod=modifiers.get("score_mod"), key_indices=modifiers.get("key_indices"))
    return describe(step)
