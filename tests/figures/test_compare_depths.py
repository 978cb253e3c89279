"""Comparing runs of different depth (issue 49): layers matched at the same relative depth, never by raw index; the
tables with fixed decimals, one .tex per table and three LaTeX layouts that fit the page they are meant for."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from gradflow.analysis import load_run  # noqa: E402
from gradflow.analysis.compare import compare_runs, matched_layers  # noqa: E402
from gradflow.cli.main import main  # noqa: E402
from gradflow.errors import RunError, UsageError  # noqa: E402
from gradflow.figures import report  # noqa: E402
from gradflow.figures.comparison import comparison_ratios  # noqa: E402
from gradflow.figures.tables import LATEX_LAYOUTS  # noqa: E402
from gradflow.formatting import column_decimals, fixed_column, format_fixed  # noqa: E402
from synthetic_runs import write_run  # noqa: E402

FAST = dict(n_resamples=60)


@pytest.mark.parametrize("depth, baseline, pairs", [
    (12, 6, [(2 * k, k) for k in range(7)]),
    (6, 12, [(k, 2 * k) for k in range(7)]),
    (5, 7, [(0, 0), (5, 7)]),
    (4, 6, [(0, 0), (2, 3), (4, 6)]),
    (3, 3, [(k, k) for k in range(4)]),
], ids=["12 against 6 pairs 2k with k", "6 against 12 pairs k with 2k", "5 and 7 share only the ends",
        "4 and 6 share thirds", "equal depths pair every layer with itself"])
def test_matched_layers_pair_the_same_relative_depth(depth, baseline, pairs):
    assert matched_layers(depth, baseline) == pairs
    assert all(a * baseline == b * depth for a, b in pairs)


def test_matched_layers_refuse_a_depth_below_one():
    with pytest.raises(RunError, match="at least one block"):
        matched_layers(0, 6)


@pytest.fixture(scope="module")
def six_and_twelve(tmp_path_factory):
    root = tmp_path_factory.mktemp("depths")
    return [write_run(root / "six", num_layers=6, n_sequences=30), write_run(root / "twelve", num_layers=12,
                                                                             n_sequences=30, seed=3)]


def test_differences_name_both_layers_and_the_relative_depth(six_and_twelve):
    comp = compare_runs([load_run(p) for p in six_and_twelve], ["six", "twelve"], n_resamples=60)
    diffs = comp.ratio_differences
    assert list(diffs.columns[:5]) == ["label", "baseline", "layer", "baseline_layer", "relative_depth"]
    assert set(diffs["label"]) == {"twelve"} and set(diffs["baseline"]) == {"six"}
    assert sorted(set(diffs["layer"])) == [0, 2, 4, 6, 8, 10, 12]  # the 12-block run's odd layers have no partner
    assert (diffs["layer"] == 2 * diffs["baseline_layer"]).all()
    assert np.allclose(diffs["relative_depth"], diffs["layer"] / 12)
    ratios = comp.ratios.set_index(["label", "layer", "role"])["ratio"]
    for row in diffs.itertuples():  # each difference is the two ratios at the same relative depth
        assert row.difference == pytest.approx(ratios["twelve", row.layer, row.role]
                                               - ratios["six", row.baseline_layer, row.role], abs=1e-12)


def test_after_both_last_blocks_the_difference_is_exactly_zero(six_and_twelve):
    comp = compare_runs([load_run(p) for p in six_and_twelve], ["six", "twelve"], n_resamples=60)
    last = comp.ratio_differences.query("role == 'context' and relative_depth == 1.0")
    assert len(last) == 1 and (last["layer"].iloc[0], last["baseline_layer"].iloc[0]) == (12, 6)
    assert last[["difference", "ci_low", "ci_high"]].to_numpy().tolist() == [[0.0, 0.0, 0.0]]
    middle = comp.ratio_differences.query("role == 'context' and layer == 6")  # the raw-index trap: 6 vs 3
    assert middle["baseline_layer"].tolist() == [3] and middle["difference"].iloc[0] != 0


def test_shares_are_matched_by_relative_depth(six_and_twelve):
    comp = compare_runs([load_run(p) for p in six_and_twelve], ["six", "twelve"], n_resamples=60)
    twelve = comp.shares[comp.shares["label"] == "twelve"]
    even = twelve[twelve["layer"] % 2 == 0]
    assert (even["baseline_layer"] == even["layer"] // 2).all() and even["share_difference"].notna().all()
    assert twelve.loc[twelve["layer"] % 2 == 1, "share_difference"].isna().all()
    six = comp.shares.set_index(["label", "layer", "sublayer", "param"])["share"]
    for row in even.itertuples():
        assert row.share_difference == pytest.approx(row.share - six["six", row.baseline_layer, row.sublayer,
                                                                       row.param], abs=1e-12)


def test_the_difference_panel_spans_relative_depth_zero_to_one(six_and_twelve):
    comp = compare_runs([load_run(p) for p in six_and_twelve], ["six", "twelve"], n_resamples=60)
    artists = comparison_ratios(comp, width="single")
    line = next(a for a in artists if a.get_gid() == "difference:twelve")
    assert line.get_xdata().min() == 0.0 and line.get_xdata().max() == 1.0 and len(line.get_xdata()) == 7
    assert line.get_ydata()[-1] == 0.0
    assert line.figure.get_figheight() <= 3.2  # column width: two stacked panels, not 3.95 in
    matplotlib.pyplot.close(line.figure)


@pytest.fixture(scope="module")
def depth_comparison(six_and_twelve, tmp_path_factory):
    out = tmp_path_factory.mktemp("cmp") / "out"
    report.write_comparison(six_and_twelve, ["six", "twelve"], out, formats=("png",), **FAST)
    return out


def test_the_summary_and_csv_rows_are_by_relative_depth(depth_comparison):
    text = (depth_comparison / "summary.md").read_text()
    assert "by relative depth" in text and "The runs differ in depth (6/12 blocks)" in text
    assert "| depth | layers (6/12) | six | twelve | twelve − six |" in text
    assert "| 1.000 | 6/12 | 0 [0, 0] | 0 [0, 0] | 0 [0, 0] |" in text
    assert re.search(r"\| 0\.083 \| –/1 \| – \| \d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\] \| – \|", text)
    csv = pd.read_csv(depth_comparison / "tables" / "ratio_differences.csv")
    assert {"layer", "baseline_layer", "relative_depth"} <= set(csv.columns)
    assert (csv["layer"] == 2 * csv["baseline_layer"]).all()


def test_the_summary_names_no_absolute_path(depth_comparison, six_and_twelve):
    text = (depth_comparison / "summary.md").read_text()
    relative = os.path.relpath(six_and_twelve[0], depth_comparison)
    assert relative.startswith("../") and f"| run directory | `{relative}` |" in text
    assert str(six_and_twelve[0]) not in text


def test_one_tex_file_per_table_and_all_of_them_in_tables_tex(depth_comparison):
    files = sorted(p.name for p in (depth_comparison / "latex").iterdir())
    assert files == ["last_block.tex", "ratios.tex"]
    every = (depth_comparison / "tables.tex").read_text()
    for name in files:
        one = (depth_comparison / "latex" / name).read_text()
        assert one.count(r"\begin{table}") == 1
        body = one[one.index(r"\begin{table}"):]
        assert body in every


def _estimates(cells: list[str]) -> list[str]:
    return [c for c in cells if c not in ("–", "0 [0, 0]")]


def test_every_column_has_fixed_decimals(depth_comparison):
    rows = [line.strip("|").split("|") for line in (depth_comparison / "summary.md").read_text().splitlines()
            if line.startswith("| 0.") or line.startswith("| 1.")]
    assert len(rows) == 13
    for col in range(2, 5):
        numbers = [n for c in _estimates([r[col].strip() for r in rows]) for n in re.findall(r"-?\d+\.?\d*", c)]
        decimals = {len(n.split(".")[1]) if "." in n else 0 for n in numbers if n != "0"}
        assert decimals == {3}, (col, numbers)


def test_the_committed_kind_of_column_no_longer_mixes_roundings():
    """The issue's example: 0.48 [0.465, 0.494] above 0.376 [0.365, 0.387] becomes 0.480 [...] above 0.376 [...]."""
    assert fixed_column([0.48, 0.376], [0.465, 0.365], [0.494, 0.387]) == ["0.480 [0.465, 0.494]",
                                                                           "0.376 [0.365, 0.387]"]
    assert column_decimals([0.472, 0.0301]) == 3 and column_decimals([0.0012]) == 4 and column_decimals([]) == 3
    assert column_decimals([1e-9]) == 5 and format_fixed(0.0, 3) == "0" and format_fixed(-0.0, 3) == "0"
    assert format_fixed(math.nan, 3) == "–" and fixed_column([math.nan], [1], [2]) == ["–"]


def test_same_depth_runs_keep_one_row_per_layer(tmp_path):
    runs = [write_run(tmp_path / n, num_layers=3, n_sequences=30, seed=k) for k, n in enumerate("ab")]
    report.write_comparison(runs, ["a", "b"], tmp_path / "out", formats=("png",), **FAST)
    text = (tmp_path / "out" / "summary.md").read_text()
    assert "| layer | a | b | b − a |" in text and "by relative depth" not in text
    csv = pd.read_csv(tmp_path / "out" / "tables" / "ratio_differences.csv")
    assert (csv["layer"] == csv["baseline_layer"]).all() and len(csv) > 0


def test_an_unknown_layout_is_a_usage_error(six_and_twelve, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["compare", *map(str, six_and_twelve), "--out", str(tmp_path / "o"), "--latex-layout", "narrow"])
    assert stop.value.code == 2 and "--latex-layout" in capsys.readouterr().err
    with pytest.raises(UsageError, match="choose one of page, wide, column"):
        report.write_comparison(six_and_twelve, None, tmp_path / "p", formats=("png",), latex_layout="narrow")


def test_the_column_layout_puts_intervals_under_their_estimates(six_and_twelve, tmp_path):
    assert main(["compare", *map(str, six_and_twelve), "--labels", "six", "twelve", "--out", str(tmp_path / "o"),
                 "--format", "png", "--latex-layout", "column"]) == 0
    tex = (tmp_path / "o" / "latex" / "ratios.tex").read_text()
    assert r"\begin{table}[t]" in tex and r"\footnotesize" in tex and r"\shortstack[r]" in tex
    assert "1.000 & 6/12 & 0 & 0 & 0 \\\\\n &  & [0, 0] & [0, 0] & [0, 0] \\\\[2pt]" in tex


PAGE = {  # layout -> (document class options, the environment), pages as a two-column journal sets them
    "page": ("", "table"), "wide": ("twocolumn", "table*"), "column": ("twocolumn", "table"),
}
PREAMBLE = ("\\documentclass[10pt{opts}]{{article}}\\usepackage{{booktabs}}\\setlength{{\\textwidth}}{{6.5in}}"
            "\\setlength{{\\columnsep}}{{0.25in}}\\setlength{{\\oddsidemargin}}{{0in}}\\begin{{document}}\n")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("pdflatex") is None,
                    reason="no pdflatex here (.ci/run installs texlive-latex-recommended): structure tests only")
@pytest.mark.parametrize("layout", LATEX_LAYOUTS)
def test_each_layout_compiles_and_fits_its_page(six_and_twelve, tmp_path, layout):
    """Columns 3.125 in, text 6.5 in; a table wider than its column or page is an overfull box in the log."""
    opts, env = PAGE[layout]
    outs = []
    for name, runs in (("cmp", six_and_twelve), ("rep", six_and_twelve[:1])):
        out = tmp_path / name
        if name == "cmp":
            report.write_comparison(runs, ["six", "twelve"], out, formats=("png",), latex_layout=layout, **FAST)
        else:
            report.write_report(runs[0], out, formats=("png",), latex_layout=layout, **FAST)
        outs += sorted((out / "latex").glob("*.tex"))
    for tex in outs:
        assert f"\\begin{{{env}}}" in tex.read_text()
    body = "".join(f"\\input{{{os.path.relpath(t, tmp_path)}}}\\clearpage\n" for t in outs)
    (tmp_path / "paper.tex").write_text(PREAMBLE.format(opts="," + opts if opts else "") + body + "\\end{document}\n")
    proc = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "paper.tex"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:]
    log = (tmp_path / "paper.log").read_text(errors="replace")
    assert "Overfull \\hbox" not in log, log[log.index("Overfull"):][:600]


@pytest.mark.slow
def test_the_summary_gives_the_mean_loss_per_loss_position(tmp_path):
    """Under reduction 'sequence' meta.json's mean_loss is per batch (a sum of its sequence means: 30.7 for batches
    of 8); the summary divides by the mean batch size, which gives exactly the mean over sequences."""
    import json

    run = write_run(tmp_path / "run", num_layers=2, n_sequences=30)
    meta = json.loads((run / "meta.json").read_text())
    meta.update(reduction="sequence", mean_loss=30.72,
                counts={**meta["counts"], "batches": 4, "sequences_recorded": 32})
    (run / "meta.json").write_text(json.dumps(meta))
    report.write_report(run, tmp_path / "out", formats=("png",), **FAST)
    text = (tmp_path / "out" / "summary.md").read_text()
    assert "| mean_loss | 3.84 nats per loss position (mean over the 32 sequences of each sequence's mean; " \
           "meta.json's `mean_loss` 30.72 is per batch, a sum of its sequence means) |" in text
    meta.update(reduction="batch", mean_loss=3.5)
    (run / "meta.json").write_text(json.dumps(meta))
    report.write_report(run, tmp_path / "out2", formats=("png",), **FAST)
    assert "| mean_loss | 3.5 nats per loss position (mean over batches of each batch's mean) |" in \
        (tmp_path / "out2" / "summary.md").read_text()
