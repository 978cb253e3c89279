"""tables.tex: booktabs tables a paper can \\input, with the numbers rounded as in summary.md (issue 26)."""

from __future__ import annotations

import re
import shutil
import subprocess

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from gradflow.figures import report  # noqa: E402
from gradflow.figures.tables import TextTable, latex_escape, latex_label, latex_table  # noqa: E402
from synthetic_runs import write_run  # noqa: E402

FAST = dict(n_resamples=60)


def test_latex_escape_spells_out_what_pdflatex_cannot_read():
    assert latex_escape("a_b & 50% #1 $x$ {y} ~ ^") == r"a\_b \& 50\% \#1 \$x\$ \{y\} \textasciitilde{} \textasciicircum{}"
    assert latex_escape("run − base (2×) –") == r"run $-$ base (2$\times$) --"
    assert latex_escape("-0.13 [-0.135, 1.2e-04]") == r"$-$0.13 [$-$0.135, 1.2e-04]"
    assert latex_escape("blocks.2.out a-1") == "blocks.2.out a-1"
    assert latex_escape(None) == "–".replace("–", "--") and latex_label("ratios", "mini-en (MLM)") == \
        "tab:gradflow-ratios-mini-en-mlm"


def test_a_table_has_booktabs_rules_caption_label_and_one_line_per_row():
    text = latex_table(TextTable(("layer", "ratio"), ((0, "0.5 [0.4, 0.6]"), (1, "0 [0, 0]")), "A caption.", "tab:x"))
    lines = text.splitlines()
    assert lines[0] == r"\begin{table}[t]" and lines[-1] == r"\end{table}"
    assert r"\caption{A caption.}" in lines and r"\label{tab:x}" in lines and r"\begin{tabular}{lr}" in lines
    body = lines[lines.index(r"\midrule") + 1: lines.index(r"\bottomrule")]
    assert body == [r"0 & 0.5 [0.4, 0.6] \\", r"1 & 0 [0, 0] \\"] and lines.count(r"\toprule") == 1


def _tables(path) -> list[str]:
    return re.findall(r"\\begin\{table\}.*?\\end\{table\}", path.read_text(), flags=re.S)


@pytest.mark.slow
def test_report_writes_tables_tex_with_the_summary_numbers(tmp_path):
    run = write_run(tmp_path / "run", num_layers=3, n_sequences=40)
    paths = report.write_report(run, tmp_path / "out", formats=("png",), **FAST)
    tex = tmp_path / "out" / "tables.tex"
    assert tex in paths
    ratios, last = _tables(tex)
    assert r"\label{tab:gradflow-ratios-synthetic-bert-tiny}" in ratios and "95\\% sequence-bootstrap CIs" in ratios
    rows = [line for line in ratios.splitlines() if line.endswith(r"\\") and line[0].isdigit()]
    assert len(rows) == 4  # layers 0-3
    summary = (tmp_path / "out" / "summary.md").read_text()
    for row in rows:  # every estimate of the LaTeX table is the summary's, to the digit
        layer, site, context = (cell.strip() for cell in row.rstrip("\\ ").split("&")[:3])
        assert f"| {layer} | {site.replace(chr(92), '')} | {context} |" in summary
    assert r"\label{tab:gradflow-last-block-synthetic-bert-tiny}" in last


def test_compare_writes_tables_tex(tmp_path):
    a = write_run(tmp_path / "a", num_layers=2, n_sequences=30)
    b = write_run(tmp_path / "b", num_layers=2, n_sequences=30, seed=3)
    report.write_comparison([a, b], ["mini-en (MLM)", "twin"], tmp_path / "out", formats=("png",), **FAST)
    ratios, last = _tables(tmp_path / "out" / "tables.tex")
    assert r"twin $-$ mini-en (MLM)" in ratios and r"\label{tab:gradflow-ratios-mini-en-mlm-twin}" in ratios
    assert r"$\times$" in last


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="no pdflatex here: the structure tests above still ran")
def test_tables_tex_compiles(tmp_path):
    runs = [write_run(tmp_path / name, num_layers=2, n_sequences=30, seed=k) for k, name in enumerate("ab")]
    report.write_report(runs[0], tmp_path / "out", formats=("png",), **FAST)
    report.write_comparison(runs, ["mini-en (MLM)", "twin_1"], tmp_path / "out" / "compare", formats=("png",), **FAST)
    (tmp_path / "out" / "paper.tex").write_text("\\documentclass{article}\\usepackage{booktabs}\\begin{document}"
                                                "\\input{tables.tex}\\input{compare/tables.tex}\\end{document}\n")
    proc = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "paper.tex"],
                          cwd=tmp_path / "out", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:]
