"""gradflow.figures: artists drawn, counts, saving, and no leaking of the style into rcParams."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib as mpl  # noqa: E402
import matplotlib.image as mpimg  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import LineCollection, PolyCollection, QuadMesh  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from gradflow import analysis as A  # noqa: E402
from gradflow import figures as F  # noqa: E402
from gradflow.figures.style import STYLE_PATH, figure_size, gradflow_style  # noqa: E402
from gradflow.roles import ROLE_ORDER  # noqa: E402
from synthetic_runs import write_run  # noqa: E402

N_LAYERS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> A.Run:
    return A.load_run(write_run(tmp_path_factory.mktemp("fig") / "a", num_layers=N_LAYERS, n_sequences=30))


@pytest.fixture(scope="module")
def comparison(tmp_path_factory, run) -> A.Comparison:
    root = tmp_path_factory.mktemp("cmp")
    b = A.load_run(write_run(root / "b", num_layers=N_LAYERS, n_sequences=30, seed=5, loss="all-positions"))
    c = A.load_run(write_run(root / "c", num_layers=N_LAYERS, n_sequences=30, seed=6))
    return A.compare_runs([run, b, c], ["mlm", "all", "mlm2"], n_resamples=100)


@pytest.fixture(autouse=True)
def _close_and_no_show(monkeypatch):
    def no_show(*args, **kwargs):
        raise AssertionError("plot functions must not call plt.show()")
    monkeypatch.setattr(plt, "show", no_show)
    yield
    plt.close("all")


def _rc() -> dict:
    rc = dict(mpl.rcParams)
    rc.pop("backend", None)
    return rc


def _gid(artists, prefix: str) -> list:
    return [a for a in artists if str(a.get_gid() or "").startswith(prefix)]


# ---------------------------------------------------------------------------------------------- style

def test_style_sheet_values():
    rc = mpl.rc_params_from_file(STYLE_PATH, use_default_template=False)
    assert rc["text.usetex"] is False
    for key in ("font.size", "axes.labelsize", "xtick.labelsize", "ytick.labelsize", "legend.fontsize"):
        assert 7 <= float(rc[key]) <= 8
    assert float(rc["axes.linewidth"]) <= 0.8
    assert rc["figure.figsize"] == [3.5, 2.4]
    assert rc["pdf.fonttype"] == 42
    assert figure_size("double")[0] == 7.0 and figure_size("single")[0] == 3.5


def test_style_context_restores_rcparams_even_on_error():
    before = _rc()
    with gradflow_style("double"):
        assert mpl.rcParams["font.size"] == 7 and mpl.rcParams["figure.figsize"][0] == 7.0
    assert _rc() == before
    with pytest.raises(RuntimeError):
        with gradflow_style():
            mpl.rcParams["lines.linewidth"] = 9
            raise RuntimeError("boom")
    assert _rc() == before


def test_role_colors_fixed_and_distinct():
    colors = [F.ROLE_COLORS[r] for r in (*ROLE_ORDER, "loss")]
    assert len(set(colors)) == len(colors)
    assert F.role_color("context") == "#0077BB" and F.role_color("prompt") == "#332288"
    assert "prompt" in F.PLOT_ROLES  # an SFT run's profiles draw it



# ---------------------------------------------------------------------------------------------- plots

def test_depth_profile_counts_and_colors(run):
    before = _rc()
    prof = A.role_profile(run, n_resamples=100)
    artists = F.depth_profile(prof, roles=("context", "masked"))
    lines = _gid(artists, "profile:")
    assert len(lines) == 2
    assert len(_gid(artists, "band:")) == 2 and all(isinstance(a, PolyCollection) for a in _gid(artists, "band:"))
    zeros = _gid(artists, "zeros:")
    assert [z.get_gid() for z in zeros] == ["zeros:context"]  # context is exactly 0 in the last block
    assert list(zeros[0].get_xdata()) == [N_LAYERS]
    ctx = next(a for a in lines if a.get_gid() == "profile:context")
    assert to_hex(ctx.get_color()).upper() == F.role_color("context").upper()
    assert np.isnan(ctx.get_ydata()[-1])  # the zero is not drawn on the (log) line
    ax = ctx.axes
    assert ax.get_yscale() == "log"
    assert "exactly 0" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert _rc() == before


def _display_x(marker) -> np.ndarray:
    """Where a floor marker's points are drawn, in display pixels (its transform carries the sideways shift)."""
    marker.figure.canvas.draw()
    return marker.get_transform().transform(np.column_stack([marker.get_xdata(), marker.get_ydata()]))[:, 0]


def _tick_x(ax, layer) -> float:
    return float(ax.transData.transform((layer, 1.0))[0])


def test_depth_profile_zero_marker_sits_on_the_last_layers_tick(run):
    """Issue 49: the context zero of the last block was drawn 3.5-7 pt right of the last tick (a per-role shift)."""
    prof = A.role_profile(run, n_resamples=50)
    for roles in (None, ("context", "masked"), ("masked", "random", "kept", "context")):
        artists = F.depth_profile(prof, roles=roles)
        (zeros,) = _gid(artists, "zeros:")
        ax = zeros.axes
        assert N_LAYERS in ax.get_xticks()
        np.testing.assert_allclose(_display_x(zeros), [_tick_x(ax, N_LAYERS)], atol=1e-6)


def test_depth_profile_zero_markers_of_several_roles_are_centred_on_their_layer():
    from gradflow.figures.canvas import ZERO_SPACING_PT

    layers = np.arange(4)
    means = {"masked": [1.0, 1.0, 1.0, 1.0], "kept": [0.5, 0.0, 0.5, 0.0], "context": [0.5, 0.5, 0.5, 0.0]}
    prof = pd.DataFrame([{"layer": int(l), "role": r, "grad_norm_mean": m[l], "ci_low": m[l] / 2, "ci_high": m[l] * 2}
                         for r, m in means.items() for l in layers])
    artists = F.depth_profile(prof, roles=list(means))
    ax = artists[0].axes
    drawn = {}
    for marker in _gid(artists, "zeros:"):
        for x, px in zip(marker.get_xdata(), _display_x(marker)):
            drawn.setdefault(int(x), {})[marker.get_gid()] = px
    assert set(drawn[1]) == {"zeros:kept"} and set(drawn[3]) == {"zeros:kept", "zeros:context"}
    assert drawn[1]["zeros:kept"] == pytest.approx(_tick_x(ax, 1))  # alone: on the tick
    pair = drawn[3]  # two roles at the last layer: side by side, centred on the tick, in the roles' order
    assert (pair["zeros:kept"] + pair["zeros:context"]) / 2 == pytest.approx(_tick_x(ax, 3))
    spacing_px = ZERO_SPACING_PT / 72 * ax.figure.dpi
    assert pair["zeros:context"] - pair["zeros:kept"] == pytest.approx(spacing_px)


def test_floor_marker_shifts():
    from gradflow.figures.canvas import floor_marker_shifts

    shifts = floor_marker_shifts({"a": np.array([1, 3]), "b": np.array([3]), "c": np.array([2, 3])}, spacing_pt=4.0)
    assert shifts["a"].tolist() == [0.0, -4.0] and shifts["b"].tolist() == [0.0] and shifts["c"].tolist() == [0.0, 4.0]
    assert floor_marker_shifts({}) == {} and floor_marker_shifts({"a": np.array([])})["a"].size == 0


def test_depth_profile_draws_into_given_axes(run):
    prof = A.role_profile(run, n_resamples=50)
    fig, (ax1, ax2) = plt.subplots(1, 2)
    artists = F.depth_profile(prof, ax=ax2, legend=False)
    assert all(a.axes is ax2 for a in _gid(artists, "profile:"))
    assert len(_gid(artists, "profile:")) == 5
    assert len(ax1.lines) == 0
    assert len(plt.get_fignums()) == 1


def test_ratio_heatmap_cells(run):
    before = _rc()
    ratios = A.role_ratios(run, n_resamples=50)
    artists = F.ratio_heatmap(ratios)
    mesh = _gid(artists, "heatmap")[0]
    assert isinstance(mesh, QuadMesh)
    assert mesh.get_array().size == (N_LAYERS + 1) * 5
    zero_cells = [a for a in _gid(artists, "heatmap:zero") if isinstance(a, Rectangle)]
    assert len(zero_cells) == 1  # context at the last block
    assert "0" in [t.get_text() for t in _gid(artists, "heatmap:label")]
    assert _rc() == before


def test_ratio_heatmap_annotation_switch(run):
    ratios = A.role_ratios(run, roles=("context", "masked"), n_resamples=50)
    labels = _gid(F.ratio_heatmap(ratios, annotate=True), "heatmap:label")
    assert len(labels) == (N_LAYERS + 1) * 2
    labels = _gid(F.ratio_heatmap(ratios, annotate=False), "heatmap:label")
    assert [t.get_text() for t in labels] == ["0"]  # exact zeros are always labelled


def test_last_block_bars(run):
    deficit = A.last_block_deficit(run)
    artists = F.last_block_bars(deficit)
    assert len(_gid(artists, "last")) - len(_gid(artists, "last:zero")) == len(deficit)
    assert len(_gid(artists, "earlier")) == len(deficit)
    assert len(_gid(artists, "last:zero")) == int(deficit["exact_zero"].sum())


def test_distribution_ranges(run):
    q = A.channel_quantiles(run)
    artists = F.distribution_ranges(q, roles=("context", "masked"))
    ranges = _gid(artists, "range:")
    assert len(ranges) == 2 and all(isinstance(r, LineCollection) for r in ranges)
    ctx = next(r for r in ranges if r.get_gid() == "range:context")
    assert len(ctx.get_segments()) == N_LAYERS  # the all-zero last block has no range ...
    assert len(_gid(artists, "zeros:context")) == 1  # ... but a floor marker
    medians = _gid(artists, "median:")
    assert sum(len(m.get_xdata()) for m in medians) == 2 * (N_LAYERS + 1) - 1


def test_sublayer_heatmap(run):
    shares = A.sublayer_shares(run)
    artists = F.sublayer_heatmap(shares, "coverage")
    mesh = _gid(artists, "sublayers")[0]
    n_sub = shares["sublayer"].nunique()
    assert mesh.get_array().size == N_LAYERS * n_sub
    zeros = [a for a in _gid(artists, "sublayers:zero") if isinstance(a, Rectangle)]
    assert len(zeros) == 6  # after-mixing sublayers of the last block


def test_comparison_plots(comparison):
    before = _rc()
    artists = F.comparison_profiles(comparison.profiles, comparison.labels)
    fig = artists[0].figure
    assert len(fig.axes) == 3
    assert len(_gid(artists, "profile:")) == 3 * 5
    artists = F.comparison_ratios(comparison)
    assert len(_gid(artists, "ratio:")) == 3
    assert len(_gid(artists, "difference:")) == 2
    artists = F.comparison_last_block(comparison)
    n_sub = comparison.last_block["sublayer"].nunique()
    bars = [a for a in _gid(artists, "last:") if isinstance(a, Rectangle)]
    assert len(bars) == 3 * n_sub
    assert len(_gid(artists, "earlier:")) == 3
    assert _rc() == before


def test_banner_and_save_figure(run, tmp_path):
    before = _rc()
    artists = F.depth_profile(A.role_profile(run, n_resamples=50))
    fig = artists[0].figure
    banner = F.add_banner(fig)
    assert "INCOMPLETE" in banner.get_text()
    paths = F.save_figure(fig, tmp_path / "sub" / "profile")
    assert [p.name for p in paths] == ["profile.pdf", "profile.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
    assert paths[0].read_bytes()[:4] == b"%PDF"
    png = mpimg.imread(paths[1])
    assert png.shape[1] == pytest.approx(3.5 * 300, abs=2)  # 300 dpi at single-column width
    assert _rc() == before


def test_save_figure_strips_known_suffix(tmp_path):
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    paths = F.save_figure(fig, tmp_path / "x.png", formats=("png",))
    assert [p.name for p in paths] == ["x.png"]


@pytest.mark.slow
def test_saved_files_are_byte_stable(tmp_path):
    """Saving the same figure twice, a second apart, gives identical bytes (no dates, no random ids)."""
    import os
    import time

    env = os.environ.get("SOURCE_DATE_EPOCH")
    with gradflow_style("single"):
        fig, ax = plt.subplots(layout="constrained")
        ax.plot([0, 1, 2], [1, 3, 2], label="run")
        ax.set(title="title", xlabel="layer", ylabel="ratio")
        ax.legend()
    formats = ("pdf", "png", "svg")
    first = F.save_figure(fig, tmp_path / "a" / "figure", formats)
    time.sleep(1.1)  # a creation date in seconds would now differ
    second = F.save_figure(fig, tmp_path / "b" / "figure", formats)
    for a, b in zip(first, second):
        assert a.read_bytes() == b.read_bytes(), a.suffix
    assert b"CreationDate" not in first[0].read_bytes()
    assert b"Software" in first[1].read_bytes()  # the PNG keeps matplotlib's Software key
    eps = F.save_figure(fig, tmp_path / "figure", ("eps",))[0]  # PostScript names its file: same path
    before = eps.read_bytes()
    time.sleep(1.1)
    F.save_figure(fig, tmp_path / "figure", ("eps",))
    assert eps.read_bytes() == before
    assert os.environ.get("SOURCE_DATE_EPOCH") == env  # the caller's environment is left as it was
