"""analyses/README.md, the Reproduce index: it names every committed file under figures/ (and no path
that is not there), only make targets that exist, every target of the Makefile, and the old target
names run the commands of the new ones.

Paths in the index are backticked patterns: ``*`` within one folder, ``**`` across folders,
``{a,b}`` alternatives (``{,_x}``: with and without ``_x``); a folder ending in ``/`` is prose, not an entry."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INDEX = REPO / "analyses" / "README.md"
MAKEFILE = REPO / "analyses" / "Makefile"
TARGET = re.compile(r"^([a-z0-9][a-z0-9-]*)\s*:(?!=)", re.MULTILINE)
PATTERN = re.compile(r"`(figures/[^`\s]*[^/`\s])`")  # a folder (ending in /) is prose, not an entry
TIME = re.compile(r"\d[\d,.]*\s*(s|min|h|days)\b|not (run|timed|recorded)|\d+ min\b")
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def expand_braces(pattern: str) -> list[str]:
    """``a{b,c}d`` -> ``abd``, ``acd`` (no nesting)."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end():]
    return [p for alt in match.group(1).split(",") for p in expand_braces(head + alt + tail)]


def pattern_regex(pattern: str) -> re.Pattern:
    """A path pattern as a regular expression: ``*`` one folder level, ``**`` any depth."""
    out = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
    return re.compile(out + "$")


def index_patterns(text: str) -> dict[str, list[re.Pattern]]:
    return {p: [pattern_regex(e) for e in expand_braces(p)] for p in PATTERN.findall(text)}


def committed_figures() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "figures"], cwd=REPO, check=True, capture_output=True, text=True)
    files = [f for f in out.stdout.split("\0") if f]
    assert files, "git ls-files listed nothing under figures/"
    return files


def tables(text: str, header: str) -> list[list[str]]:
    """Rows (cells) of every Markdown table whose header row contains ``header``."""
    rows, inside = [], False
    for line in text.splitlines():
        if not line.startswith("|"):
            inside = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header in cells:
            inside, column = True, cells.index(header)
            continue
        if inside and not set(line) <= set("|-: "):
            rows.append(cells + [cells[column]])  # the last element: the named column's cell
    return rows


def names(cell: str) -> list[str]:
    return re.findall(r"`([a-z0-9][a-z0-9-]*)`", cell)


def makefile_targets() -> dict[str, str]:
    """Target -> its ``##`` comment ("" if none)."""
    found = {}
    for line in MAKEFILE.read_text(encoding="utf-8").splitlines():
        match = TARGET.match(line)
        if match:
            found[match.group(1)] = line.split("## ", 1)[1] if "## " in line else ""
    return found


def dry_run(*targets: str) -> list[str]:
    result = subprocess.run(["make", "-s", "-n", "-C", str(REPO / "analyses"), *targets], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, f"make -n {' '.join(targets)}: {result.stderr}"
    return [line for line in result.stdout.splitlines() if line.strip()]


def test_every_committed_figure_and_table_is_indexed():
    patterns = index_patterns(INDEX.read_text(encoding="utf-8"))
    missing = [f for f in committed_figures() if not any(r.match(f) for rs in patterns.values() for r in rs)]
    assert not missing, (f"{len(missing)} committed files under figures/ are not named in analyses/README.md "
                         f"(add them, or a pattern, to the index with the make target that writes them): "
                         f"{missing[:10]}")


def test_every_indexed_path_is_committed():
    files = committed_figures()
    stale = [p for p, rs in index_patterns(INDEX.read_text(encoding="utf-8")).items()
             if not any(r.match(f) for r in rs for f in files)]
    assert not stale, f"analyses/README.md names paths under figures/ that are not committed: {stale}"


def test_patterns():
    assert expand_braces("a{,_x}.{csv,png}") == ["a.csv", "a.png", "a_x.csv", "a_x.png"]
    assert pattern_regex("figures/report/*/*.png").match("figures/report/run/x.png")
    assert not pattern_regex("figures/report/*.png").match("figures/report/run/x.png")
    assert pattern_regex("figures/probes/**").match("figures/probes/runs/a/b.csv")


def test_the_index_names_only_existing_targets_and_every_target():
    text = INDEX.read_text(encoding="utf-8")
    targets = makefile_targets()
    named = {n for row in tables(text, "make target") for n in names(row[-1])}
    named |= {n for row in tables(text, "old target") + tables(text, "new target") for n in names(row[0] + row[1])}
    named |= set(re.findall(r"make -C analyses ([a-z0-9][a-z0-9-]*)", text))
    assert named, "no make target found in analyses/README.md"
    assert not named - set(targets), f"analyses/README.md names targets the Makefile lacks: {named - set(targets)}"
    unlisted = {t for t, comment in targets.items() if comment and not comment.startswith("old name")} - named
    assert not unlisted - {"help", "powered-experiment", "demo-identity", "portable-paths"}, \
        f"targets missing from analyses/README.md: {sorted(unlisted)}"


def test_every_target_comment_gives_a_time():
    untimed = [t for t, c in makefile_targets().items()
               if c and t != "help" and not c.startswith(("old name", "as before")) and not TIME.search(c)]
    assert not untimed, f"these targets' ## comments give no time (measured, or 'not run/timed'): {untimed}"


def test_the_index_has_no_relative_links():
    """The site build is strict: paths outside docs/ are named in backticks, never linked."""
    assert not re.search(r"\]\((?!https?://)", INDEX.read_text(encoding="utf-8"))


def test_docs_reproduce_includes_the_index():
    lines = (REPO / "docs" / "reproduce.md").read_text(encoding="utf-8").splitlines()
    assert [line for line in lines if line.strip()][1:] == ['--8<-- "analyses/README.md"']


@needs_make
def test_old_names_run_the_new_commands():
    rows = tables(INDEX.read_text(encoding="utf-8"), "old target")
    pairs = [(names(r[0]), names(r[1])) for r in rows if names(r[1])]
    assert len(pairs) >= 14
    for old, new in pairs:
        assert len(old) == 1, old
        ours = list(dict.fromkeys(line for target in new for line in dry_run(target)))
        assert dry_run(old[0]) == ours, (old, new)


@needs_make
def test_every_recipe_runs_a_module_from_the_repository_root():
    for target in makefile_targets():
        if target == "help":
            continue
        commands = "\n".join(dry_run(target))
        assert not re.search(r"analyses/\S+\.py", commands), (target, commands)  # python -m, never a file path
        assert commands.startswith("cd .. && "), (target, commands)


@needs_make
def test_out_goes_to_the_script_and_aggregates_refuse_it(tmp_path):
    assert dry_run("probes", f"OUT={tmp_path}")[-1].endswith(f"analyses.probes.run --out {tmp_path}")
    assert any(f"--out {tmp_path}/convergence" in line for line in dry_run("powered-experiment", f"OUT={tmp_path}"))
    result = subprocess.run(["make", "-n", "-C", str(REPO / "analyses"), "issue15", f"OUT={tmp_path}"],
                            capture_output=True, text=True, check=False)
    assert result.returncode != 0 and "one target" in result.stderr
