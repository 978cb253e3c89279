"""README.md's examples run as written: every Python block runs (offline), every ``gradflow`` shell
line parses with the real command line, and the offline ones among them run."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gradflow.cli import build_parser, main

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```(python|bash)\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
GRADFLOW_LINES = [line.split("  #")[0].strip() for lang, code in BLOCKS if lang == "bash"
                  for line in code.splitlines() if line.strip().startswith("gradflow ")]
OFFLINE = ("gradflow zoo list", "gradflow channels --model gradflow-mini-en", "gradflow surgery --model gradflow-mini-en")


def test_readme_has_examples():
    assert len(PYTHON) >= 2 and len(GRADFLOW_LINES) >= 8


@pytest.mark.parametrize("code", PYTHON, ids=[f"python-block-{i}" for i in range(len(PYTHON))])
def test_python_block_runs_as_written(code, tmp_path):
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("line", GRADFLOW_LINES)
def test_shell_line_parses(line):
    build_parser().parse_args(shlex.split(line)[1:])


@pytest.mark.parametrize("line", [line for line in GRADFLOW_LINES if line.startswith(OFFLINE)])
def test_offline_shell_line_runs(line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(line)[1:]) == 0
