"""The layout keeps its rules (docs/architecture.md): one place for each contract, one-way imports.

These read the source as text or syntax trees; each rule names the file and line that breaks it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import import_graph

from gradflow import schema

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
    assert _lines(r"f[\"']blocks\.|[\"']embeddings\.out[\"']", ("site_names.py",)) == []


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
    hits = [hit for path in MODULES if _rel(path) != "schema.py" for hit in _column_literals(path, columns)]
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


GRAPH = import_graph.import_graph(SRC)


def test_imports_follow_the_tiers_of_the_architecture():
    """Every import (function-level and TYPE_CHECKING ones included) goes to a strictly lower tier."""
    assert import_graph.forbidden_edges(GRAPH) == []


def test_no_import_cycles():
    assert import_graph.cycles(GRAPH) == []


def test_every_unit_has_a_tier():
    assert {import_graph.unit_of(m) for m in GRAPH} <= set(import_graph.TIERS)


def test_function_level_imports_of_gradflow_only_in_the_cli():
    """The CLI imports a command's library code when the command runs (``gradflow --help`` stays fast);
    everywhere else gradflow's own imports sit at the top of the module, where the graph shows them."""
    assert [hit for hit in import_graph.function_level_imports(SRC) if not hit.startswith("gradflow.cli.")] == []


def test_architecture_doc_lists_every_unit_with_its_tier():
    """docs/architecture.md's tier table is the one this test enforces."""
    text = (SRC.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and cells[0].isdigit():
            for unit in re.findall(r"`([a-z_]+)`", cells[1]):
                rows[unit] = int(cells[0])
    assert rows == import_graph.TIERS


def _planted(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of the source tree with ``line`` added inside a new function of ``module`` (a file path)."""
    copy = tmp_path / "gradflow"
    for path in MODULES:
        (copy / _rel(path)).parent.mkdir(parents=True, exist_ok=True)
        (copy / _rel(path)).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    target = copy / module
    target.write_text(target.read_text(encoding="utf-8") + f"\n\ndef _planted():\n    {line}\n", encoding="utf-8")
    return copy


def test_the_graph_test_catches_a_planted_forbidden_edge(tmp_path):
    tree = _planted(tmp_path, "analysis/profiles.py", "from gradflow.runs.record import record_corpus")
    bad = import_graph.forbidden_edges(import_graph.import_graph(tree))
    assert bad and bad[0].startswith("gradflow.analysis.profiles -> gradflow.runs.record")


def test_the_graph_test_catches_a_planted_cycle(tmp_path):
    tree = _planted(tmp_path, "runs/files.py", "from gradflow.runs import record")
    graph = import_graph.import_graph(tree)
    assert import_graph.forbidden_edges(graph) == []  # one unit: allowed by the tiers, caught as a cycle
    assert any({"gradflow.runs.files", "gradflow.runs.record"} <= set(c) for c in import_graph.cycles(graph))


def test_the_graph_test_catches_a_child_importing_its_package(tmp_path):
    tree = _planted(tmp_path, "adapters/generic.py", "from gradflow.adapters import adapter_for")
    assert ["gradflow.adapters", "gradflow.adapters.generic"] in [
        sorted(set(c) & {"gradflow.adapters", "gradflow.adapters.generic"}) for c in
        import_graph.cycles(import_graph.import_graph(tree))]


def test_nothing_imports_the_cli():
    bad = [f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets
           if t.startswith("gradflow.cli") and not m.startswith(("gradflow.cli", "gradflow.__main__"))]
    assert bad == []


TESTS = Path(__file__).resolve().parent
MAX_TOP_LEVEL_TEST_FILES = 10
"""Test files directly under tests/ (the layout rules and the modules outside any package); the rest mirror src."""


def test_every_package_has_its_tests_folder():
    """tests/ is laid out like the package: src/gradflow/<package>/ -> tests/<package>/ with at least one test file."""
    packages = sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").is_file())
    missing = [name for name in packages if not list((TESTS / name).glob("test_*.py"))]
    assert packages and not missing, f"packages without tests/<package>/test_*.py: {missing}"


def test_at_most_ten_test_files_sit_directly_under_tests():
    top = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert len(top) <= MAX_TOP_LEVEL_TEST_FILES, f"{len(top)} test files directly under tests/: move them into the " \
        f"folder of the package they test: {top}"


def test_test_file_names_are_unique_across_folders():
    """Test folders have no __init__.py (pytest imports a test file by its name), so two files may not share one."""
    names = [p.name for p in TESTS.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
