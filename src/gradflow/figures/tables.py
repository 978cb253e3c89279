r"""Tables of numbers as text: Markdown for ``summary.md`` and booktabs LaTeX for ``tables.tex``.

A table is a header and rows of cells already formatted (:mod:`gradflow.formatting`), so the
Markdown summary and the LaTeX file a paper pastes show the same rounding.

LaTeX comes in three layouts (:data:`LATEX_LAYOUTS`); a test compiles each with pdflatex in the page
it is meant for (one column of 3.125 in, a text width of 6.5 in) and finds no overfull box:

- ``page`` (the default): ``table``, one line a row, in ``\small``: a one-column paper (6.5 in);
- ``wide``: the same rows in ``table*``, which spans both columns of a two-column paper;
- ``column``: ``table`` in ``\footnotesize``, every ``estimate [low, high]`` cell split over two
  lines (the interval under its estimate) and long headers stacked: one column of a two-column
  paper (3.125 in) for a table of up to three estimate columns (a comparison of two runs).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradflow.formatting import MISSING


@dataclass(frozen=True)
class TextTable:
    """One table: ``header`` (column titles), ``rows`` (formatted cells), and for LaTeX a caption and label."""

    header: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    caption: str = ""
    label: str = ""
    name: str = ""
    """Short file name of the table's own ``.tex`` (``ratios`` -> ``latex/ratios.tex``)."""


LATEX_LAYOUTS: tuple[str, ...] = ("page", "wide", "column")
"""``page``: ``table``, a row a line (a one-column paper); ``wide``: the same in ``table*`` (across both columns of a
two-column paper); ``column``: ``table``, intervals under their estimates (one column of a two-column paper)."""
LATEX_FOLDER = "latex"
"""The folder of one ``.tex`` file per table, inside a report's or comparison's output directory."""
_ESTIMATE = re.compile(r"^(\S+) (\[[^\]]*\])$")
_HEADER_LINE = 8
"""Characters per line of a stacked header in the ``column`` layout."""


def _markdown_cell(value: Any) -> str:
    """A Markdown table cell: pipes escaped, newlines flattened."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(table: TextTable) -> list[str]:
    """Lines of a Markdown table."""
    lines = ["| " + " | ".join(_markdown_cell(h) for h in table.header) + " |", "|" + "---|" * len(table.header)]
    lines += ["| " + " | ".join(_markdown_cell(c) for c in row) + " |" for row in table.rows]
    return lines


_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                  "−": "$-$", "×": r"$\times$", "–": "--", "≥": r"$\geq$", "≤": r"$\leq$"}
_LATEX_PATTERN = re.compile("|".join(re.escape(k) for k in _LATEX_SPECIAL))
_NEGATIVE = re.compile(r"(?<![\w.$-])-(?=\d)")


def latex_escape(text: Any) -> str:
    """``text`` safe in LaTeX text mode (pdflatex, no extra package): specials escaped, −, ×, – and the sign of a
    negative number spelled out."""
    text = MISSING if text is None else " ".join(str(text).split())
    text = _LATEX_PATTERN.sub(lambda m: _LATEX_SPECIAL[m.group()], text)
    return _NEGATIVE.sub("$-$", text)  # a negative number's sign is a minus, not a hyphen (exponents left as is)


def _stacked_header(text: str) -> str:
    """A header cell broken into lines of about :data:`_HEADER_LINE` characters (``\\shortstack``, no package)."""
    lines: list[str] = []
    for word in str(text).split():
        if lines and len(lines[-1]) + 1 + len(word) <= _HEADER_LINE:
            lines[-1] += " " + word
        else:
            lines.append(word)
    escaped = [latex_escape(line) for line in lines]
    return escaped[0] if len(escaped) <= 1 else r"\shortstack[r]{" + r"\\{}".join(escaped) + "}"  # {}: a line may
    # start with "[", which \\ would read as its optional argument


def _column_rows(row: Sequence[Any]) -> list[str]:
    """A row in the ``column`` layout: one line, or two when a cell is ``estimate [low, high]`` (the interval on
    the second line, under its estimate)."""
    split = [_ESTIMATE.match(str(c)) for c in row]
    if not any(split):
        return [" & ".join(latex_escape(c) for c in row) + r" \\"]
    first = [latex_escape(m.group(1) if m else c) for c, m in zip(row, split)]
    second = [latex_escape(m.group(2)) if m else "" for m in split]
    return [" & ".join(first) + r" \\", " & ".join(second) + r" \\[2pt]"]


def latex_table(table: TextTable, layout: str = "page") -> str:
    """A booktabs table: caption above, label, first column left, the others right; ``layout`` one of
    :data:`LATEX_LAYOUTS` (``page``: ``table``, a row a line; ``wide``: ``table*``; ``column``: ``table``, intervals
    under estimates, headers stacked)."""
    if layout not in LATEX_LAYOUTS:
        raise ValueError(f"unknown LaTeX layout {layout!r}; choose one of {', '.join(LATEX_LAYOUTS)}")
    column = layout == "column"
    env = "table*" if layout == "wide" else "table"
    spec = "l" + "r" * (len(table.header) - 1)
    header = [_stacked_header(h) if column else latex_escape(h) for h in table.header]
    lines = [rf"\begin{{{env}}}[t]", r"\centering", r"\footnotesize" if column else r"\small",
             rf"\caption{{{latex_escape(table.caption)}}}", rf"\label{{{table.label}}}",
             r"\setlength{\tabcolsep}{2pt}" if column else "", rf"\begin{{tabular}}{{{spec}}}", r"\toprule",
             " & ".join(header) + r" \\", r"\midrule"]
    for row in table.rows:
        lines += _column_rows(row) if column else [" & ".join(latex_escape(c) for c in row) + r" \\"]
    lines += [r"\bottomrule", r"\end{tabular}", rf"\end{{{env}}}"]
    return "\n".join(line for line in lines if line)


def write_latex_tables(path: Path, tables: Sequence[TextTable], source: str, layout: str = "page") -> Path:
    r"""Write ``tables`` to ``path`` for ``\input`` in a paper (needs ``\usepackage{booktabs}``); returns the path."""
    where = "" if layout == "page" else f", {layout} layout"
    head = [f"% gradflow tables from {source}{where}; needs \\usepackage{{booktabs}}", ""]
    path.write_text("\n".join(head) + "\n\n".join(latex_table(t, layout) for t in tables) + "\n", encoding="utf-8")
    return path


def write_latex_files(folder: Path, tables: Sequence[TextTable], source: str, layout: str = "page") -> list[Path]:
    r"""Write each table to its own ``folder/<name>.tex`` (``TextTable.name``), for ``\input`` of one table; returns
    the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    names = [t.name or t.label.removeprefix("tab:gradflow-") for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"two tables would share a file name: {names}")
    return [write_latex_tables(folder / f"{name}.tex", [t], source, layout) for name, t in zip(names, tables)]


def depth_cell(fraction: float) -> str:
    """A relative depth (layer / blocks) as a table's first cell: three decimals (``0.500``)."""
    return f"{float(fraction):.3f}"


def layers_header(depths: Sequence[int]) -> str:
    """The header of the column naming each model's layer at a depth: ``layers (6/12)``."""
    return "layers (" + "/".join(str(n) for n in depths) + ")"


def latex_label(*parts: str) -> str:
    """``tab:gradflow-<parts>`` with only letters, digits and hyphens (safe in ``\\label`` and ``\\ref``)."""
    return "tab:gradflow-" + "-".join(re.sub(r"[^A-Za-z0-9]+", "-", p).strip("-").lower() for p in parts if p)


__all__ = ["LATEX_FOLDER", "LATEX_LAYOUTS", "TextTable", "depth_cell", "latex_escape", "latex_label", "latex_table",
           "layers_header", "markdown_table", "write_latex_files", "write_latex_tables"]
