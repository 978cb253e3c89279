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

A table with more columns than its layout's width holds is split by :func:`fit_columns` into panels
(:attr:`TextTable.panels`): one ``tabular``, each panel under its own header, the first columns repeated.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gradflow.formatting import MISSING

Row = tuple[Any, ...]


@dataclass(frozen=True)
class TextTable:
    """One table: ``header`` (column titles), ``rows`` (formatted cells), and for LaTeX a caption and label."""

    header: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    caption: str = ""
    label: str = ""
    name: str = ""
    """Short file name of the table's own ``.tex`` (``ratios`` -> ``latex/ratios.tex``)."""
    panels: tuple[tuple[tuple[str, ...], tuple[Row, ...]], ...] = ()
    """Further (header, rows) blocks set under the first in LaTeX, in one ``tabular`` (each under its own header;
    a shorter one padded with empty cells); Markdown: a table each."""


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
    for header, rows in table.panels:
        lines += ["", *markdown_table(TextTable(header, rows))]
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


def _header_lines(text: str) -> list[str]:
    """A header's words in lines of about :data:`_HEADER_LINE` characters."""
    lines: list[str] = []
    for word in str(text).split():
        if lines and len(lines[-1]) + 1 + len(word) <= _HEADER_LINE:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def _stacked_header(text: str) -> str:
    """A header cell broken into lines of about :data:`_HEADER_LINE` characters (``\\shortstack``, no package)."""
    escaped = [latex_escape(line) for line in _header_lines(text)]
    if len(escaped) <= 1:
        return escaped[0] if escaped else ""
    # {}: a line may start with "[", which \\ would read as its optional argument
    return r"\shortstack[r]{" + r"\\{}".join(escaped) + "}"


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
    blocks = [(table.header, table.rows), *table.panels]
    width = max(len(header) for header, _ in blocks)
    spec = "l" + "r" * (width - 1)
    lines = [rf"\begin{{{env}}}[t]", r"\centering", r"\footnotesize" if column else r"\small",
             rf"\caption{{{latex_escape(table.caption)}}}", rf"\label{{{table.label}}}",
             r"\setlength{\tabcolsep}{2pt}" if column else "", rf"\begin{{tabular}}{{{spec}}}", r"\toprule"]
    for k, (header, rows) in enumerate(blocks):
        pad = ("",) * (width - len(header))
        cells = [_stacked_header(h) if column else latex_escape(h) for h in (*header, *pad)]
        lines += ([r"\midrule"] if k else []) + [" & ".join(cells) + r" \\", r"\midrule"]
        for row in rows:
            row = (*row, *pad)
            lines += _column_rows(row) if column else [" & ".join(latex_escape(c) for c in row) + r" \\"]
    lines += [r"\bottomrule", r"\end{tabular}", rf"\end{{{env}}}"]
    return "\n".join(line for line in lines if line)


LAYOUT_WIDTHS: dict[str, float] = {"page": 469.0, "wide": 469.0, "column": 219.0}
"""Width in pt a table of each layout must fit: a 6.5 in text (``page``; ``wide`` too, which also fits a one-column
page), ACL's 7.7 cm column (``column``: the narrowest common column; IEEE's is 3.5 in, 253 pt)."""
_FONT_PT = {"page": 9.0, "wide": 9.0, "column": 8.0}
"""The font size of each layout (``\\small``, ``\\footnotesize`` of a 10 pt article)."""
_PAD_PT = {"page": 12.0, "wide": 12.0, "column": 4.0}
"""Space around a cell: twice ``\\tabcolsep`` (6 pt; the ``column`` layout sets 2 pt)."""
_EM = {**dict.fromkeys("0123456789", 0.53), **dict.fromkeys(".,;:[]()'", 0.28), " ": 0.34, "−": 0.78, "-": 0.78,
       "=": 0.78, "×": 0.78, "%": 0.83, "–": 0.53}
"""Widths in em of Computer Modern's glyphs, a little over (digits 0.5 em at 10 pt, 0.53 at 8 pt); others 0.53."""


def _text_pt(text: str, layout: str) -> float:
    return _FONT_PT[layout] * sum(_EM.get(ch, 0.53) for ch in text)


def cell_width(cell: Any, layout: str, header: bool = False) -> float:
    """An estimate of a cell's width in pt in ``layout``, its padding included, a little over pdflatex's: one line,
    or (``column``) the wider of an estimate and its interval, and a header's longest stacked line."""
    text = MISSING if cell is None else " ".join(str(cell).split())
    parts = [text]
    if layout == "column":
        match = _ESTIMATE.match(text)
        parts = (_header_lines(text) or [""]) if header else [match.group(1), match.group(2)] if match else [text]
    return max(_text_pt(part, layout) for part in parts) + _PAD_PT[layout]


def fit_columns(table: TextTable, layout: str, keep: int = 1) -> TextTable:
    """``table`` split into panels (:attr:`TextTable.panels`) that each fit :data:`LAYOUT_WIDTHS` in ``layout``:
    the first ``keep`` columns repeated in every panel, the others in order, as few panels as fit, of equal size
    but the last (never under one column a panel); unchanged when it fits as it is."""
    widths = [max([cell_width(h, layout, header=True)] + [cell_width(row[j], layout) for row in table.rows])
              for j, h in enumerate(table.header)]
    fixed, rest = sum(widths[:keep]), len(widths) - keep
    per = max(rest, 1)
    for count in range(1, rest + 1):
        per = -(-rest // count)
        if per == 1 or all(fixed + sum(widths[a:a + per]) <= LAYOUT_WIDTHS[layout]
                           for a in range(keep, len(widths), per)):
            break
    starts = range(keep, max(len(widths), keep + 1), per)
    blocks = [(tuple(table.header[:keep]) + tuple(table.header[a:a + per]),
               tuple(tuple(row[:keep]) + tuple(row[a:a + per]) for row in table.rows)) for a in starts]
    return replace(table, header=blocks[0][0], rows=blocks[0][1], panels=tuple(blocks[1:]))


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


__all__ = ["LATEX_FOLDER", "LATEX_LAYOUTS", "LAYOUT_WIDTHS", "TextTable", "cell_width", "depth_cell", "fit_columns",
           "latex_escape", "latex_label", "latex_table", "layers_header", "markdown_table", "write_latex_files",
           "write_latex_tables"]
