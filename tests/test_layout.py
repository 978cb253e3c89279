"""The layout keeps its rules (docs/architecture.md): one place for each contract, one-way imports.

These read the source as text or syntax trees; each rule names the file and line that breaks it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from gradflow.runs import schema

SRC = Path(__file__).resolve().parents[1] / "src" / "gradflow"
MODULES = sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)
MAX_LINES = 420  # "no module over about 400 lines"


def _rel(path: Path) -> str:
    return path.relative_to(SRC).as_posix()


def _lines(pattern: str, skip: tuple[str, ...]) -> list[str]:
    regex = re.compile(pattern)
    hits = []
    for path in MODULES:
        if _rel(path).startswith(skip):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if regex.search(line):
                hits.append(f"{_rel(path)}:{number}: {line.strip()}")
    return hits


def test_no_architecture_branch_outside_adapters():
    comparison = (r"(model_type|\.family)\s*(==|!=|\bin\b|\bnot in\b)|(==|!=)\s*\S*(model_type|\.family)\b"
                  r"|\.get\(\s*[\"']model_type[\"']\s*\)\s*(==|!=|in)")
    assert _lines(comparison, ("adapters/",)) == []


def test_site_names_are_spelled_only_in_the_site_layer():
    assert _lines(r"f[\"']blocks\.|[\"']embeddings\.out[\"']", ("hooks/sites.py",)) == []


def _column_literals(path: Path, columns: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.Tuple, ast.List)):
            names = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if sum(name in columns for name in names) >= 5:
                found.append(f"{_rel(path)}:{node.lineno}: {names[:6]}...")
    return found


def test_run_directory_columns_are_listed_only_in_the_schema():
    columns = {*schema.CHANNEL_COLUMNS, *schema.SUBLAYER_COLUMNS, *schema.SEQUENCE_COLUMNS,
               *(c for cols in schema.DIAGNOSTIC_COLUMNS.values() for c in cols)}
    hits = [hit for path in MODULES if _rel(path) != "runs/schema.py" for hit in _column_literals(path, columns)]
    assert hits == []


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_no_module_over_about_400_lines(path):
    assert len(path.read_text(encoding="utf-8").splitlines()) <= MAX_LINES


def test_every_error_class_lives_in_the_one_tree():
    from gradflow import errors

    stray = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Exception")) \
                    and _rel(path) != "errors.py":
                stray.append(f"{_rel(path)}:{node.lineno}: class {node.name}")
    assert stray == []
    for name in dir(errors):
        obj = getattr(errors, name)
        if isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ == errors.__name__:
            assert issubclass(obj, errors.GradflowError), name


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


# package -> packages of gradflow it must never import (the one-way data flow)
FORBIDDEN = {
    "hooks": ("gradflow.runs.record", "gradflow.runs.diagnose", "gradflow.analysis", "gradflow.figures",
              "gradflow.cli", "gradflow.interventions"),
    "inputs": ("gradflow.hooks", "gradflow.runs", "gradflow.analysis", "gradflow.figures", "gradflow.cli",
               "gradflow.interventions"),
    "adapters": ("gradflow.hooks", "gradflow.runs", "gradflow.analysis", "gradflow.figures", "gradflow.cli",
                 "gradflow.interventions", "gradflow.models", "gradflow.inputs"),
    "figures": ("gradflow.hooks", "gradflow.models", "gradflow.inputs", "gradflow.interventions", "gradflow.cli",
                "gradflow.runs.record", "gradflow.runs.diagnose", "gradflow.runs.channels"),
    "analysis": ("gradflow.runs.record", "gradflow.runs.diagnose", "gradflow.figures", "gradflow.cli",
                 "gradflow.interventions"),
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_flow_one_way(package):
    bad = []
    for path in MODULES:
        if _rel(path).startswith(package + "/"):
            for name in _imports(path):
                if name.startswith(FORBIDDEN[package]):
                    bad.append(f"{_rel(path)} imports {name}")
    assert bad == []


def test_nothing_imports_the_cli():
    bad = [f"{_rel(p)} imports {n}" for p in MODULES if not _rel(p).startswith("cli/") and _rel(p) != "__main__.py"
           for n in _imports(p) if n.startswith("gradflow.cli")]
    assert bad == []
