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
from gradflow.figures.mask_ratio import (  # noqa: E402
    FLOOR_ROOM,
    PANELS,
    layer_colors,
    mask_ratio_lines,
    mask_ratio_panels,
)
from gradflow.figures.report_moe import MOE_TABLES  # noqa: E402
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
    """A ratio_by_mask_ratio-like table: a flat numerator, a denominator falling like 1/t, so ratios rising with t
    and falling with depth; the clean share falling with t; the last layer exactly 0."""
    rows = []
    for layer in range(layers + 1):
        for t in ts:
            zero = layer == layers
            context = 0.0 if zero else 0.01 * (1 - layer / (layers + 1))
            loss = 0.004 / t
            ratio, share = context / loss, context * (1 - t) / (context * (1 - t) + loss * t)
            low, high = (t, t) if grid else (t - 0.1, t + 0.1)
            rows.append({"layer": layer, "site": f"s{layer}", "t_low": low, "t_high": high, "t_mid": t,
                         "n_sequences": 40, "ratio": ratio, "ci_low": 0.9 * ratio, "ci_high": 1.1 * ratio,
                         "context_mean": context, "context_ci_low": 0.9 * context, "context_ci_high": 1.1 * context,
                         "loss_mean": loss, "loss_ci_low": 0.9 * loss, "loss_ci_high": 1.1 * loss,
                         "context_share": share, "share_ci_low": 0.9 * share, "share_ci_high": 1.1 * share,
                         "n_context": 100, "n_loss": 50, "exact_zero": zero})
    return pd.DataFrame(rows, columns=list(schema.ANALYSIS_COLUMNS["mask_ratio_profile"]))


def _figure(artists) -> plt.Figure:
    return next(a.figure for a in artists if getattr(a, "figure", None) is not None)


def _floor_gap_pt(ax, ys) -> float:
    """Points between the exact-zero triangles (the axis floor) and the lowest drawn value ``ys`` on ``ax``."""
    floor = ax.transAxes.transform((0, 0))[1]
    lowest = ax.transData.transform((0.5, float(np.nanmin(ys))))[1]
    return (lowest - floor) * 72.0 / ax.figure.dpi


def test_the_ratio_alone_on_a_log_axis_with_exact_zeros_on_the_floor():
    table = _table()
    artists = mask_ratio_lines(table)
    by_gid = {a.get_gid(): a for a in artists if a.get_gid()}
    assert {f"ratio:{k}" for k in range(5)} | {f"band:ratio:{k}" for k in range(5)} | {
        "zeros:ratio:4", "reference", "colorbar"} <= set(by_gid)
    line = by_gid["ratio:1"]
    assert np.allclose(line.get_xdata(), [0.1, 0.3, 0.5, 0.7, 0.9])
    assert np.allclose(line.get_ydata(), table.loc[table["layer"] == 1, "ratio"])
    assert np.isnan(by_gid["ratio:4"].get_ydata()).all()  # the zero layer has no line, only its markers
    zeros = by_gid["zeros:ratio:4"]
    ax = zeros.axes
    assert ax.get_yscale() == "log"
    assert np.allclose(zeros.get_xdata(), [0.1, 0.3, 0.5, 0.7, 0.9])
    # the floor sits FLOOR_ROOM below the smallest value drawn (a CI end): the layer before the last stays clear
    smallest = table.loc[table["layer"] < 4, "ci_low"].min()
    assert ax.get_ylim()[0] == pytest.approx(smallest / FLOOR_ROOM)
    assert zeros.get_marker() != line.get_marker()
    assert to_rgba(zeros.get_markerfacecolor()) == to_rgba(layer_colors(range(5))[4])
    legend = next(a for a in artists if isinstance(a, matplotlib.legend.Legend))
    assert [t.get_text() for t in legend.get_texts()] == ["exactly 0", "95% CI", "context = loss"]
    assert ax.get_xlabel() == "masking ratio t (fraction of tokens masked)" and "ratio" in ax.get_ylabel()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.1", "0.3", "0.5", "0.7", "0.9"]
    fig = _figure(artists)
    assert tuple(fig.get_size_inches()) == pytest.approx((3.5, 3.5 * 0.74))


def test_four_panels_numerator_denominator_ratio_and_share():
    """(a) context mean and (b) loss mean on one y range, (c) the ratio with its reference, (d) the share; each
    line is its column, the last layer's zeros are floor triangles in (a), (c) and (d), never in (b)."""
    table = _table()
    artists = mask_ratio_panels(table)
    by_gid = {a.get_gid(): a for a in artists if a.get_gid()}
    axes = {}
    for panel in PANELS:
        for layer in range(4):
            line = by_gid[f"{panel.value}:{layer}"]
            assert np.allclose(line.get_ydata(), table.loc[table["layer"] == layer, panel.value])
            assert f"band:{panel.value}:{layer}" in by_gid
        axes[panel.value] = by_gid[f"{panel.value}:0"].axes
        assert axes[panel.value].get_yscale() == "log"
        assert (f"zeros:{panel.value}:4" in by_gid) == (panel.value != "loss_mean")
    assert axes["context_mean"].get_ylim() == axes["loss_mean"].get_ylim()  # numerator and denominator compared
    assert by_gid["reference"].axes is axes["ratio"]
    assert [axes[p.value].get_title(loc="left") for p in PANELS] == [p.title for p in PANELS]
    for panel in PANELS[2:]:  # every panel with zeros: the floor is FLOOR_ROOM below the smallest drawn value
        ax = axes[panel.value]
        drawn = table.loc[table["layer"] < 4, [panel.value, panel.low]].to_numpy(float)
        assert ax.get_ylim()[0] == pytest.approx(drawn.min() / FLOOR_ROOM)
    legend = next(a for a in artists if isinstance(a, matplotlib.legend.Legend))
    assert [t.get_text() for t in legend.get_texts()] == ["exactly 0", "95% CI", "context = loss (c)"]
    fig = _figure(artists)
    assert fig.get_size_inches()[0] == pytest.approx(3.5)
    assert fig.get_supxlabel() == "masking ratio t (fraction of tokens masked)"


def test_the_layer_before_the_last_is_not_hidden_by_the_zeros_on_a_real_run(diffusion_run):
    """On a recorded run, every panel with exact zeros keeps its lowest line at least a marker's height above the
    triangles on the floor (the linear ratio axis put the layer before the last under them)."""
    from gradflow.analysis import load_run, ratio_by_mask_ratio
    table = ratio_by_mask_ratio(load_run(diffusion_run), n_resamples=50)
    artists = mask_ratio_panels(table)
    fig = _figure(artists)
    fig.canvas.draw()
    by_gid = {a.get_gid(): a for a in artists if a.get_gid()}
    last = int(table["layer"].max())
    for panel in (PANELS[0], PANELS[2], PANELS[3]):
        ax = by_gid[f"zeros:{panel.value}:{last}"].axes
        before = table.loc[table["layer"] < last, panel.value].to_numpy(float)
        assert _floor_gap_pt(ax, before) > 4.5 / 2  # above the top of the triangles


def test_a_table_without_the_new_columns_is_refused_in_one_sentence():
    old = _table().drop(columns=["context_share", "share_ci_low", "share_ci_high"])
    with pytest.raises(ValueError, match="context_share.*regenerate the report"):
        mask_ratio_panels(old)


def test_layer_colours_run_light_to_dark():
    colors = layer_colors([3, 0, 1, 2])
    lightness = [sum(colors[k][:3]) for k in range(4)]
    assert list(colors) == [0, 1, 2, 3] and lightness == sorted(lightness, reverse=True)


def test_no_zero_no_zero_legend_entry_and_no_band_without_ci():
    table = _table()
    table = table[table["layer"] < 4]
    artists = mask_ratio_lines(table, ci=False, colorbar=False)
    assert not any((a.get_gid() or "").startswith(("zeros:", "band:", "colorbar")) for a in artists)
    assert mask_ratio_panels(table, ci=False, colorbar=False)
    legend = next(a for a in artists if isinstance(a, matplotlib.legend.Legend))
    assert [t.get_text() for t in legend.get_texts()] == ["context = loss"]


@pytest.mark.parametrize("width", ["single", "double"])
@pytest.mark.parametrize("grid", [True, False])
@pytest.mark.parametrize("title", [None, "Gradient flow by masking ratio, masked diffusion"])
@pytest.mark.parametrize("draw", [mask_ratio_lines, mask_ratio_panels], ids=["the ratio alone", "four panels"])
def test_the_figure_fits_its_width(width, grid, title, draw):
    table = _table(layers=12, ts=(0.1, 0.3, 0.5, 0.7, 0.9) if grid else (0.1, 0.3, 0.5, 0.7, 0.9), grid=grid)
    with gradflow_style(width):
        fig = _figure(draw(table, width=width, title=title))
        assert_clean_layout(fig, f"{draw.__name__} at {width}, grid {grid}, title {title!r}")


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
        "context_pressure", "mask_ratio_profile", *MOE_TABLES}
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
    # panels (two or three: the split follows the cells' measured widths, which follow the recorded numbers), every
    # one of the eight bins in exactly one of them
    assert len(headers) >= 2 and sum(line.count("t = ") for line in headers) == 8
    rows = [line for line in tex.splitlines() if line[:1].isdigit()]
    assert len(rows) == 3 * len(headers)  # layers 0-2 in each panel
    cells = [c.strip() for line in rows for c in line.rstrip("\\ ").split("&")[1:]]
    assert all("[" in c for c in cells if c) and sum(1 for c in cells if c) == 3 * 8  # every ratio with its interval


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
