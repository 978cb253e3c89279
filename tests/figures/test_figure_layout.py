"""Every gradflow figure at both column widths, with short and long labels: nothing clipped or covered.

The check is :func:`figure_layout.layout_problems` (clipped text, legends over labels or other
panels, overlapping labels, collapsed axes); its self-tests plant a clipped title and a legend
over a y label. Inputs are synthetic: run tables from :mod:`synthetic_runs`, and small frames with
the columns the diagnostics, probe, atlas and channel-view figures read.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from figure_layout import assert_clean_layout, layout_problems  # noqa: E402
from gradflow import analysis as A  # noqa: E402
from gradflow import figures as F  # noqa: E402
from gradflow.figures import atlas as atlas_figures  # noqa: E402
from gradflow.figures import diagnostics as D  # noqa: E402
from gradflow.figures.canvas import add_banner  # noqa: E402
from gradflow.figures.channel_view import plot_channel_view  # noqa: E402
from gradflow.figures.pressure import pressure_bars  # noqa: E402
from gradflow.figures.probes import probe_panels  # noqa: E402
from gradflow.figures.style import gradflow_style  # noqa: E402
from synthetic_runs import write_run  # noqa: E402

N_LAYERS = 6
WIDTHS = ("single", "double")
SHORT = ("mini-en", "mini-en-alltoken", "mini-en-s1")
LONG = ("mini-en (MLM loss, 6 blocks)", "mini-en-alltoken (all-positions loss)", "mini-en (MLM loss, seed 1)")
LABELS = {"short": SHORT, "long": LONG}


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def _figure(artists) -> plt.Figure:
    for artist in artists:
        fig = getattr(artist, "figure", None)
        if fig is not None:
            return getattr(fig, "figure", None) or fig  # a SubFigure's .figure is its root figure
    raise AssertionError("nothing drawn")


# ---------------------------------------------------------------------------------------------- the check

def test_clean_figure_has_no_problems():
    with gradflow_style("single"):
        fig, ax = plt.subplots(layout="constrained")
        ax.plot([0, 1], [0, 1], label="a")
        ax.set(title="title", xlabel="x", ylabel="y")
        ax.legend(loc="lower right")
        assert layout_problems(fig) == []


def test_flags_a_clipped_title():
    with gradflow_style("single"):
        fig, ax = plt.subplots(layout="constrained")
        ax.plot([0, 1], [0, 1])
        ax.set_title("a title much too long for one column: " * 3)
        problems = layout_problems(fig)
    assert any(p.startswith("clipped: title") and "left" in p and "right" in p for p in problems), problems


def test_flags_a_legend_over_the_y_label_and_ticks():
    with gradflow_style("single"):
        fig, ax = plt.subplots(layout="constrained")
        ax.plot([0, 1], [0, 1], label="a rather long run label")
        ax.set_ylabel("gradient norm")
        ax.set_yticks([0.0, 0.5, 1.0])
        ax.legend(loc="center right", bbox_to_anchor=(0.1, 0.5))
        problems = layout_problems(fig)
    assert any("legend: legend" in p and "axis label 'gradient norm'" in p for p in problems), problems
    assert any("legend: legend" in p and "tick label" in p for p in problems), problems


def test_flags_overlapping_panels_and_tick_labels_but_not_rotated_neighbours():
    with gradflow_style("single"):
        fig, (a, b) = plt.subplots(1, 2, layout="none")
        fig.subplots_adjust(wspace=0.0)
        b.set_ylabel("the right panel's y label")
        b.set_title("right")
        a.set_title("a left title that runs into the right")
        problems = layout_problems(fig)
        assert any("axis label" in p and "reaches into the area of axes 0" in p for p in problems), problems
        assert any(p.startswith("overlap: title 'a left title") for p in problems), problems
        plt.close(fig)
        fig, ax = plt.subplots(layout="constrained")
        ax.set_xticks(range(8), ["attn.norm"] * 8, rotation=45, ha="right")
        assert layout_problems(fig) == []
        ax.set_xticks(range(8), ["attention norm, layer"] * 8, rotation=0)
        assert any(p.startswith("overlap: tick label") for p in layout_problems(fig))


# ---------------------------------------------------------------------------------------------- inputs

@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[A.Run]:
    root = tmp_path_factory.mktemp("layout")
    return [A.load_run(write_run(root / SHORT[0], num_layers=N_LAYERS, n_sequences=12)),
            A.load_run(write_run(root / SHORT[1], num_layers=N_LAYERS, n_sequences=12, seed=5, loss="all-positions")),
            A.load_run(write_run(root / SHORT[2], num_layers=N_LAYERS, n_sequences=12, seed=6))]


@pytest.fixture(scope="module")
def comparisons(runs) -> dict[str, A.Comparison]:
    return {"short": A.compare_runs(runs, None, n_resamples=50),
            "long": A.compare_runs(runs[:2], LONG[:2], n_resamples=50)}


@pytest.fixture(scope="module")
def run_tables(runs) -> dict[str, pd.DataFrame]:
    run = runs[0]
    return {"profile": A.role_profile(run, n_resamples=50), "ratios": A.role_ratios(run, n_resamples=50),
            "quantiles": A.channel_quantiles(run), "shares": A.sublayer_shares(run),
            "deficit": A.last_block_deficit(run)}


def _layers(n: int = N_LAYERS + 1) -> np.ndarray:
    return np.arange(n)


def diagnostic_tables() -> dict[str, pd.DataFrame]:
    layers, rng = _layers(), np.random.default_rng(0)
    roles = ("context", "masked", "random", "kept", "special", "loss")
    by_role = pd.DataFrame([{"layer": int(k), "role": r} for r in roles for k in layers])
    blocks = layers[1:]
    n = len(by_role)
    return {
        "logit_lens": by_role.assign(top1_original=rng.uniform(0, 1, n)),
        "anisotropy": by_role.assign(mean_pairwise_cosine=rng.uniform(0.1, 0.9, n)),
        "transformation": by_role[by_role["layer"] > 0].assign(
            rel_change_mean=lambda f: rng.uniform(0.2, 1.2, len(f)), rel_change_std=0.1,
            last_block=lambda f: f["layer"] == f["layer"].max()),
        "input_shift": pd.DataFrame({"layer": blocks, "auroc": np.linspace(0.55, 0.99, len(blocks)),
                                     "auroc_ci_low": np.linspace(0.5, 0.97, len(blocks)),
                                     "auroc_ci_high": np.linspace(0.6, 1.0, len(blocks)),
                                     "frechet_distance": np.geomspace(0.5, 400, len(blocks)),
                                     "mean_shift_sq": np.geomspace(0.1, 90, len(blocks))}),
    }


def probe_frame(labels) -> pd.DataFrame:
    rows = []
    for k, label in enumerate(labels[:2]):
        for regime in ("unmasked", "masked"):
            for layer in _layers():
                site = "embeddings.out" if layer == 0 else f"blocks.{layer - 1}.out"
                acc = 0.6 + 0.3 * np.sin(layer / N_LAYERS * 3) - 0.05 * k
                rows.append({"label": label, "regime": regime, "site": site, "depth_fraction": layer / N_LAYERS,
                             "accuracy": acc, "ci_low": acc - 0.03, "ci_high": acc + 0.03,
                             "selectivity": acc - 0.4, "compression": 1 + acc})
    return pd.DataFrame(rows)


SUBLAYER_NAMES = ("attn.q", "attn.k", "attn.v", "attn.out", "attn.norm", "ffn.in", "ffn.gate", "ffn.out", "ffn.norm")


def atlas_frame(labels) -> pd.DataFrame:
    rows = []
    for k, model in enumerate(labels):
        for layer in _layers():
            d = layer / N_LAYERS
            rows.append({"model": model, "depth_fraction": d, "metric": "context_loss_ratio",
                         "value": 0.0 if d == 1 else 0.8 - 0.5 * d, "ci_low": 0.7 - 0.5 * d, "ci_high": 0.9 - 0.5 * d})
            rows.append({"model": model, "depth_fraction": d, "metric": "probe_accuracy:pos",
                         "value": 0.7 + 0.1 * d, "ci_low": 0.65, "ci_high": 0.9})
            if layer:
                for j, s in enumerate(SUBLAYER_NAMES):
                    share = 0.0 if (d == 1 and j % 2 == 0 and k != 1) else 0.3 + 0.04 * j
                    rows.append({"model": model, "depth_fraction": d, "metric": f"context_share:{s}",
                                 "value": share, "ci_low": np.nan, "ci_high": np.nan})
                    rows.append({"model": model, "depth_fraction": d, "metric": f"pressure:{s}",
                                 "value": 0.5 + 0.1 * j, "ci_low": np.nan, "ci_high": np.nan})
        rows.append({"model": model, "depth_fraction": 1.0, "metric": "skippable_flop_share", "value": 0.1 * (k + 1),
                     "ci_low": np.nan, "ci_high": np.nan})
    return pd.DataFrame(rows)


def channel_table(tokens) -> pd.DataFrame:
    sites = [("embeddings.out", 0, "out")] + [(f"blocks.{i}.{p}", i + 1, p) for i in range(N_LAYERS)
                                             for p in ("mid", "out")]
    roles = ["special", *["context"] * (len(tokens) - 2), "special"]
    roles[3] = "masked"
    rows = []
    for site, layer, point in sites:
        for pos, (token, role) in enumerate(zip(tokens, roles)):
            g = 0.0 if (layer == N_LAYERS and role != "masked") else 0.1 * (pos + 1) / (layer + 1)
            rows.append({"site": site, "layer": layer, "point": point, "position": pos, "token": token,
                         "input_token": "[MASK]" if role == "masked" else token, "role": role, "grad_norm": g})
    return pd.DataFrame(rows)


SHORT_TOKENS = ["[CLS]", "the", "cat", "sat", "on", "the", "mat", "[SEP]"]
LONG_TOKENS = ["[CLS]", "the", "considerable", "progress", "of", "public", "credit", "is", "witnessed", "by",
               "extraordinarily", "[SEP]"]


# ---------------------------------------------------------------------------------------------- figures

RUN_FIGURES = {
    "depth_profile": lambda t, w, title: F.depth_profile(t["profile"], width=w, title=title),
    "ratio_heatmap": lambda t, w, title: F.ratio_heatmap(t["ratios"], width=w, title=title),
    "distribution_ranges": lambda t, w, title: F.distribution_ranges(t["quantiles"], width=w, title=title),
    "last_block_bars": lambda t, w, title: F.last_block_bars(t["deficit"], width=w, title=title),
    "sublayer_heatmap": lambda t, w, title: F.sublayer_heatmap(t["shares"], "share", width=w, title=title),
}
COMPARISON_FIGURES = {
    "comparison_profiles": lambda c, w: F.comparison_profiles(c.profiles, c.labels, width=w),
    "comparison_ratios": lambda c, w: F.comparison_ratios(c, width=w),
    "comparison_last_block": lambda c, w: F.comparison_last_block(c, width=w),
}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", sorted(RUN_FIGURES))
@pytest.mark.parametrize("title", [None, "mini-en-alltoken (all-positions loss)"])
def test_run_figures(run_tables, name, width, title):
    with gradflow_style(width):
        assert_clean_layout(_figure(RUN_FIGURES[name](run_tables, width, title)), f"{name} at {width}")


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", sorted(COMPARISON_FIGURES))
@pytest.mark.parametrize("labels", sorted(LABELS))
def test_comparison_figures(comparisons, name, width, labels):
    with gradflow_style(width):
        assert_clean_layout(_figure(COMPARISON_FIGURES[name](comparisons[labels], width)),
                            f"{name} at {width}, {labels} labels")


def pressure_tables(labels) -> dict[str, pd.DataFrame]:
    """label -> a context_pressure-like table: every block's pressure per sublayer, the last one lower."""
    tables = {}
    for k, label in enumerate(labels[:2]):
        rows = []
        for layer in range(1, N_LAYERS + 1):
            for j, sub in enumerate(SUBLAYER_NAMES):
                p = (1 + k) * (0.5 + 0.1 * j) * (0.3 if layer == N_LAYERS else 1.0)
                rows.append({"layer": layer, "sublayer": sub, "last_block": layer == N_LAYERS, "pressure": p,
                             "ci_low": 0.8 * p, "ci_high": 1.2 * p, "earlier_mean": (1 + k) * (0.5 + 0.1 * j)})
        tables[label] = pd.DataFrame(rows)
    return tables


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("labels", sorted(LABELS))
@pytest.mark.parametrize("title", [None, "Context pressure on the last block, all-positions loss"])
def test_pressure_figure(width, labels, title):
    with gradflow_style(width):
        fig = _figure(pressure_bars(pressure_tables(LABELS[labels]), width=width, title=title))
        assert_clean_layout(fig, f"pressure at {width}, {labels} labels, title {title!r}")


@pytest.mark.parametrize("width", WIDTHS)
def test_incomplete_banner_fits(comparisons, width):
    banner = f"INCOMPLETE RUN ({', '.join(LONG[:2])}): partial data, not for publication"
    with gradflow_style(width):
        fig = _figure(F.comparison_ratios(comparisons["long"], width=width))
        add_banner(fig, banner)
        assert_clean_layout(fig, f"banner at {width}")


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", sorted(D.FIGURES))
def test_diagnostics_figures(name, width):
    table, plot = D.FIGURES[name]
    with gradflow_style(width):
        assert_clean_layout(_figure(plot(diagnostic_tables()[table], width=width)), f"{name} at {width}")


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("labels", sorted(LABELS))
def test_probe_figure(width, labels):
    with gradflow_style(width):
        fig = _figure(probe_panels(probe_frame(LABELS[labels]), width=width, title="linear probes: pos"))
        assert_clean_layout(fig, f"probes at {width}, {labels} labels")


ATLAS_FIGURES = {
    "context_ratio": lambda f, m, w: atlas_figures.depth_lines(f, "context_loss_ratio", "context / loss gradient norm",
                                                               "context vs loss positions", m, w),
    "probes": lambda f, m, w: atlas_figures.depth_lines(f, "probe_accuracy:pos", "probe test accuracy",
                                                        "linear probes: pos", m, w),
    "last_block_shares": lambda f, m, w: atlas_figures.last_block_bars(
        f, "context_share", "context share (last block)", "last block's context share; tick: earlier blocks", m, w),
    "pressure": lambda f, m, w: atlas_figures.last_block_bars(
        f, "pressure", "context pressure (last block)", "all-positions loss; tick: earlier blocks", m, w),
    "skippable": lambda f, m, w: atlas_figures.skippable_bars(f, m, w),
}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", sorted(ATLAS_FIGURES))
@pytest.mark.parametrize("labels", sorted(LABELS))
def test_atlas_figures(name, width, labels):
    frame = atlas_frame(LABELS[labels])
    with gradflow_style(width):
        fig = ATLAS_FIGURES[name](frame, list(LABELS[labels]), width)
        assert_clean_layout(fig, f"atlas {name} at {width}, {labels} labels")


@pytest.mark.parametrize("tokens", [SHORT_TOKENS, LONG_TOKENS], ids=["short", "long"])
@pytest.mark.parametrize("title", [None, "mini-en (MLM loss, 6 blocks): the cat sat on the mat"])
def test_channel_view_figure(tokens, title):
    fig = _figure(plot_channel_view(channel_table(tokens), title=title))
    assert_clean_layout(fig, "channel view")


def test_signed_channel_view_saves_with_its_layout_intact(tmp_path):
    """The attribution view (signed, symlog colour bar) once collapsed when the saved layout was settled by
    repeated draws: saving warns of nothing, keeps every panel, and the 0 tick stands alone."""
    import warnings

    from gradflow.figures.canvas import save_figure

    table = channel_table(LONG_TOKENS)
    signs = np.where(table["position"] % 2 == 0, 1.0, -1.0)
    table["attribution_sum"] = table["grad_norm"] * signs * 10.0 ** -(table["position"] % 4)
    drawn = plot_channel_view(table, "attribution_sum", title="attribution")
    fig = drawn[0].axes.figure
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_figure(fig, tmp_path / "view", formats=("png",))
    assert_clean_layout(fig, "signed channel view after saving")
    colorbar = next(a for a in fig.axes if a.get_gid() == "colorbar")
    ticks = [t for t in colorbar.get_yticks() if colorbar.get_ylim()[0] <= t <= colorbar.get_ylim()[1]]
    linear_band = drawn[0].norm.linthresh
    assert 0.0 in ticks and min(abs(t) for t in ticks if t) > linear_band  # no tick label overprints 0
