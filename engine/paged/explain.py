"""What a paged plan runs, in words: ``str(plan)`` and ``engine.explain_paged`` (which also names each sequence's
kernel where each runs its own call, from the call's tensors)."""

from __future__ import annotations

from engine.paged import runs as page_runs
from engine.paged.native import native_paged_fits
from engine.paged.sequences import by_runs, sequence_call
from engine.paged.tables import PagedBatch
from engine.planning import explain

__all__ = ["describe"]


def describe(plan, tensors: tuple | None = None, modifiers: dict | None = None) -> str:
    """The path of ``plan`` (a PagedPlan) and why; with ``tensors = (q, k_pages, v_pages)``, each sequence's kernel
    and its reason on the per-sequence path (``modifiers``: the call's, as explain takes them)."""
    tables = plan.tables
    if plan.path in ("flex", "native in place"):
        return f"paged: {plan.reason}"
    if plan.path == "cascade":
        lines = []
        for (members, pages), how in zip(plan.groups, _prefix_passes(plan, tensors)):
            rows = sum(tables.starts[b + 1] - tables.starts[b] for b in members)
            lines.append(f"paged: sequences {members} share their first {pages * tables.page_size} keys: read once "
                         f"for their {rows} queries ({how}), merged by lse with each one's suffix; the suffixes:")
        return "\n".join(lines + ["  " + line for line in describe(plan.suffix, tensors, modifiers).splitlines()])
    lines = [f"paged: each sequence's own call; {plan.reason}"]
    for b in range(tables.batch):
        rows = tables.query_rows(b)
        if rows.stop == rows.start:
            lines.append(f"  sequence {b}: no queries")
        elif by_runs(tables, b, plan.kernel):
            lines.append(f"  sequence {b} ({rows.stop - rows.start} queries, {tables.kv_lens[b]} keys): by runs of "
                         f"{page_runs.RUN_KEYS} keys read from its pages, each one causal_attention call, merged by "
                         f"lse (no copy of the whole sequence)")
        elif tensors is None:
            lines.append(f"  sequence {b} ({rows.stop - rows.start} queries, {tables.kv_lens[b]} keys): gathered, "
                         f"its kernel chosen as for any call (engine.explain_paged names it)")
        else:
            args = sequence_call(*tensors, tables, tables.pages[b], plan.positions, b, plan.window)
            choice = explain(*args, plan.scale, softcap=plan.softcap, kernel=plan.kernel, **(modifiers or {}))
            lines.append(f"  sequence {b} ({args[0].shape[2]} queries, {tables.kv_lens[b]} keys): gathered, kernel "
                         f"{choice.kernel} ({choice.reason})")
    return "\n".join(lines)


def _prefix_passes(plan, tensors) -> list[str]:
    """How each shared prefix is read: in place by the native kernel, or by runs of pages (and why)."""
    if tensors is None:
        return ["decode_native in place where it fits, else by runs of pages"] * len(plan.groups)
    q, k_pages, v_pages = tensors
    tables, passes = plan.tables, []
    for members, pages in plan.groups:
        rows = sum(tables.starts[b + 1] - tables.starts[b] for b in members)
        prefix = PagedBatch([0, rows], [pages * tables.page_size], tables.page_table[members[:1], :pages],
                            tables.page_size)
        why_not = native_paged_fits(q, k_pages, v_pages, prefix, plan.softcap, plan.alibi_slopes, plan.kernel,
                                    one_pass=True)
        passes.append("decode_native in place" if why_not is None else f"causal_attention by runs of pages "
                                                                        f"({why_not})")
    return passes
