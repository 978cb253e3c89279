"""Probe figures: score against normalised depth, one line per model (``gradflow probe``, ``compare``).

Three panels share the x axis (depth fraction: 0 = embeddings, 1 = last block's output):
test accuracy with its 95% sentence-bootstrap band, selectivity (accuracy minus the control
task's), and the online-code compression (uniform bits / online bits; higher = labels cheaper to
transmit given the features). Colours are models (Paul Tol's bright palette); solid lines the
unmasked regime, dashed the masked one. One figure per task: ``probes_<task>.pdf/.png``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.lines import Line2D

from gradflow.analysis.probe_tables import load_probe_dirs
from gradflow.figures.canvas import add_banner, save_figure
from gradflow.figures.fitting import axes_width_pt, fitted_legend, wrap_text
from gradflow.figures.style import DEFAULT_WIDTH, RUN_MARKERS, figure_width, gradflow_style, series_color, styled

PANELS: tuple[tuple[str, str], ...] = (("accuracy", "test accuracy"), ("selectivity", "selectivity"),
                                       ("compression", "code compression"))
REGIME_STYLES = {"unmasked": "-", "masked": "--"}
DEPTH_LABEL = "depth (0 = embeddings, 1 = last block)"


@styled
def probe_panels(frame: pd.DataFrame, axes: Sequence[Axes] | None = None, width: str | float = "single",
                 title: str | None = None) -> list[Artist]:
    """Draw one task's probe rows (``label``, ``regime``, ``site``, ``depth_fraction`` and the panel
    columns; ``mid`` sites are left out) into three stacked panels; returns the lines, bands, legend."""
    frame = frame[~frame["site"].str.endswith(".mid")]
    panels = [p for p in PANELS if frame[p[0]].notna().any()]
    if axes is None:  # stacked at column width, side by side at page width
        w = figure_width(width)
        wide = w >= 6
        rows, cols = (1, len(panels)) if wide else (len(panels), 1)
        height = (0.62 * w / cols + 0.5) if wide else (0.42 * w * rows + 0.5)
        _, grid = plt.subplots(rows, cols, figsize=(w, height), sharex=True, layout="constrained", squeeze=False)
        axes = list(grid.ravel())
        bottom = list(grid[-1])
    else:
        bottom = [axes[-1]]
    drawn: list[Artist] = []
    labels = list(dict.fromkeys(frame["label"]))
    regimes = [r for r in REGIME_STYLES if r in set(frame["regime"])]
    for ax, (column, ylabel) in zip(axes, panels):
        for k, label in enumerate(labels):
            for regime in regimes:
                d = frame[(frame["label"] == label) & (frame["regime"] == regime)].sort_values("depth_fraction")
                if d.empty:
                    continue
                x = d["depth_fraction"].to_numpy(dtype=float)
                # earlier models drawn wider with bigger markers, so identical layers (a repaired model's
                # frozen blocks) stay visible under the later ones
                (line,) = ax.plot(x, d[column].to_numpy(dtype=float), color=series_color(k),
                                  linestyle=REGIME_STYLES[regime], marker=RUN_MARKERS[k % len(RUN_MARKERS)],
                                  markersize=max(3.5 - 0.75 * k, 1.8), linewidth=max(1.6 - 0.4 * k, 0.8),
                                  gid=f"probe:{label}:{regime}:{column}")
                drawn.append(line)
                if column == "accuracy":
                    drawn.append(ax.fill_between(x, d["ci_low"].to_numpy(dtype=float), d["ci_high"].to_numpy(dtype=float),
                                                 color=series_color(k), alpha=0.2, linewidth=0,
                                                 gid=f"band:{label}:{regime}"))
        ax.axvline(1.0, color="0.5", linewidth=0.6, linestyle=":", zorder=0)
        ax.set_ylabel(ylabel)
    for ax in bottom:
        ax.set_xticks(np.linspace(0, 1, 5))
    if len(bottom) > 1:  # side by side: one label under all panels
        fig = bottom[0].figure
        fig.supxlabel(DEPTH_LABEL, fontsize=mpl.rcParams["axes.labelsize"])
    else:
        bottom[0].set_xlabel(DEPTH_LABEL)
    handles = [Line2D([], [], color=series_color(k), marker=RUN_MARKERS[k % len(RUN_MARKERS)], markersize=3.5,
                      label=label) for k, label in enumerate(labels)]
    if len(regimes) > 1:
        handles += [Line2D([], [], color="0.3", linestyle=REGIME_STYLES[r], label=r) for r in regimes]
    fig = axes[0].figure
    legend = fitted_legend(fig, handles, fig.get_figwidth() * 72.0 - 8.0, 5, loc="outside upper center",
                           frameon=False)
    if title:
        axes[0].set_title(wrap_text(title, axes_width_pt(axes[0]), mpl.rcParams["font.size"]), loc="left",
                          fontsize="medium")
    return [*drawn, legend]


PROBE_FAMILY_WORDS = {"logistic": "linear probes", "mlp": "MLP probes"}


def probe_family_words(families: Sequence[str]) -> str:
    """The figure title's name for probes of ``families`` (one per directory): ``"linear probes"``,
    ``"MLP probes"``, or ``"probes (linear, MLP)"`` for a mix."""
    names = sorted({PROBE_FAMILY_WORDS.get(f, f"{f} probes") for f in families or ("logistic",)})
    if len(names) == 1:
        return names[0]
    return "probes (" + ", ".join(n.removesuffix(" probes") for n in names) + ")"


def write_probe_figures(probe_dirs: Sequence[str | Path], labels: Sequence[str] | None, out_dir: str | Path,
                        formats: Sequence[str] = ("pdf", "png"), width: str | float = DEFAULT_WIDTH) -> list[Path]:
    """One figure per task across ``probe_dirs`` (``probes_<task>.<fmt>``), plus ``probes.csv`` and
    ``probe_drops.csv`` of all of them (with a ``label`` column) when there are several; returns the paths."""
    tables = load_probe_dirs(probe_dirs, labels)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for task, frame in tables.probes.groupby("task", sort=True):
        with gradflow_style(width):
            artists = probe_panels(frame, width=width, title=f"{probe_family_words(tables.families)}: {task}")
            fig = artists[0].figure
            if tables.incomplete:
                add_banner(fig, f"incomplete: {', '.join(tables.incomplete)}")
            paths += save_figure(fig, out / f"probes_{task}", formats)
            plt.close(fig)
    if len(probe_dirs) > 1:
        tables.probes.to_csv(out / "probes_compared.csv", index=False, float_format="%.10g")
        tables.drops.to_csv(out / "probe_drops_compared.csv", index=False, float_format="%.10g")
        paths += [out / "probes_compared.csv", out / "probe_drops_compared.csv"]
    return paths


__all__ = ["probe_family_words", "probe_panels", "write_probe_figures"]
