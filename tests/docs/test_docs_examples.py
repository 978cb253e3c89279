"""The examples of README.md and every docs/**/*.md page run as written.

- every ```python block runs in a subprocess (offline, with a timeout); the blocks of one page share a fresh
  working directory and run in page order, as a reader following the page would run them;
- every ``gradflow ...`` line of a ```bash block parses with the real command line, and the offline lines
  of :data:`OFFLINE` run;
- a block preceded by ``<!-- not run: REASON -->`` is not run (its ``gradflow`` lines are still parsed, its Python
  compiled): its test checks that REASON is given, and its id ends in ``not-run`` so that it shows in the test list.

Test ids name the page and the block (``docs/guides/record.md#3-python``, counted over the page's python and
bash blocks from 1).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from gradflow.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>python|bash|sh|shell)[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$",
                   flags=re.DOTALL | re.MULTILINE)
EXCLUDED = {"docs/guides/callback.md": "run by tests/docs/test_docs_callback_example.py (with fewer steps)"}
"""Pages whose blocks another test runs: not run twice (listed here with the reason)."""
OFFLINE = ("gradflow zoo list", "gradflow channels --model gradflow-mini-en",
           "gradflow surgery --model gradflow-mini-en")
"""``gradflow`` lines that run here: offline, seconds on a CPU."""
TIMEOUT_S = 300
ENV_PREFIX = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)+")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "MPLBACKEND": "Agg"}


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: its page (relative to the repository), number (1.. over the page's python and
    bash blocks), language, code, and the reason it is not run (None for a block that runs)."""

    page: str
    number: int
    lang: str
    code: str
    not_run: str | None = None

    @property
    def id(self) -> str:
        return f"{self.page}#{self.number}-{self.lang}" + ("" if self.not_run is None else "-not-run")


def not_run_reason(before: str) -> str | None:
    """The REASON of a ``<!-- not run: REASON -->`` comment ending ``before`` (blank lines allowed), else None."""
    before = before.rstrip()
    if not before.endswith("-->") or "<!--" not in before:
        return None
    comment = before[before.rindex("<!--") + 4:-3].strip()
    return comment[len("not run:"):].strip() if comment.startswith("not run:") else None


def page_blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """The python and bash blocks of the page at ``path``, each with the not-run reason above it."""
    text = path.read_text(encoding="utf-8")
    page = path.relative_to(root).as_posix()
    blocks = []
    for number, match in enumerate(FENCE.finditer(text), 1):
        reason = not_run_reason(text[:match.start()])
        if reason is None and page in EXCLUDED and match["lang"] == "python":
            reason = EXCLUDED[page]
        code = "\n".join(line[len(match["indent"]):] for line in match["code"].splitlines())
        lang = "python" if match["lang"] == "python" else "bash"  # ```sh and ```shell read as bash
        blocks.append(Block(page, number, lang, code, reason))
    return blocks


def gradflow_lines(code: str) -> list[str]:
    """The ``gradflow ...`` command lines of a bash block: continuations joined, a ``$`` prompt and leading
    ``VAR=value`` assignments dropped, comments, pipes and redirections cut off."""
    joined = re.sub(r"\\\n\s*", " ", code)
    lines = []
    for line in joined.splitlines():
        line = ENV_PREFIX.sub("", line.strip().removeprefix("$ "))
        if not line.startswith("gradflow "):
            continue
        words = shlex.split(line, comments=True)
        for i, word in enumerate(words):
            if word in ("|", "||", "&&", ";", ">", ">>", "2>", "2>&1", "&") or word.startswith((">", "2>")):
                words = words[:i]
                break
        lines.append(shlex.join(words))
    return lines


def without_repeats(blocks: list[Block]) -> list[Block]:
    """``blocks`` with each python block whose code an earlier page already runs marked not run (README.md and
    docs/index.md share their examples): listed under its own id, run once."""
    first: dict[str, str] = {}
    out = []
    for block in blocks:
        if block.lang == "python" and block.not_run is None:
            if block.code in first:
                block = replace(block, not_run=f"the same code as {first[block.code]}, which runs")
            else:
                first[block.code] = block.id
        out.append(block)
    return out


BLOCKS = without_repeats([block for page in PAGES for block in page_blocks(page)])
PYTHON = [b for b in BLOCKS if b.lang == "python"]
LINES = [(b, line) for b in BLOCKS if b.lang == "bash" for line in gradflow_lines(b.code)]


def test_the_pages_have_examples():
    assert len(PYTHON) >= 2 and len(LINES) >= 8
    assert any(b.page == "README.md" for b in PYTHON)


def test_the_not_run_marker_is_read(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n<!-- not run: needs a GPU -->\n```python\nraise SystemExit(1)\n```\n\n"
                    "```python\nx = 1\n```\n", encoding="utf-8")
    first, second = page_blocks(page, tmp_path)
    assert first.not_run == "needs a GPU" and first.id.endswith("#1-python-not-run")
    assert second.not_run is None and second.id.endswith("#2-python")
    assert not_run_reason("<!-- not run: -->\n\n") == "" and not_run_reason("<!-- other -->") is None


def test_gradflow_lines_are_read_as_a_shell_would():
    code = ("$ gradflow zoo list  # the models\nHF_HUB_OFFLINE=1 gradflow check --model m \\\n  --json > out.json\n"
            "echo gradflow demo\ngradflow report a --out b | tee log\n")
    assert gradflow_lines(code) == ["gradflow zoo list", "gradflow check --model m --json", "gradflow report a --out b"]


@pytest.fixture(scope="module")
def page_dirs(tmp_path_factory) -> dict[str, Path]:
    """One working directory per page, shared by its python blocks (which run in page order)."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_block_runs_as_written(block, page_dirs, tmp_path_factory):
    if block.not_run is not None:
        assert block.not_run, f"{block.id}: <!-- not run: REASON --> needs a reason"
        compile(block.code, block.id, "exec")  # not run, but at least valid Python
        return
    cwd = page_dirs.setdefault(block.page, tmp_path_factory.mktemp(re.sub(r"\W", "_", block.page)))
    env = {**os.environ, **OFFLINE_ENV}
    proc = subprocess.run([sys.executable, "-c", block.code], cwd=cwd, capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env, check=False)
    assert proc.returncode == 0, f"{block.id} failed:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize(("block", "line"), LINES, ids=[f"{b.id}:{line}" for b, line in LINES])
def test_shell_line_parses(block, line):
    assert block.not_run is None or block.not_run, f"{block.id}: <!-- not run: REASON --> needs a reason"
    build_parser().parse_args(shlex.split(line)[1:])


def _first_offline_lines() -> list[tuple[Block, str]]:
    """The offline lines that run, each once (at its first page)."""
    first: dict[str, tuple[Block, str]] = {}
    for block, line in LINES:
        if block.not_run is None and line.startswith(OFFLINE):
            first.setdefault(line, (block, line))
    return list(first.values())


RUN_LINES = _first_offline_lines()


@pytest.mark.parametrize(("block", "line"), RUN_LINES, ids=[f"{b.id}:{line}" for b, line in RUN_LINES])
def test_offline_shell_line_runs(block, line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)
    assert main(shlex.split(line)[1:]) == 0
