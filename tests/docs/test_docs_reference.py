"""The generated reference pages are what their generators make now, and say what the code does.

docs/reference/cli.md (docs/make_cli_reference.py: the real parser), run-directory.md
(docs/make_run_directory_reference.py: the schema modules), errors.md (docs/make_errors_reference.py: the
exception tree and the exit codes, checked here against the codes the command line returns).
"""

from __future__ import annotations

import argparse
import ast
import runpy
from pathlib import Path

import pytest

from gradflow import errors
from gradflow import schema as S
from gradflow import schema_reports as R
from gradflow.cli import build_parser, main
from gradflow.cli import check as check_command

ROOT = Path(__file__).resolve().parents[2]
GENERATORS = {"cli": "make_cli_reference.py", "run-directory": "make_run_directory_reference.py",
              "errors": "make_errors_reference.py"}


def _generator(page: str) -> dict:
    return runpy.run_path(str(ROOT / "docs" / GENERATORS[page]))


def _page(page: str) -> str:
    return (ROOT / "docs" / "reference" / f"{page}.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("page", list(GENERATORS))
def test_page_is_current(page):
    assert _page(page) == _generator(page)["render"](), \
        f"docs/reference/{page}.md is stale: run python docs/{GENERATORS[page]}"


def _parsers(parser: argparse.ArgumentParser, prog: str = "gradflow"):
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{prog} {name}")


def test_cli_page_lists_every_command_and_option():
    page = _page("cli")
    parsers = list(_parsers(build_parser()))
    assert len(parsers) > 15
    for prog, parser in parsers[1:]:
        assert f"`{prog}`" in page, prog
        for action in parser._actions:
            if action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
                for option in action.option_strings:
                    assert f"`{option}`" in page, (prog, option)


def test_run_directory_page_has_every_column_and_key():
    page = _page("run-directory")
    for file, _cmd, columns in R.TABLE_FILES.values():
        assert f"### `{file}`" in page
        assert all(f"| `{c}` |" in page for c in columns), file
    for keys in (R.RECORD_META_KEYS, R.CHECK_JSON_KEYS, S.CALLBACK_FIELDS, S.CALLBACK_QUANTITIES, S.NEW_ROWS_FIELDS,
                 S.EVAL_FIELDS, S.MLM_LOG_FIELDS, S.ATLAS_METRICS):
        assert all(f"| `{k}` |" in page for k in keys)


def _returned_codes() -> set[int]:
    """Every ``return <int>`` of the command line's modules."""
    codes = set()
    for path in sorted((ROOT / "src" / "gradflow" / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Constant) \
                    and type(node.value.value) is int:
                codes.add(node.value.value)
    return codes


def test_errors_page_lists_the_exit_codes_the_cli_returns():
    listed = set(_generator("errors")["EXIT_CODES"])
    assert listed - {1} == _returned_codes() | {2}  # 1: Python's own for an uncaught exception; 2: argparse too
    page = _page("errors")
    for name in dir(errors):
        obj = getattr(errors, name)
        if isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ == errors.__name__:
            assert f"`{name}`" in page, name


def test_the_exit_codes_are_the_ones_listed(tmp_path, capsys, monkeypatch):
    assert main(["report", str(tmp_path / "missing"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("gradflow: error: ")
    def out_of_memory(args, argv):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(check_command, "run", out_of_memory)  # what `gradflow check` runs
    assert main(["check"]) == 2
    assert "out of memory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["record", "--no-such-option"])
    assert refused.value.code == 2
