"""``gradflow report --width``: a width preset given picks the LaTeX layout unless ``--latex-layout`` is given (issue 59
point 4: the default page layout, about 430-450 pt wide, overflows a two-column paper's column)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from gradflow.cli.main import build_parser, main  # noqa: E402
from gradflow.cli.options import latex_layout  # noqa: E402
from gradflow.figures.report_tables import WIDTH_LAYOUTS, layout_for_width  # noqa: E402
from synthetic_runs import write_run  # noqa: E402


@pytest.mark.parametrize("options, layout", [
    ([], "page"),
    (["--width", "single"], "column"),
    (["--width=single"], "column"),
    (["--width", "double"], "wide"),
    (["--width", "single", "--latex-layout", "page"], "page"),
    (["--latex-layout", "wide", "--width", "single"], "wide"),
    (["--latex-layout", "column"], "column"),
    (["--latex-layout", "page"], "page"),
], ids=["neither: page", "single: column", "single with '=': column", "double: wide",
        "single with an explicit page: page", "an explicit wide wins over single", "an explicit column",
        "an explicit page"])
@pytest.mark.parametrize("command", [["report", "runs/x"], ["compare", "runs/x", "runs/y"]], ids=["report", "compare"])
def test_a_width_given_picks_the_latex_layout_unless_one_is_given(options, layout, command):
    args = build_parser().parse_args([*command, "--out", "o", *options])
    assert latex_layout(args) == layout
    assert args.width in ("single", "double") and str(args.width) == args.width  # still the plain preset


def test_a_command_without_width_keeps_its_layout():
    args = build_parser().parse_args(["atlas", "gradflow-mini-en", "--out", "o"])
    assert latex_layout(args) == "page" and not hasattr(args, "width")


def test_layout_for_width_in_python():
    assert WIDTH_LAYOUTS == {"single": "column", "double": "wide"}
    assert layout_for_width("single") == "column" and layout_for_width("double") == "wide"
    assert layout_for_width(3.03) == "page" and layout_for_width("single", "page") == "page"


@pytest.mark.slow
def test_report_width_single_writes_column_tables(tmp_path):
    run = write_run(tmp_path / "run", num_layers=2, n_sequences=8)
    assert main(["report", str(run), "--out", str(tmp_path / "out"), "--format", "png", "--width", "single"]) == 0
    head = (tmp_path / "out" / "tables.tex").read_text().splitlines()[0]
    assert head.endswith("column layout; needs \\usepackage{booktabs}")
    assert r"\footnotesize" in (tmp_path / "out" / "latex" / "ratios.tex").read_text()
