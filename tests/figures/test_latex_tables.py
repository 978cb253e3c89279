"""tables.tex: booktabs tables a paper can \\input, with the numbers rounded as in summary.md (issue 26)."""

from __future__ import annotations

import re
import shutil
import subprocess

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from gradflow.figures import report  # noqa: E402
from gradflow.figures.report_tables import run_tag  # noqa: E402
from gradflow.figures.tables import TextTable, latex_escape, latex_label, latex_table  # noqa: E402
from synthetic_runs import make_meta, write_run  # noqa: E402

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
    assert re.search(r"\\label\{tab:gradflow-ratios-synthetic-bert-tiny-bert-[0-9a-f]{6}\}", ratios)
    assert "95\\% sequence-bootstrap CIs" in ratios
    rows = [line for line in ratios.splitlines() if line.endswith(r"\\") and line[0].isdigit()]
    assert len(rows) == 4  # layers 0-3
    summary = (tmp_path / "out" / "summary.md").read_text()
    for row in rows:  # every estimate of the LaTeX table is the summary's, to the digit
        layer, site, context = (cell.strip() for cell in row.rstrip("\\ ").split("&")[:3])
        assert f"| {layer} | {site.replace(chr(92), '')} | {context} |" in summary
    assert re.search(r"\\label\{tab:gradflow-last-block-synthetic-bert-tiny-bert-[0-9a-f]{6}\}", last)


def test_compare_writes_tables_tex(tmp_path):
    a = write_run(tmp_path / "a", num_layers=2, n_sequences=30)
    b = write_run(tmp_path / "b", num_layers=2, n_sequences=30, seed=3)
    report.write_comparison([a, b], ["mini-en (MLM)", "twin"], tmp_path / "out", formats=("png",), **FAST)
    ratios, last = _tables(tmp_path / "out" / "tables.tex")
    assert r"twin $-$ mini-en (MLM)" in ratios
    assert re.search(r"\\label\{tab:gradflow-ratios-mini-en-mlm-twin-[0-9a-f]{6}\}", ratios)
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


def _labels(out) -> list[str]:
    """Every \\label of a report: tables.tex and latex/*.tex."""
    files = [out / "tables.tex", *sorted((out / "latex").glob("*.tex"))]
    return [label for f in files for label in re.findall(r"\\label\{([^}]*)\}", f.read_text())]


@pytest.fixture(scope="module")
def two_objectives(tmp_path_factory):
    """One model recorded under BERT masking (mlm) and under masked diffusion (t drawn per sequence), each reported."""
    root = tmp_path_factory.mktemp("objectives")
    bert = write_run(root / "bert", num_layers=2, n_sequences=30)
    diffusion = write_run(root / "diffusion", num_layers=2, n_sequences=30, seq_len=16,
                          mask_ratios=[0.15 + 0.7 * k / 29 for k in range(30)])
    for run in (bert, diffusion):
        report.write_report(run, root / f"{run.name}-report", formats=("png",), **FAST)
    return root


@pytest.mark.slow
def test_two_objectives_of_one_model_write_disjoint_labels(two_objectives, tmp_path):
    """Issue 59 point 4: two reports of one model under two objectives wrote the same \\label (a paper citing both
    got 'multiply defined'); a label now carries the objective and a hash of the run's meta.json."""
    bert, diffusion = (_labels(two_objectives / f"{name}-report") for name in ("bert", "diffusion"))
    assert not set(bert) & set(diffusion)
    assert len(set(bert)) == 2 and len(set(diffusion)) == 3  # ratios, last block (+ mask ratio)
    assert all(re.fullmatch(r"tab:gradflow-[a-z-]+-synthetic-bert-tiny-bert-[0-9a-f]{6}", x) for x in bert)
    assert all(re.fullmatch(r"tab:gradflow-[a-z-]+-synthetic-bert-tiny-diffusion-[0-9a-f]{6}", x) for x in diffusion)
    report.write_report(two_objectives / "bert", tmp_path / "again", formats=("png",), **FAST)
    assert _labels(tmp_path / "again") == bert  # stable: the same run, the same labels


def test_run_tag_follows_the_recorded_settings_not_the_recording():
    meta = make_meta(2)
    tag = run_tag(meta)
    assert re.fullmatch(r"bert-[0-9a-f]{6}", tag)
    again = {**meta, "versions": {"gradflow": "9"}, "wall_s": 3.0, "command": "elsewhere", "counts": {"batches": 2},
             "complete": False, "mean_loss": 1.0}
    assert run_tag(again) == tag  # another recording of the same configuration
    assert run_tag({**meta, "seed": 1}) != tag and run_tag({**meta, "loss": "all-positions"}).startswith(
        "bert-all-positions-")
    grid = {**meta, "masking": {"policy": "diffusion", "t": "grid", "ratios": [0.5]}}
    drawn = {**meta, "masking": {"policy": "diffusion", "t": "uniform", "ratios": []}}
    assert run_tag(grid).startswith("diffusion-") and run_tag(grid) != run_tag(drawn)


@pytest.mark.slow
def test_the_ratios_table_has_no_masked_column_when_every_loss_position_is_masked(two_objectives):
    """Issue 59 point 4: under diffusion the masked / loss column read 1.000 [1.000, 1.000] in every row."""
    for name, masked in (("bert", True), ("diffusion", False)):
        out = two_objectives / f"{name}-report"
        ratios = (out / "latex" / "ratios.tex").read_text()
        summary = (out / "summary.md").read_text().split("## Context vs loss positions, per layer")[1]
        header = next(line for line in summary.splitlines() if line.startswith("| layer |"))
        assert ("masked / loss [95\\% CI]" in ratios) is masked and ("masked / loss [95% CI]" in header) is masked
        why = "All loss positions are masked (no random or kept token)"
        assert (why in ratios) is not masked and (why in summary.split("| layer |")[0]) is not masked
        assert "context / loss [95% CI]" in header and "rank-biserial" in header
