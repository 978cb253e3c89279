"""The results pages name files a reader can open (issue 59, point 6): every file path quoted in backticks on
``docs/results/*.md`` (``figures/...csv``, ``tests/...py``, brace groups such as ``overview.{csv,md}`` expanded,
``FILE:START:END`` read as FILE) is a file from the repository root, and every link or image into the published
``figures/`` (docs/hooks.py) names a committed figure.

A folder (a path ending in ``/``) is not checked: the pages name folders relative to a target's output folder
(``convergence/`` under the last-block experiment's) or made at run time (``build/``, ``data/tasks/``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs" / "results").glob("*.md"))
QUOTED_FILE = re.compile(r"`([^`\s]*/[^`\s/]*\.[A-Za-z0-9{},.]+)`")  # a/b.ext in backticks, no spaces
LINK = re.compile(r"\]\(([^)\s#]+)\)")


def expand(path: str) -> list[str]:
    """Every path of a brace group, as the shell expands it: ``a.{csv,md}`` -> ``a.csv``, ``a.md`` (nested too)."""
    start = path.find("{")
    if start < 0:
        return [path]
    depth, cuts = 0, [start]
    for i in range(start, len(path)):
        depth += {"{": 1, "}": -1}.get(path[i], 0)
        if depth == 1 and path[i] == ",":
            cuts.append(i)
        if depth == 0:
            break
    cuts.append(i)
    head, tail = path[:start], path[i + 1:]
    return [p for a, b in zip(cuts, cuts[1:]) for p in expand(head + path[a + 1:b] + tail)]


def quoted_files(text: str) -> list[str]:
    """The file paths quoted in backticks in ``text`` (commands and URLs are not paths)."""
    return [p for p in QUOTED_FILE.findall(text) if not p.startswith(("http", "-", "--"))]


def missing(page: Path) -> list[str]:
    """What ``page`` names that is not a file: quoted paths from the root, links into the published figures."""
    text, out = page.read_text(encoding="utf-8"), []
    for quoted in quoted_files(text):
        out += [f"`{quoted}`: {p}" for p in expand(quoted) if not (ROOT / p.split(":")[0]).is_file()]
    for target in LINK.findall(text):
        parts = Path(target).parts
        if parts[:2] == ("..", "figures") and not (ROOT / Path(*parts[1:])).is_file():
            out.append(f"link {target}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_file_a_results_page_names_is_committed(page):
    assert not missing(page), missing(page)


def test_the_checker_catches_a_bare_path_and_a_broken_figure_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("ratio by t (`reports/diffusion_grid/ratio_by_mask_ratio.png`); the table "
                    "`figures/objectives/overview.{csv,mdx}`; `make -C analyses objectives-overview`; `build/`;\n"
                    "![a figure](../figures/objectives/no_such.png) and [the curves](../figures/objectives/pretraining_curves.png)\n")
    assert missing(page) == ["`reports/diffusion_grid/ratio_by_mask_ratio.png`: reports/diffusion_grid/ratio_by_mask_ratio.png",
                             "`figures/objectives/overview.{csv,mdx}`: figures/objectives/overview.mdx",
                             "link ../figures/objectives/no_such.png"]
    assert expand("a/{b,c.{x,y}}") == ["a/b", "a/c.x", "a/c.y"]
