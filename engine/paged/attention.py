"""Attention over a paged KV cache: a mixed batch of decodes, chunked prefills and prefills in one call.

Each sequence's keys live in fixed-size pages of one pool (engine.paged.tables states the layout); its queries are
packed rows of q. The rule is the engine's one rule with positions: key j of a sequence sits at position j, its
queries by default at its last ``q_len`` positions (``query_positions`` overrides), and key j is visible to a query
iff ``j <= query_pos`` (and ``query_pos - j < window``)::

    page_size 2, sequence 0: kv_len 5, 1 query (decode at position 4); sequence 1: kv_len 3, 3 queries (a prefill)
    q rows:  [ s0 q@4 | s1 q@0 s1 q@1 s1 q@2 ]        query_indptr = [0, 1, 4]

The paths, ``explain_paged`` says which runs and why:

    shared prefix   sequences whose tables begin with the same pages (forks of one prompt): the prefix read once for
                    all their queries, merged by lse with one paged call on the suffixes (engine.paged.cascade)
    flex            ``kernel="flex"`` (and auto on CUDA): FlexAttention over the pools as one key axis, a BlockMask of
                    each sequence's pages (engine.kernels.flex.paged)
    in place        a decode step (every sequence the same 1..16 new queries, CPU, no gradients, softcap or ALiBi):
                    the native decode kernel reads K/V through the page table (engine.paged.native)
    runs of pages   a sequence with more than RUN_KEYS keys: one causal_attention call per run of its pages, merged by
                    lse, no copy of the whole sequence (engine.paged.runs)
    gathered        the readable path: the sequence's keys gathered from its pages, then causal_attention with its
                    positions, its kernel chosen as for any call; the oracle of the others (``kernel="reference"``
                    always takes it)

Only the slots a sequence owns are read, so a NaN in a slot no sequence owns never reaches an output. Sinks join
once per row, after every part. Pools may be int8 / fp8 ``QuantizedKV`` pools (a quantized cache's): every path reads
them (the others as QuantizedKV runs, which the ``dequantized`` kernel takes when ``decode_native`` does not). A page
table entry -1 is a page a sliding-window cache released: allowed only outside every query's window
(engine.paged.tables).
"""

from __future__ import annotations

import torch

from engine.attention import causal_attention
from engine.inputs import resolve_positions, resolve_scale
from engine.kernels.common import needs_grad
from engine.kernels.flex.paged import flex_paged_attention, flex_paged_fits
from engine.kernels.sinks import apply_sinks
from engine.masks.window import window_mask
from engine.modifiers import prepare_modifiers
from engine.paged import runs as page_runs
from engine.paged.cascade import cascade_parts, merge_prefix, shared_prefixes, suffix_tables
from engine.paged.native import native_paged_attention, native_paged_fits
from engine.paged.tables import PagedBatch, check_released, paged_batch
from engine.planning import explain

__all__ = ["paged_attention", "explain_paged", "gather_keys"]


def paged_attention(q: torch.Tensor, k_pages, v_pages, page_table: torch.Tensor, kv_lens: torch.Tensor,
                    query_indptr: torch.Tensor, query_positions: torch.Tensor | None = None, *,
                    window: int | None = None, softcap: float | None = None, scale: float | None = None,
                    sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
                    return_lse: bool = False, kernel: str = "auto", cascade: bool | None = None):
    """Attention of packed queries to their sequences' paged keys.

    Args:
        q: ``[Nq, Hq, D]``, sequence b's queries are rows ``query_indptr[b] .. query_indptr[b+1]-1``.
        k_pages, v_pages: ``[num_pages, page_size, Hkv, D | Dv]`` pools (q's dtype), or int8 / fp8 ``QuantizedKV``
            pools.
        page_table: int ``[B, max_pages]`` (-1: a released page); kv_lens: int ``[B]`` (the new keys included);
            query_indptr: int ``[B + 1]`` (engine.paged.tables).
        query_positions: int ``[Nq]``; default: sequence b's queries at positions ``kv_len - q_len .. kv_len - 1``.
        window: keys seen per query, its own included (sliding-window attention), or None.
        softcap, scale, sinks ``[Hq]``, alibi_slopes ``[Hq]``: as in ``causal_attention``; kernel: ``"auto"`` or a
            kernel name, for each sequence's call.
        cascade: read a prefix shared by several sequences once for all of them (engine.paged.cascade); None: when
            one of at least CASCADE_MIN_KEYS keys is found.

    Returns:
        ``out [Nq, Hq, Dv]`` in q's dtype (``(out, lse [Nq, Hq])`` with ``return_lse``); a query that sees no key
        gives 0 and lse -inf.
    """
    tables = paged_batch(q, k_pages, v_pages, page_table, kv_lens, query_indptr, query_positions is None)
    positions = _query_positions(query_positions, tables, q)
    _check_options(window, alibi_slopes, q.shape[1], cascade)
    scale = resolve_scale(scale, q.shape[2])  # one float for every path (a bad scale refused on each alike)
    check_released(tables, positions, window)
    sinks = prepare_modifiers((q.shape[0], q.shape[1], 1, 1), q.device, sinks=sinks).sinks if sinks is not None \
        else None
    groups = _groups(tables, cascade)
    flex = _flex_fits(q, k_pages, v_pages, tables, softcap, alibi_slopes, sinks, kernel, return_lse) is None
    if not groups and flex and (result := flex_paged_attention(q, k_pages, v_pages, tables, positions, window,
                                                                softcap, scale, sinks, return_lse=return_lse)
                                 ) is not None:  # (None: NaN/inf in q or an overflow: the gathered path is exact)
        return result if return_lse else result[0]  # (sinks applied by the Flex path)
    if groups:  # the shared prefixes once, then one paged call on the suffixes
        modifiers = dict(softcap=softcap, alibi_slopes=alibi_slopes)
        parts, (table, lens, shifted) = cascade_parts(q, k_pages, v_pages, tables, positions, groups, window, scale,
                                                      kernel, {k: x for k, x in modifiers.items() if x is not None})
        out, lse = paged_attention(q, k_pages, v_pages, table, lens, query_indptr, shifted, window=window,
                                   scale=scale, return_lse=True, kernel=kernel, cascade=False, **modifiers)
        out, lse = merge_prefix(out, lse, parts)
    elif native_paged_fits(q, k_pages, v_pages, tables, softcap, alibi_slopes, kernel) is None and (
            result := native_paged_attention(q, k_pages, v_pages, tables, positions, window, scale)) is not None:
        # (None: NaN/inf in q, which the other paths keep to its rows)
        out, lse = result
    else:
        out, lse = _per_sequence(q, k_pages, v_pages, tables, positions, window, scale, kernel,
                                 softcap=softcap, alibi_slopes=alibi_slopes)
    if sinks is not None:  # once per row, after every part: [Nq, Hq, 1, Dv] and [Nq, Hq, 1] as [B, Hq, T, ..]
        out, lse = (x[:, :, 0] for x in apply_sinks(out[:, :, None], lse[:, :, None], sinks))
    return (out, lse) if return_lse else out


def _per_sequence(q, k_pages, v_pages, tables: PagedBatch, positions, window, scale, kernel, **modifiers):
    """Each sequence's own call: its keys a run of pages at a time (engine.paged.runs) when it has more than one run
    (with any kernel but ``reference``), else gathered from its pages (the readable path)."""
    modifiers = {name: x for name, x in modifiers.items() if x is not None}
    q_heads, dv = q.shape[1], v_pages.shape[3]
    out = q.new_zeros(q.shape[0], q_heads, dv)  # [Nq, Hq, Dv]
    lse = torch.full((q.shape[0], q_heads), float("-inf"), dtype=torch.float64 if q.dtype == torch.float64
                     else torch.float32, device=q.device)  # [Nq, Hq]
    pages = tables.pages  # [B] lists of page ids
    for b in range(tables.batch):
        rows = tables.query_rows(b)
        if rows.stop == rows.start:
            continue
        if _by_runs(tables, b, kernel):
            q_b = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
            o, part_lse = page_runs.run_attention(q_b, k_pages, v_pages, pages[b], tables.page_size, 0,
                                                  tables.kv_lens[b], positions[rows], window, scale, kernel,
                                                  **modifiers)
        else:
            args = _sequence_call(q, k_pages, v_pages, tables, pages[b], positions, b, window)
            o, part_lse = causal_attention(*args, scale, return_lse=True, kernel=kernel,
                                           **modifiers)  # [1, Hq, q_len, Dv], [1, Hq, q_len]
        out[rows] = o[0].transpose(0, 1).to(out.dtype)  # [q_len, Hq, Dv]
        lse[rows] = part_lse[0].transpose(0, 1).to(lse.dtype)  # [q_len, Hq]
    return out, lse


def _flex_fits(q, k_pages, v_pages, tables: PagedBatch, softcap, alibi_slopes, sinks, kernel: str,
               return_lse: bool) -> str | None:
    """Why the in-place Flex path does not run this call (None: it does): ``kernel="flex"`` asks for it; ``auto``
    takes it on CUDA (on the CPU the native kernel and the fused op are faster, measured)."""
    if kernel != "flex" and not (kernel == "auto" and q.device.type == "cuda"):
        return "Flex in place: kernel='flex', or auto on CUDA"
    return flex_paged_fits(q, k_pages, v_pages, tables, softcap, alibi_slopes, sinks, needs_grad(q, k_pages, v_pages),
                           return_lse=return_lse)


def _by_runs(tables: PagedBatch, b: int, kernel: str) -> bool:
    """Sequence b read a run of pages at a time: more than one run of keys, and not the readable twin (reference)."""
    run = max(page_runs.RUN_KEYS // tables.page_size, 1) * tables.page_size
    return kernel != "reference" and tables.kv_lens[b] > run


def _groups(tables: PagedBatch, cascade: bool | None):
    if cascade is False:
        return []
    return shared_prefixes(tables, min_keys=1 if cascade else None)


def explain_paged(q, k_pages, v_pages, page_table, kv_lens, query_indptr, query_positions=None, *,
                  window: int | None = None, softcap: float | None = None, scale: float | None = None,
                  kernel: str = "auto", cascade: bool | None = None, **modifiers) -> str:
    """Which path ``paged_attention`` with these arguments takes, and each sequence's kernel with the reason."""
    tables = paged_batch(q, k_pages, v_pages, page_table, kv_lens, query_indptr, query_positions is None)
    positions = _query_positions(query_positions, tables, q)
    check_released(tables, positions, window)
    scale = resolve_scale(scale, q.shape[2])
    alibi = modifiers.get("alibi_slopes")
    groups = _groups(tables, cascade)
    why_not_flex = _flex_fits(q, k_pages, v_pages, tables, softcap, alibi, modifiers.get("sinks"), kernel,
                              modifiers.get("return_lse", False))
    if not groups and why_not_flex is None:
        return "paged: Flex reads K/V in place from the pools (a BlockMask of each sequence's pages; no gathered copy)"
    lines = []
    for members, pages in groups:
        rows = sum(tables.starts[b + 1] - tables.starts[b] for b in members)
        prefix = PagedBatch([0, rows], [pages * tables.page_size], tables.page_table[members[:1], :pages],
                            tables.page_size)
        why_not = native_paged_fits(q, k_pages, v_pages, prefix, softcap, alibi, kernel, one_pass=True)
        how = "decode_native in place" if why_not is None else f"causal_attention by runs of pages ({why_not})"
        lines.append(f"paged: sequences {members} share their first {pages * tables.page_size} keys: read once for "
                     f"their {rows} queries ({how}), merged by lse with each one's suffix; the suffixes:")
    if lines:  # the suffix pass is a paged call of its own (cascade=False), explained as any
        table, lens, shifted = suffix_tables(tables, _groups(tables, cascade), positions)
        return "\n".join(lines + ["  " + line for line in explain_paged(
            q, k_pages, v_pages, table, lens, query_indptr, shifted, window=window, softcap=softcap, scale=scale,
            kernel=kernel, cascade=False, **modifiers).splitlines()])
    why_not = native_paged_fits(q, k_pages, v_pages, tables, softcap, alibi, kernel)
    if why_not is None:
        return ("paged: decode_native reads K/V in place through the page table (every sequence "
                f"{tables.starts[1] - tables.starts[0]} queries; no gathered copy)")
    lines = [f"paged: each sequence's own call; not decode_native in place: {why_not}"]
    for b in range(tables.batch):
        if tables.query_rows(b).stop == tables.query_rows(b).start:
            lines.append(f"  sequence {b}: no queries")
            continue
        if _by_runs(tables, b, kernel):
            lines.append(f"  sequence {b} ({tables.query_rows(b).stop - tables.query_rows(b).start} queries, "
                         f"{tables.kv_lens[b]} keys): by runs of {page_runs.RUN_KEYS} keys read from its pages, each "
                         f"one causal_attention call, merged by lse (no copy of the whole sequence)")
            continue
        args = _sequence_call(q, k_pages, v_pages, tables, tables.pages[b], positions, b, window)
        choice = explain(*args, scale, softcap=softcap, kernel=kernel, **modifiers)
        lines.append(f"  sequence {b} ({args[0].shape[2]} queries, {tables.kv_lens[b]} keys): gathered, kernel "
                     f"{choice.kernel} ({choice.reason})")
    return "\n".join(lines)


def gather_keys(pages, owned: list[int], length: int, page_size: int):
    """A sequence's ``length`` keys (or values) from its pages, ``[1, Hkv, length, E]`` (a QuantizedKV from
    quantized pools): only the slots it owns (its pages' run from key 0, engine.paged.runs.run_keys)."""
    return page_runs.run_keys(pages, owned, 0, length, page_size)


def _sequence_call(q, k_pages, v_pages, tables: PagedBatch, pages: list[int], positions: torch.Tensor, b: int,
                   window: int | None):
    """``(q, k, v, query_positions, key_positions, allowed)`` of sequence b (its ``pages``) as one causal_attention
    call."""
    rows, length = tables.query_rows(b), tables.kv_lens[b]
    q_b = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
    k_b = gather_keys(k_pages, pages, length, tables.page_size)  # [1, Hkv, S_b, D]
    v_b = gather_keys(v_pages, pages, length, tables.page_size)  # [1, Hkv, S_b, Dv]
    query_pos = positions[rows]  # [q_len]
    key_pos = torch.arange(length, device=q.device)  # [S_b]
    allowed = None if window is None else window_mask(query_pos, key_pos, window)  # [q_len, S_b]
    return q_b, k_b, v_b, query_pos, key_pos, allowed


def _query_positions(query_positions, tables: PagedBatch, q: torch.Tensor) -> torch.Tensor:
    """int64 ``[Nq]``: the given positions, or each sequence's last ``q_len`` key positions."""
    if query_positions is not None:
        return resolve_positions(query_positions, 1, q.shape[0], 0, q.device, "query_positions")[0]  # [Nq]
    default = [torch.arange(tables.kv_lens[b] - (tables.starts[b + 1] - tables.starts[b]), tables.kv_lens[b])
               for b in range(tables.batch)]
    return torch.cat(default).to(q.device) if default else torch.zeros(0, dtype=torch.long, device=q.device)


def _check_options(window, alibi_slopes, q_heads: int, cascade) -> None:
    if cascade is not None and not isinstance(cascade, bool):
        raise ValueError(f"cascade must be True, False or None (auto), got {cascade!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int (keys seen, own included) or None, got {window!r}")
    if alibi_slopes is not None and (not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dim() != 1):
        raise ValueError(f"alibi_slopes of a paged call must be [Hq] = [{q_heads}] (one slope per query head), got "
                         f"{getattr(alibi_slopes, 'shape', type(alibi_slopes).__name__)}")
