"""The import graph of a ``gradflow`` source tree, read from the syntax trees (no import runs).

Every import counts: module level, inside functions, under ``if TYPE_CHECKING:``. ``from P import
N`` is an edge to the module ``P.N`` when there is one (``from gradflow import schema``), else to
``P``; a submodule that imports its own package's ``__init__`` is an edge like any other, so
``adapters/__init__`` importing ``adapters.generic`` while ``generic`` imports ``adapters`` is a cycle.

The *unit* of a module is the subpackage or top-level module of ``gradflow`` it belongs to
(``gradflow.runs.record`` -> ``runs``, ``gradflow.schema`` -> ``schema``; the package's own
``__init__`` -> ``gradflow``). ``docs/architecture.md`` gives each unit a tier; a module may import
modules of its own unit and of units on a lower tier only.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

# The tiers of docs/architecture.md, bottom to top (a unit imports only strictly lower tiers).
TIERS: dict[str, int] = {
    "errors": 0, "version": 0, "progress": 0, "provenance": 0, "formatting": 0,
    "roles": 1, "adapters": 1, "site_names": 1,
    "schema": 2,
    "inputs": 3,
    "losses": 4, "models": 4,
    "hooks": 5,
    "analysis": 6, "training": 6,
    "figures": 7,
    "runs": 8,
    "interventions": 9,
    "explore": 10,
    "gradflow": 11,
    "cli": 12,
    "__main__": 13,
}

UNIT_MEMBERS: dict[str, str] = {"schema_reports": "schema", "schema_keys": "schema"}
"""Top-level modules that belong to another unit (the schema's meanings live beside it, in its unit)."""

Graph = dict[str, set[str]]
"""module -> the gradflow modules it imports (dotted names)."""


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``package_dir`` (a ``gradflow`` folder)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = [package_dir.name, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _known(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest module of the tree that ``name`` starts with (None outside the tree)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported(module: str, path: Path, node: ast.AST, modules: Mapping[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [m for alias in node.names if (m := _known(alias.name, modules))]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".")
        if path.name != "__init__.py":
            base = base[:-1]
        base = base[: len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    found = []
    for alias in node.names:
        target = f"{source}.{alias.name}"
        found.append(target if target in modules else _known(source, modules))
    return [m for m in found if m]


def import_graph(package_dir: Path) -> Graph:
    """Every module's imports of modules in the same tree (self-imports left out)."""
    modules = module_files(package_dir)
    graph: Graph = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            graph[module].update(t for t in _imported(module, path, node, modules) if t != module)
    return graph


def unit_of(module: str) -> str:
    """``gradflow.runs.record`` -> ``runs``; ``gradflow`` -> ``gradflow``; ``gradflow.schema_reports`` -> ``schema``
    (:data:`UNIT_MEMBERS`)."""
    parts = module.split(".")
    unit = parts[1] if len(parts) > 1 else parts[0]
    return UNIT_MEMBERS.get(unit, unit)


def forbidden_edges(graph: Graph, tiers: Mapping[str, int] = TIERS) -> list[str]:
    """``a -> b`` for every import from a unit to a unit on the same or a higher tier, or to a unit
    without a tier (a new unit must be placed in the table first)."""
    bad = []
    for module, targets in sorted(graph.items()):
        here = unit_of(module)
        for target in sorted(targets):
            there = unit_of(target)
            if here == there:
                continue
            if here not in tiers or there not in tiers:
                bad.append(f"{module} -> {target} (unit without a tier: {here if here not in tiers else there})")
            elif tiers[there] >= tiers[here]:
                bad.append(f"{module} -> {target} ({here}, tier {tiers[here]}, may not import {there}, "
                           f"tier {tiers[there]})")
    return bad


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def function_level_imports(package_dir: Path) -> list[str]:
    """``module:line -> target`` for every import of a tree module made inside a function."""
    modules = module_files(package_dir)
    hits = []
    for module, path in modules.items():
        for func in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                for target in _imported(module, path, node, modules):
                    hits.append(f"{module}:{node.lineno} -> {target}")
    return sorted(set(hits))
