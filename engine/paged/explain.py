"""What a paged plan runs, in words: ``str(plan)`` and ``engine.explain_paged``.

The kernel that reads the pools in place and why, and why not the other kernels that take paged calls (as
``explain`` says for a contiguous call); on the readable path each sequence's planned kernel and its reason; for a
shared prefix how its pass reads it, then the suffixes' plan."""

from __future__ import annotations

from engine.paged import runs as page_runs

__all__ = ["describe"]


def describe(plan) -> str:
    """The kernel of ``plan`` (a PagedPlan), why, and why not the others; each sequence's own on the readable path."""
    tables = plan.tables
    if plan.path == "cascade":
        lines = []
        for prefix in plan.prefixes:
            rows = len(prefix.rows)
            how = "decode_native in place" if prefix.native is not None else \
                f"a planned call per run of pages ({prefix.why_not_native})"
            lines.append(f"paged: sequences {prefix.members} share their first {prefix.pages * tables.page_size} "
                         f"keys: read once for their {rows} queries ({how}), merged by lse with each one's suffix; "
                         f"the suffixes:")
        return "\n".join(lines + ["  " + line for line in describe(plan.suffix).splitlines()])
    passed = [f"  not {name} in place: {why}" for name, why in plan.choice.passed_over.items()]
    if plan.sequences is None:
        listed = [] if plan.call.key_indices is None or plan.in_place is None else \
            ["  key_indices: only each query row's listed keys read, in place (native_paged_listed)"]
        return "\n".join([f"paged: {plan.reason}", *listed, *passed])
    lines = [f"paged: {plan.reason}" if plan.path == "mixed" else f"paged: each sequence's own call; {plan.reason}",
             *passed]
    planned = {s.b: s for s in plan.sequences.sequences}
    for b in range(tables.batch):
        s, keys = planned.get(b), tables.kv_lens[b]
        queries = tables.starts[b + 1] - tables.starts[b]
        if queries == 0:
            lines.append(f"  sequence {b}: no queries")
        elif s is None:  # a mixed step's decode
            lines.append(f"  sequence {b} ({queries} queries, {keys} keys): read in place by {plan.choice.kernel}")
        elif not s.runs:
            lines.append(f"  sequence {b} ({queries} queries, {keys} keys): no query sees a key")
        elif s.by_runs:
            kernels = sorted({call.kernel for _, _, call in s.runs})
            lines.append(f"  sequence {b} ({queries} queries, {keys} keys): by runs of {page_runs.RUN_KEYS} keys read "
                         f"from its pages, {len(s.runs)} planned calls (kernel {', '.join(kernels)}), merged by lse "
                         f"(no copy of the whole sequence)")
        else:
            call = s.runs[0][2]
            lines.append(f"  sequence {b} ({queries} queries, {keys} keys): gathered, kernel {call.kernel} "
                         f"({call.reason})")
    return "\n".join(lines)
