"""gradflow.figures.mask_ratio: the gradient flow by masking ratio, drawn, and in the report of a diffusion run only."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from figure_layout import assert_clean_layout  # noqa: E402
from gradflow import schema  # noqa: E402
from gradflow.cli.main import main  # noqa: E402
from gradflow.figures import report  # noqa: E402
from gradflow.figures.mask_ratio import layer_colors, mask_ratio_lines  # noqa: E402
from gradflow.figures.style import gradflow_style  # noqa: E402
from gradflow.formatting import fixed_column  # noqa: E402
from synthetic_runs import write_run  # noqa: E402

FAST = dict(n_resamples=60)
MASK_FILES = {"ratio_by_mask_ratio.pdf", "ratio_by_mask_ratio.png", "mask_ratio_profile.csv"}


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def _table(layers: int = 4, ts=(0.1, 0.3, 0.5, 0.7, 0.9), grid: bool = True) -> pd.DataFrame:
    """A ratio_by_mask_ratio-like table: ratios rising with t, falling with depth, the last layer exactly 0."""
    rows = []
    for layer in range(layers + 1):
        for t in ts:
            zero = layer == layers
            ratio = 0.0 if zero else (0.3 + 1.2 * t) * (1 - layer / (layers + 1))
            low, high = (t, t) if grid else (t - 0.1, t + 0.1)
            rows.append({"layer": layer, "site": f"s{layer}", "t_low": low, "t_high": high, "t_mid": t,
                         "n_sequences": 40, "ratio": ratio, "ci_low": 0.9 * ratio, "ci_high": 1.1 * ratio,
                         "context_mean": ratio, "loss_mean": 1.0, "n_context": 100, "n_loss": 50,
                         "exact_zero": zero})
    return pd.DataFrame(rows)


def _figure(artists) -> plt.Figure:
    return next(a.figure for a in artists if getattr(a, "figure", None) is not None)


def test_lines_bands_and_exact_zeros_on_y_zero():
    table = _table()
    artists = mask_ratio_lines(table)
    by_gid = {a.get_gid(): a for a in artists if a.get_gid()}
    assert {f"ratio:{k}" for k in range(5)} | {f"band:{k}" for k in range(5)} | {"zeros:4", "reference",
                                                                                   "colorbar"} <= set(by_gid)
    line = by_gid["ratio:1"]
    assert np.allclose(line.get_xdata(), [0.1, 0.3, 0.5, 0.7, 0.9])
    assert np.allclose(line.get_ydata(), table.loc[table["layer"] == 1, "ratio"])
    assert np.isnan(by_gid["ratio:4"].get_ydata()).all()  # the zero layer has no line, only its markers
    zeros = by_gid["zeros:4"]
    ax = zeros.axes
    assert np.allclose(zeros.get_xdata(), [0.1, 0.3, 0.5, 0.7, 0.9]) and (np.asarray(zeros.get_ydata()) == 0).all()
    assert ax.get_ylim()[0] == 0.0  # the markers sit on the axis floor, which is y = 0
    assert zeros.get_marker() != line.get_marker()
    assert to_rgba(zeros.get_markerfacecolor()) == to_rgba(layer_colors(range(5))[4])
    legend = next(a for a in artists if isinstance(a, matplotlib.legend.Legend))
    assert [t.get_text() for t in legend.get_texts()] == ["exactly 0", "95% CI", "context = loss"]
    assert ax.get_xlabel() == "masking ratio t (fraction of tokens masked)" and "ratio" in ax.get_ylabel()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.1", "0.3", "0.5", "0.7", "0.9"]
    fig = _figure(artists)
    assert tuple(fig.get_size_inches()) == pytest.approx((3.5, 3.5 * 0.74))


def test_layer_colours_run_light_to_dark():
    colors = layer_colors([3, 0, 1, 2])
    lightness = [sum(colors[k][:3]) for k in range(4)]
    assert list(colors) == [0, 1, 2, 3] and lightness == sorted(lightness, reverse=True)


def test_no_zero_no_zero_legend_entry_and_no_band_without_ci():
    table = _table()
    table = table[table["layer"] < 4]
    artists = mask_ratio_lines(table, ci=False, colorbar=False)
    assert not any((a.get_gid() or "").startswith(("zeros:", "band:", "colorbar")) for a in artists)
    legend = next(a for a in artists if isinstance(a, matplotlib.legend.Legend))
    assert [t.get_text() for t in legend.get_texts()] == ["context = loss"]


@pytest.mark.parametrize("width", ["single", "double"])
@pytest.mark.parametrize("grid", [True, False])
@pytest.mark.parametrize("title", [None, "Gradient flow by masking ratio, masked diffusion"])
def test_the_figure_fits_its_width(width, grid, title):
    table = _table(layers=12, ts=(0.1, 0.3, 0.5, 0.7, 0.9) if grid else (0.1, 0.3, 0.5, 0.7, 0.9), grid=grid)
    with gradflow_style(width):
        fig = _figure(mask_ratio_lines(table, width=width, title=title))
        assert_clean_layout(fig, f"mask ratio figure at {width}, grid {grid}, title {title!r}")


def test_into_a_given_axes():
    fig, ax = plt.subplots()
    artists = mask_ratio_lines(_table(), ax=ax, legend=False, colorbar=False)
    assert all(a.axes is ax for a in artists if hasattr(a, "axes") and a.axes is not None)
    assert ax.get_legend() is None


@pytest.fixture(scope="module")
def diffusion_run(tiny_mlm_dir, tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("diffusion") / "run"
    assert main(["record", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--out", str(out),
                 "--objective", "diffusion", "--mask-ratios", "0.25,0.75", "--max-length", "24",
                 "--batch-size", "4", "--limit", "16", "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def diffusion_report(diffusion_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    return out, report.write_report(diffusion_run, out, **FAST)


@pytest.mark.slow
def test_report_of_a_diffusion_run_draws_and_tabulates_the_ratio_by_t(diffusion_report):
    out, paths = diffusion_report
    names = {p.name for p in paths}
    assert MASK_FILES <= names and all(p.stat().st_size > 0 for p in paths)
    assert (out / "ratio_by_mask_ratio.pdf").read_bytes().startswith(b"%PDF")
    table = pd.read_csv(out / "tables" / "mask_ratio_profile.csv")
    assert tuple(table.columns) == schema.REPORT_TABLES["mask_ratio_profile"]
    assert sorted(table["t_mid"].unique()) == [0.25, 0.75] and len(table) == 3 * 2  # layers 0-2, two t
    last = table[table["layer"] == 2]
    assert last["exact_zero"].all() and (last["ratio"] == 0).all()
    summary = (out / "summary.md").read_text()
    section = summary.split("## Gradient flow by masking ratio t (masked diffusion)")[1].split("## Figures")[0]
    assert "- Layer 2: the context gradient is exactly 0 at every t (2 bins" in section
    assert "| layer | t = 0.25 | t = 0.75 |" in section and "| 2 | 0 [0, 0] | 0 [0, 0] |" in section
    assert "![ratio_by_mask_ratio](ratio_by_mask_ratio.png)" in summary
    at = table[table["t_mid"] == 0.25].sort_values("layer")
    cells = fixed_column(at["ratio"], at["ci_low"], at["ci_high"])  # the CSV's numbers, as the table rounds them
    assert all(f"| {layer} | {cell} |" in section for layer, cell in zip(at["layer"], cells))
    tex = (out / "tables.tex").read_text()
    assert r"\label{tab:gradflow-mask-ratio-" in tex and "0 [0, 0]" in tex  # two bins: with intervals
    assert (out / "latex" / "mask_ratio.tex").is_file()


@pytest.mark.slow
def test_report_of_a_run_without_mask_ratios_is_unchanged(tmp_path):
    paths = report.write_report(write_run(tmp_path / "run", num_layers=2, n_sequences=6), tmp_path / "out", **FAST)
    assert not MASK_FILES & {p.name for p in paths}
    assert not list((tmp_path / "out").rglob("*mask_ratio*"))
    assert {p.stem for p in (tmp_path / "out" / "tables").glob("*.csv")} == set(schema.REPORT_TABLES) - {
        "context_pressure", "mask_ratio_profile"}
    assert "masking ratio" not in (tmp_path / "out" / "summary.md").read_text()
    assert "mask-ratio" not in (tmp_path / "out" / "tables.tex").read_text()


@pytest.mark.slow
def test_many_bins_give_the_latex_table_in_panels_with_intervals(diffusion_run, tmp_path):
    """Eight bins do not fit a page in one row: the LaTeX table is split into panels, every ratio with its interval
    (issue 59 point 4: it carried the estimates alone)."""
    run_dir = tmp_path / "run"
    shutil.copytree(diffusion_run, run_dir)
    ratios = pd.read_parquet(run_dir / "mask_ratios.parquet")
    ratios.assign(mask_ratio=[0.1, 0.3, 0.5, 0.7, 0.9, 0.2, 0.4, 0.6] * 2).to_parquet(run_dir / "mask_ratios.parquet")
    report.write_report(run_dir, tmp_path / "out", formats=("png",), **FAST)
    tex = (tmp_path / "out" / "latex" / "mask_ratio.tex").read_text()
    assert "t = 0.9" in tex and "mask\\_ratio\\_profile.csv" not in tex
    headers = [line for line in tex.splitlines() if line.startswith("layer & ")]
    assert len(headers) == 2 and sum(line.count("t = ") for line in headers) == 8  # two panels, eight bins
    rows = [line for line in tex.splitlines() if line[:1].isdigit()]
    assert len(rows) == 3 * 2 and all(line.count("[") == line.count("&") for line in rows)  # layers 0-2, each panel


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="pdflatex is not installed")
@pytest.mark.parametrize("layout", ["page", "column"])
def test_the_latex_table_compiles_without_an_overfull_box(diffusion_run, tmp_path, layout):
    report.write_report(diffusion_run, tmp_path, formats=("png",), latex_layout=layout, **FAST)
    width = "3.125in" if layout == "column" else "6.5in"
    (tmp_path / "paper.tex").write_text(f"\\documentclass{{article}}\\usepackage{{booktabs}}\\textwidth={width}"
                                        "\\begin{document}\\input{latex/mask_ratio.tex}\\end{document}\n")
    proc = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "paper.tex"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert not re.search(r"Overfull \\hbox", (tmp_path / "paper.log").read_text(errors="replace"))
