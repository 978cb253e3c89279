"""Tables of numbers as text: Markdown for ``summary.md`` and booktabs LaTeX for ``tables.tex``.

A table is a header and rows of cells already formatted (:mod:`gradflow.formatting`), so the
Markdown summary and the LaTeX file a paper pastes show the same rounding.
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


def latex_table(table: TextTable) -> str:
    """A booktabs ``table`` environment: caption above, label, first column left, the others right."""
    spec = "l" + "r" * (len(table.header) - 1)
    lines = [r"\begin{table}[t]", r"\centering", r"\small", rf"\caption{{{latex_escape(table.caption)}}}",
             rf"\label{{{table.label}}}", rf"\begin{{tabular}}{{{spec}}}", r"\toprule",
             " & ".join(latex_escape(h) for h in table.header) + r" \\", r"\midrule"]
    lines += [" & ".join(latex_escape(c) for c in row) + r" \\" for row in table.rows]
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines)


def write_latex_tables(path: Path, tables: Sequence[TextTable], source: str) -> Path:
    r"""Write ``tables`` to ``path`` for ``\input`` in a paper (needs ``\usepackage{booktabs}``); returns the path."""
    head = [f"% gradflow tables from {source}; needs \\usepackage{{booktabs}}", ""]
    path.write_text("\n".join(head) + "\n\n".join(latex_table(t) for t in tables) + "\n", encoding="utf-8")
    return path


def latex_label(*parts: str) -> str:
    """``tab:gradflow-<parts>`` with only letters, digits and hyphens (safe in ``\\label`` and ``\\ref``)."""
    return "tab:gradflow-" + "-".join(re.sub(r"[^A-Za-z0-9]+", "-", p).strip("-").lower() for p in parts if p)


__all__ = ["TextTable", "latex_escape", "latex_label", "latex_table", "markdown_table", "write_latex_tables"]
