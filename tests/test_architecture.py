"""The package's structure: imports run one way (inputs -> dispatch -> kernels -> building blocks), no cycles,
and no kernel imports another (a fallback is dispatch's business)."""

from __future__ import annotations

import ast
from pathlib import Path

import engine
from engine.kernels.dispatch import KERNELS

ROOT = Path(engine.__file__).parent.parent


def _modules() -> dict[str, Path]:
    """The engine package's modules and the lab's (the cost lab and benchmarks, beside the package at the root)."""
    modules = {}
    for path in [*(ROOT / "engine").rglob("*.py"), *(ROOT / "lab").rglob("*.py")]:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """``{module: engine modules it imports}``, anywhere in the module (a function-level import counts too).
    A package's re-export of its own children is not an edge."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(("engine", "lab")):
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            is_package = path.name == "__init__.py"
            graph[name] |= {t for t in targets if t in modules and t != name
                            and not (is_package and t.startswith(name + "."))}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = import_graph()
    graph["engine.inputs"].add("engine.attention")  # attention -> inputs already: now a loop
    assert any({"engine.attention", "engine.inputs"} <= set(component) for component in cycles(graph))


def test_no_kernel_imports_another_kernel():
    kernel_modules = {kernel.run.__module__ for kernel in KERNELS.values()}
    assert len(kernel_modules) == len(KERNELS)  # one module per kernel
    graph = import_graph()
    crossing = {module: graph[module] & (kernel_modules - {module}) for module in kernel_modules}
    assert all(not targets for targets in crossing.values()), crossing


def test_inputs_import_no_kernel():
    assert not any(target.startswith("engine.kernels") for target in import_graph()["engine.inputs"])


def test_the_engine_package_never_imports_the_lab():
    # the wheel holds engine/ only: the lab and the benchmarks live beside it (run.py runs them from the checkout)
    graph = import_graph()
    reaching = {m: sorted(t for t in graph[m] if t.startswith("lab")) for m in graph if m.startswith("engine")}
    assert not any(reaching.values()), {m: t for m, t in reaching.items() if t}
    assert len([m for m in graph if m.startswith("lab.bench.")]) >= 8


def test_lab_commands_import_shared_modules_never_each_other():
    graph = import_graph()
    folders = ("lab.bench.", "lab.figures.", "lab.calculators.")
    commands = {m for m in graph if m.startswith(folders)}
    assert len(commands) >= 8
    sideways = {m: graph[m] & commands for m in commands if graph[m] & commands}
    cases = "lab.bench.kernel_cases"  # one command in a few files each; its cases reuse Case, Impl
    allowed = {"lab.bench.kernels": {cases, "lab.bench.kernel_cases_cuda",
                                            "lab.bench.kernel_suite", "lab.bench.kernel_targets",
                                            "lab.bench.modifier_cases"},
               "lab.bench.kernel_cases_cuda": {cases},
               "lab.bench.kernel_cases_decode": {cases},
               "lab.bench.kernel_suite": {cases, "lab.bench.kernel_cases_decode"},
               "lab.bench.modifier_cases": {cases},
               "lab.bench.cp": {"lab.bench.cp_worker", "lab.bench.cp_model"},
               "lab.bench.serving": {"lab.bench.serving_ways", "lab.bench.serving_peer", "lab.bench.serving_prefix"},
               "lab.bench.serving_peer": {"lab.bench.serving_http"},
               "lab.bench.serving_prefix": {"lab.bench.serving_ways"},
               "lab.bench.paged": {"lab.bench.paged_churn", "lab.bench.paged_placement", "lab.bench.paged_pools",
                                   "lab.bench.paged_step"},
               "lab.bench.paged_churn": {"lab.bench.paged_pools"},
               "lab.bench.paged_placement": {"lab.bench.paged_pools"},
               "lab.bench.paged_step": {"lab.bench.paged_pools"},
               "lab.bench.builds": {"lab.bench.paged_pools"}}
    assert sideways == allowed, sideways


def test_context_parallelism_uses_the_kernels_only_through_the_public_call():
    graph = import_graph()
    distributed = {m for m in graph if m.startswith("engine.distributed")}
    kernel_modules = {kernel.run.__module__ for kernel in KERNELS.values()} | {"engine.kernels.dispatch"}
    assert all(not (graph[m] & kernel_modules) for m in distributed)


def test_every_engine_module_holds_at_most_300_lines():
    # one concept per module: a module past 300 lines holds more than one (split it by what it is)
    long = {name: n for name, path in _modules().items()
            if name.startswith("engine") and (n := len(path.read_text().splitlines())) > 300}
    assert not long, long


def test_the_kernels_that_read_paged_calls_in_place_are_rows_of_the_table():
    # paged K/V is one more input source: the kernels that read it in place say so in ``takes`` and have a paged row
    paged = {name for name, kernel in KERNELS.items() if kernel.paged is not None}
    assert paged == {name for name, kernel in KERNELS.items() if "paged" in kernel.takes} == {"decode_native", "flex"}
