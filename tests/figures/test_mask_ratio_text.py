"""gradflow.figures.mask_ratio_text: the by-t table in words and in LaTeX (issue 59, points 3 and 4).

The LaTeX table carries every ratio with its interval in every layout, its bins split into panels that fit the
layout's width (a test compiles them with pdflatex in the page each layout is meant for); the summary section and
the caption say how t was binned (from meta.json) and which sequences were left out, and why.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pandas as pd
import pytest

from gradflow.analysis import load_run
from gradflow.analysis.mask_ratio import mask_ratio_selection
from gradflow.figures.mask_ratio import mask_ratio_tables
from gradflow.figures.mask_ratio_text import mask_ratio_latex, mask_ratio_section
from gradflow.figures.report_tables import mask_ratio_table
from gradflow.figures.tables import LATEX_LAYOUTS, LAYOUT_WIDTHS, fit_columns, latex_table, markdown_table
from synthetic_runs import write_run

EQUAL5 = [(k / 5, (k + 1) / 5) for k in range(5)]
GRID12 = [(round(0.08 * (k + 1), 2),) * 2 for k in range(12)]
GRID2 = [(0.25, 0.25), (0.75, 0.75)]
SHAPES = {"5 equal-width bins": EQUAL5, "a grid of 12": GRID12, "a grid of 2": GRID2}


def _table(bins, layers: int = 12, scale: float = 1.0) -> pd.DataFrame:
    """A ratio_by_mask_ratio-like table: ratios rising with t and depth, the last layer exactly 0."""
    rows = []
    for layer in range(layers + 1):
        for k, (low, high) in enumerate(bins):
            ratio = 0.0 if layer == layers else scale * (1 + k) * (1 + 0.37 * layer)
            rows.append({"layer": layer, "site": f"s{layer}", "t_low": low, "t_high": high, "t_mid": (low + high) / 2,
                         "n_sequences": 9, "ratio": ratio, "ci_low": 0.93 * ratio, "ci_high": 1.11 * ratio,
                         "context_mean": ratio, "loss_mean": 1.0, "n_context": 10, "n_loss": 5,
                         "exact_zero": ratio == 0})
    return pd.DataFrame(rows)


def _unescape(cell: str) -> str:
    return cell.strip().replace("$-$", "-").replace("--", "–")


def _latex_cells(tex: str, layout: str) -> dict[tuple[str, str], str]:
    """(layer, bin header) -> the cell's text, read back from the LaTeX of every panel (an estimate and its interval
    rejoined in the ``column`` layout)."""
    body = tex.split(r"\toprule")[1].split(r"\bottomrule")[0].strip().splitlines()
    cells, header, k = {}, [], 0
    while k < len(body):
        line = body[k]
        if line == r"\midrule":
            k += 1
            continue
        row = [c.strip() for c in line.removesuffix(r"\\[2pt]").removesuffix(r"\\").split("&")]
        if (k == 0 or body[k - 1] == r"\midrule") and k + 1 < len(body) and body[k + 1] == r"\midrule":
            header = [_unescape(re.sub(r"\\shortstack\[r\]\{(.*)\}", r"\1", h).replace(r"\\{}", " ")) for h in row]
            k += 1
            continue
        if layout == "column":
            second = [c.strip() for c in body[k + 1].removesuffix(r"\\[2pt]").split("&")]
            row = [f"{a} {b}".strip() for a, b in zip(row, second)]
            k += 1
        for name, cell in zip(header[1:], row[1:]):
            if name:
                cells[(row[0], name)] = _unescape(cell)
        k += 1
    return cells


@pytest.mark.parametrize("layout", LATEX_LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_ratio_of_the_tex_has_its_interval(layout, shape):
    """Issue 59 point 4: with more than 3-4 bins the .tex carried the estimates alone; now every cell of the summary's
    table, estimate and interval, is in the .tex, once, however many bins (split into panels where needed)."""
    table = _table(SHAPES[shape])
    text = mask_ratio_latex({"mask_ratio_profile": table}, "m", layout, 2000, 0)[0]
    tex = latex_table(text, layout)
    full = mask_ratio_table(table)
    bare = layout == "column"  # the column layout's headers are the bins alone
    expected = {(str(row[0]), h.removeprefix("t = ").removeprefix("t ") if bare else h): cell
                for row in full.rows for h, cell in zip(full.header[1:], row[1:])}
    assert _latex_cells(tex, layout) == expected
    assert all(re.fullmatch(r"(0|\d+\.\d+) \[(0|\d+\.\d+), (0|\d+\.\d+)\]", cell) for cell in expected.values())
    assert "CIs" in text.caption and "CSV" not in text.caption


@pytest.mark.parametrize("layout", LATEX_LAYOUTS)
def test_panels_are_balanced_and_repeat_the_layer_column(layout):
    table = fit_columns(mask_ratio_table(_table(GRID12)), layout)
    blocks = [(table.header, table.rows), *table.panels]
    sizes = [len(header) - 1 for header, _ in blocks]
    assert sum(sizes) == 12 and max(sizes) - min(sizes) <= max(sizes) - 1 and sizes == sorted(sizes, reverse=True)
    assert all(header[0] == "layer" and [r[0] for r in rows] == list(range(13)) for header, rows in blocks)
    tex = latex_table(table, layout)
    width = max(sizes) + 1
    assert rf"\begin{{tabular}}{{l{'r' * (width - 1)}}}" in tex
    rows = [line for line in tex.split(r"\toprule")[1].split(r"\bottomrule")[0].splitlines() if line.endswith(
        (r"\\", r"\\[2pt]"))]
    assert rows and all(line.count("&") == width - 1 for line in rows)
    assert tex.count(r"\begin{") == tex.count(r"\end{") and tex.count("{") == tex.count("}")
    narrow = fit_columns(mask_ratio_table(_table(GRID2)), layout)
    assert narrow.panels == () and len(narrow.header) == 3  # two bins fit as they are


PAGES = {"page": r"\documentclass{article}\textwidth=6.5in",
         "wide": r"\documentclass[twocolumn]{article}\textwidth=7in\columnsep=0.25in",
         "column": r"\documentclass[twocolumn]{article}\textwidth=16cm\columnsep=0.6cm"}
"""The page each layout is meant for: a one-column paper's 6.5 in text; across both columns of a two-column page
(7 in); one column of ACL's two-column page (7.7 cm)."""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="pdflatex is not installed: the structure tests ran")
@pytest.mark.parametrize("layout", LATEX_LAYOUTS)
def test_every_shape_compiles_without_an_overfull_box(layout, tmp_path):
    tables = [mask_ratio_latex({"mask_ratio_profile": _table(bins, scale=scale)}, f"m{k}", layout, 2000, 0)[0]
              for k, (bins, scale) in enumerate([(b, s) for b in SHAPES.values() for s in (1.0, 0.0013, 13.0)])]
    body = r"\clearpage".join(latex_table(t, layout) for t in tables)
    (tmp_path / "paper.tex").write_text(f"{PAGES[layout]}\\usepackage{{booktabs}}\\begin{{document}}\\typeout"
                                        f"{{{{COLUMN \\the\\columnwidth}}}}{body}\\end{{document}}\n")
    proc = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "paper.tex"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:]
    log = (tmp_path / "paper.log").read_text(errors="replace")
    assert not re.search(r"Overfull \\hbox", log)
    if layout == "column":
        assert float(re.search(r"COLUMN ([\d.]+)pt", log).group(1)) == pytest.approx(LAYOUT_WIDTHS["column"], abs=1)


@pytest.fixture(scope="module")
def left_out_run(tmp_path_factory):
    """A drawn-t run of 11 sequences: t = 0.001 draws no masked token, t = 1 masks every token."""
    ratios = (0.001, 0.12, 0.18, 0.3, 0.35, 0.5, 0.55, 0.7, 0.75, 0.85, 1.0)
    return load_run(write_run(tmp_path_factory.mktemp("by-t") / "run", num_layers=2, n_sequences=len(ratios),
                              seq_len=16, mask_ratios=ratios))


def test_the_section_says_how_t_was_binned_and_which_sequences_were_left_out(left_out_run):
    """Issue 59 point 3: a sequence without a masked token vanished silently, and a drawn-t run of few sequences was
    called a grid."""
    tables = mask_ratio_tables(left_out_run, n_resamples=40)
    selection = mask_ratio_selection(left_out_run)
    text = "\n".join(mask_ratio_section(tables, 40, 0, selection))
    assert "t drawn per sequence, in 5 equal-width bins of [0, 1]; sequences per bin: 2, 2, 2, 2, 2)" in text
    assert "grid" not in text
    assert ("1 of 11 sequences left out: 1 with no loss position (no token masked: a small t on a short sequence or "
            "response; its gradient is all zeros).") in text
    caption = mask_ratio_latex(tables, "m", "page", 40, 0, selection)[0].caption
    assert "t drawn per sequence, in 5 equal-width bins of [0, 1]" in caption
    assert caption.endswith("1 of 11 sequences left out: 1 with no loss position).")


def test_a_grid_run_and_a_run_with_none_left_out(tmp_path):
    run = load_run(write_run(tmp_path / "grid", num_layers=2, n_sequences=8, seq_len=16,
                             mask_ratios=[0.25, 0.5, 0.75, 0.5] * 2, t_drawn=False))
    tables = mask_ratio_tables(run, n_resamples=40)
    selection = mask_ratio_selection(run)
    text = "\n".join(mask_ratio_section(tables, 40, 0, selection))
    assert "(t from the run's grid, each value a bin; sequences per bin: 2, 4, 2)" in text
    assert "No sequence left out: each of the 8 has loss and context positions." in text
    caption = mask_ratio_latex(tables, "m", "column", 40, 0, selection)[0].caption
    assert "left out" not in caption and "t from the run's grid" in caption
    legacy = "\n".join(mask_ratio_section(tables, 40, 0))  # no selection: the table's bins, as before
    assert "each masking ratio of the run's grid is a bin" in legacy and "left out" not in legacy


def test_an_empty_bin_has_no_column_and_the_section_says_so(tmp_path):
    run = load_run(write_run(tmp_path / "gap", num_layers=2, n_sequences=6, seq_len=16,
                             mask_ratios=[0.3, 0.35, 0.5, 0.55, 0.7, 0.75]))
    tables = mask_ratio_tables(run, n_resamples=40)
    text = "\n".join(mask_ratio_section(tables, 40, 0, mask_ratio_selection(run)))
    assert "sequences per bin: 0, 2, 2, 2, 0 (a bin without sequences has no column)" in text
    header = markdown_table(mask_ratio_table(tables["mask_ratio_profile"]))[0]
    assert header == "| layer | t 0.2–0.4 | t 0.4–0.6 | t 0.6–0.8 |"
