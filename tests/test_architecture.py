"""The package's structure: imports run one way (inputs -> dispatch -> kernels -> building blocks), no cycles,
and no kernel imports another (a fallback is dispatch's business)."""

from __future__ import annotations

import ast
from pathlib import Path

import engine
from engine.kernels.dispatch import KERNELS

ROOT = Path(engine.__file__).parent.parent


def _modules() -> dict[str, Path]:
    modules = {}
    for path in (ROOT / "engine").rglob("*.py"):
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
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("engine"):
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


def test_lab_commands_import_shared_modules_never_each_other():
    graph = import_graph()
    folders = ("engine.lab.bench.", "engine.lab.figures.", "engine.lab.calculators.")
    commands = {m for m in graph if m.startswith(folders)}
    assert len(commands) >= 8
    sideways = {m: graph[m] & commands for m in commands if graph[m] & commands}
    cases = "engine.lab.bench.kernel_cases"  # one command in a few files each; its cases reuse Case, Impl
    allowed = {"engine.lab.bench.kernels": {cases, "engine.lab.bench.kernel_cases_cuda",
                                            "engine.lab.bench.kernel_suite", "engine.lab.bench.kernel_targets",
                                            "engine.lab.bench.modifier_cases"},
               "engine.lab.bench.kernel_cases_cuda": {cases},
               "engine.lab.bench.kernel_cases_decode": {cases},
               "engine.lab.bench.kernel_suite": {cases, "engine.lab.bench.kernel_cases_decode"},
               "engine.lab.bench.modifier_cases": {cases},
               "engine.lab.bench.cp": {"engine.lab.bench.cp_worker", "engine.lab.bench.cp_model"},
               "engine.lab.bench.serving": {"engine.lab.bench.serving_ways"},
               "engine.lab.bench.paged": {"engine.lab.bench.paged_pools", "engine.lab.bench.paged_step"},
               "engine.lab.bench.paged_step": {"engine.lab.bench.paged_pools"}}
    assert sideways == allowed, sideways


def test_context_parallelism_uses_the_kernels_only_through_the_public_call():
    graph = import_graph()
    distributed = {m for m in graph if m.startswith("engine.distributed")}
    kernel_modules = {kernel.run.__module__ for kernel in KERNELS.values()} | {"engine.kernels.dispatch"}
    assert all(not (graph[m] & kernel_modules) for m in distributed)
