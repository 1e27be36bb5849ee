"""The layering of docs/architecture.md, read from the source: a violation fails here, not in review.

- the runtime (`verl_fused_hook`) imports nothing of the harness (`verl_fused_hook_harness`) or of `tests`;
- `verl_fused_hook.ops` imports nothing of the package outside `ops` (only torch, triton, verl lazily) but the
  LEAF_MODULES (the argument checks and the log-once), which import nothing of the package themselves;
- no import cycle among the modules of either package;
- no module over MAX_LINES lines. The limit is a backstop, not a design rule: merge by concept, split by concept
  (a module is one concept: a kernel and its launch, a driver and its helpers), never by line count.

Every `import` statement counts, function-local ones too. A package's `__init__` is imported implicitly by
its submodules; that is Python's machinery, not an edge of ours, so only written import statements count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME, HARNESS = "verl_fused_hook", "verl_fused_hook_harness"
MAX_LINES = 600
# Modules of the runtime that `ops` may import: each imports nothing of the package
LEAF_MODULES = (f"{RUNTIME}.checks", f"{RUNTIME}.log_once")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(package: str) -> dict[str, Path]:
    return {_module_name(path): path for path in sorted((ROOT / package).rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` (or packages `tests`) that `path`'s import statements name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            # `from package import submodule` imports the submodule; any other name comes from `package` itself
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
            targets = submodules if len(submodules) == len(node.names) else [base, *submodules]
        else:
            continue
        for target in targets:
            if target in known or target.split(".")[0] == "tests":
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {**_modules(RUNTIME), **_modules(HARNESS)}
    known = set(modules)
    return {name: _imports(name, path, known) - {name} for name, path in modules.items()}


GRAPH = _graph()


def test_the_graph_reads_every_module():
    assert f"{RUNTIME}.ops" in GRAPH and f"{HARNESS}.cli" in GRAPH
    assert any(target.startswith(f"{RUNTIME}.ops") for target in GRAPH[f"{RUNTIME}.hook"])


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.split(".")[0] == RUNTIME))
def test_the_runtime_never_imports_the_harness_or_tests(module):
    bad = sorted(t for t in GRAPH[module] if t.split(".")[0] in (HARNESS, "tests"))
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith(f"{RUNTIME}.ops")))
def test_ops_import_nothing_else_of_the_package(module):
    bad = sorted(
        t
        for t in GRAPH[module]
        if t.split(".")[0] in (RUNTIME, HARNESS) and not t.startswith(f"{RUNTIME}.ops") and t not in LEAF_MODULES
    )
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module", LEAF_MODULES)
def test_leaf_modules_import_nothing_of_the_package(module):
    assert module in GRAPH
    bad = sorted(t for t in GRAPH[module] if t.split(".")[0] in (RUNTIME, HARNESS, "tests"))
    assert not bad, f"{module} imports {bad}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("package", [RUNTIME, HARNESS])
def test_no_module_over_the_line_limit(package):
    long = {
        name: n for name, path in _modules(package).items() if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"
