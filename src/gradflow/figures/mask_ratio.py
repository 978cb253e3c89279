"""The gradient flow by masking ratio (masked diffusion): its figure.

Draws the table of :func:`gradflow.analysis.ratio_by_mask_ratio` against the masking ratio t (x), one line per
depth, coloured by layer on a sequential colour-blind-safe map (Paul Tol's YlOrBr, light = shallow, dark = deep,
keyed by a colour bar), with 95% bootstrap bands, in four panels (:func:`mask_ratio_panels`, the report's
figure): (a) the mean gradient norm of a clean position, (b) of a loss position, (c) their ratio, (d) the clean
positions' share of the gradient. A ratio alone invites the reading "clean positions get more signal at high
t"; beside its numerator (about flat in t) and its denominator (falling like 1/t) it cannot be read so. Every
y axis is log, so a structural zero (the last block's output: the head is position-wise) is a triangle on the
axis floor named "exactly 0" in the legend, and the floor sits a factor :data:`FLOOR_ROOM` below every drawn
value: a small ratio of the block before the last never hides under those triangles. Reports draw it for a
run with ``mask_ratios.parquet`` only; the summary section and LaTeX table are :mod:`.mask_ratio_text`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib as mpl
import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from gradflow.analysis.mask_ratio import MaskRatioSelection, ratio_by_mask_ratio
from gradflow.analysis.run_data import Run
from gradflow.figures.canvas import (
    add_colorbar,
    floor_marker_shifts,
    log_floor_markers,
    log_format,
    new_axes,
    panel_grid,
    zero_proxy,
)
from gradflow.figures.fitting import fitted_legend, legend_above, title_above_legend, wrap_text, wrap_title
from gradflow.figures.style import sequential_cmap, styled
from gradflow.formatting import format_number

MASK_RATIO_FIGURE = "ratio_by_mask_ratio"
"""Stem of the figure in a report."""
MASK_RATIO_TABLE = "mask_ratio_profile"
"""Name of the table (``tables/mask_ratio_profile.csv``, :data:`gradflow.schema.REPORT_TABLES`) in a report."""
LIGHTEST = 0.35
"""Where on the sequential map the shallowest layer sits (below it the yellows fade into white)."""


def mask_ratio_tables(run: Run, n_resamples: int = 2000, seed: int | None = 0,
                      selection: MaskRatioSelection | None = None) -> dict[str, pd.DataFrame]:
    """``{"mask_ratio_profile": ratio_by_mask_ratio(run)}`` for a run with ``mask_ratios.parquet``, else empty
    (``selection``: the run's :func:`gradflow.analysis.mask_ratio.mask_ratio_selection`, when the caller has it)."""
    if run.mask_ratios is None:
        return {}
    return {MASK_RATIO_TABLE: ratio_by_mask_ratio(run, n_resamples=n_resamples, seed=seed, selection=selection)}


def layer_colors(layers: Sequence[int]) -> dict[int, tuple[float, float, float, float]]:
    """Layer -> its colour: evenly spaced on Paul Tol's YlOrBr from :data:`LIGHTEST` (shallowest) to the darkest."""
    ordered = sorted(int(x) for x in set(layers))
    cmap = sequential_cmap()
    spots = np.linspace(LIGHTEST, 1.0, len(ordered)) if len(ordered) > 1 else np.array([1.0])
    return {layer: cmap(float(s)) for layer, s in zip(ordered, spots)}


@dataclass(frozen=True)
class Panel:
    """One quantity of the :func:`gradflow.analysis.ratio_by_mask_ratio` table drawn against t."""

    value: str
    low: str
    high: str
    title: str
    ylabel: str


RATIO_PANEL = Panel("ratio", "ci_low", "ci_high", "(c) ratio a / b", "context / loss")
PANELS: tuple[Panel, ...] = (
    Panel("context_mean", "context_ci_low", "context_ci_high", "(a) a clean position", "mean gradient norm"),
    Panel("loss_mean", "loss_ci_low", "loss_ci_high", "(b) a loss position", ""),
    RATIO_PANEL,
    Panel("context_share", "share_ci_low", "share_ci_high", "(d) clean share", "share of the gradient"),
)
"""The four panels of the report's figure, in reading order: numerator, denominator, their ratio, and the share of
the gradient that lands on clean positions."""
T_LABEL = "masking ratio t (fraction of tokens masked)"
FLOOR_ROOM = 2.0
"""The log axes reach this factor below the smallest positive value drawn, so the exact-zero triangles on the floor
never sit on a line."""


@styled
def mask_ratio_panels(table: pd.DataFrame, axes: Sequence[Axes] | None = None, ci: bool = True,
                      colorbar: bool = True, width: str | float = "single", title: str | None = None) -> list[Artist]:
    """The gradient flow against the masking ratio t in four log panels (:data:`PANELS`), one line per layer.

    ``table``: the :func:`gradflow.analysis.ratio_by_mask_ratio` table (its mean and share columns included).
    (a) the mean gradient norm of a clean (context) position, (b) of a loss position, on one shared y range, so the
    eye compares the numerator with the denominator; (c) their ratio, with the dashed reference at 1; (d) the clean
    positions' share of the summed gradient norms. Lines (gid ``<value>:<layer>``), 95% bands (``band:<value>:
    <layer>``), exact zeros as triangles on the axis floor (``zeros:<value>:<layer>``), below every drawn value.
    ``axes``: four axes to draw on (else a new 2 x 2 figure of ``width``). Returns the artists, the colour bar's
    axes and the figure legend (exactly 0, 95% CI, context = loss) above the panels, headed by ``title``.
    """
    missing = [c for p in PANELS for c in (p.value, p.low, p.high) if c not in table.columns]
    if missing:
        raise ValueError(f"the table lacks {', '.join(sorted(set(missing)))}: draw a table of "
                         "gradflow.analysis.ratio_by_mask_ratio from this gradflow version (regenerate the report).")
    axs, _ = panel_grid(len(PANELS), axes, width, 0.78, 2, sharey=False)
    layers = sorted(int(x) for x in table["layer"].unique())
    colors = layer_colors(layers)
    drawn: list[Artist] = []
    for ax, panel in zip(axs, PANELS):
        drawn += _layer_lines(ax, table, panel, colors, ci)
        if panel is RATIO_PANEL:
            drawn.append(ax.axhline(1.0, color="#777777", linestyle="--", linewidth=0.6, zorder=1, gid="reference"))
        wrap_title(ax, panel.title, loc="left")
        ax.set_ylabel(panel.ylabel)
    _log_limits(axs[:2], table, PANELS[:2])  # the numerator and the denominator on one range
    for ax, panel in zip(axs[2:], PANELS[2:]):
        _log_limits([ax], table, [panel], reference=1.0 if panel is RATIO_PANEL else None)
    for ax in axs:
        _t_axis(ax, table, label=False)
    fig = axs[0].figure
    if axes is None:
        fig.supxlabel(T_LABEL, fontsize=mpl.rcParams["axes.labelsize"])
    if colorbar:
        drawn.append(_layer_colorbar(axs, layers, colors))
    handles = _legend_handles(table, ci, "context = loss (c)")
    room = fig.get_figwidth() * 72.0 - 8.0
    # a title heads the legend above the panels (a suptitle and an outside legend would share the top edge)
    heading = {"title": wrap_text(title, room, mpl.rcParams["figure.titlesize"]),
               "title_fontproperties": {"size": mpl.rcParams["figure.titlesize"]}} if title else {}
    drawn.append(fitted_legend(fig, handles, room, loc="outside upper center", frameon=False, **heading))
    return drawn


@styled
def mask_ratio_lines(table: pd.DataFrame, ax: Axes | None = None, ci: bool = True, legend: bool = True,
                     colorbar: bool = True, width: str | float = "single", title: str | None = None) -> list[Artist]:
    """The ratio panel alone: context / loss gradient-norm ratio against t, one line per layer, log y.

    Read it beside its numerator and denominator (:func:`mask_ratio_panels`, the report's figure): the ratio rises
    with t because a loss position's gradient falls, not because a clean position's grows. Lines (gid
    ``ratio:<layer>``), bands (``band:ratio:<layer>``), exact zeros as triangles on the axis floor
    (``zeros:ratio:<layer>``), the dashed reference at 1 (``reference``). Returns those artists, the legend
    (exactly 0, 95% CI, reference) and the colour bar's axes (``colorbar``: the layers).
    """
    ax = new_axes(ax, width, 0.74)
    layers = sorted(int(x) for x in table["layer"].unique())
    colors = layer_colors(layers)
    drawn = _layer_lines(ax, table, RATIO_PANEL, colors, ci)
    drawn.append(ax.axhline(1.0, color="#777777", linestyle="--", linewidth=0.6, zorder=1, gid="reference"))
    _log_limits([ax], table, [RATIO_PANEL], reference=1.0)
    _t_axis(ax, table, label=True)
    ax.set_ylabel("context / loss\ngradient-norm ratio")
    handles = _legend_handles(table, ci, "context = loss")
    if colorbar:
        drawn.append(_layer_colorbar([ax], layers, colors))
    shown = legend_above(ax, handles) if legend else None
    if title:
        title_above_legend(ax, title, shown)
    return drawn + ([shown] if shown is not None else [])


def _legend_handles(table: pd.DataFrame, ci: bool, reference: str) -> list[Artist]:
    """Legend entries: "exactly 0" when the table has an exact zero, "95% CI" with the bands, the reference line."""
    handles: list[Artist] = [zero_proxy()] if bool(table["exact_zero"].any()) else []
    if ci:
        handles.append(Patch(facecolor="#999999", alpha=0.35, linewidth=0, label="95% CI"))
    return handles + [Line2D([], [], color="#777777", linestyle="--", linewidth=0.6, label=reference)]


def _layer_lines(ax: Axes, table: pd.DataFrame, panel: Panel, colors: dict[int, tuple[float, float, float, float]],
                 ci: bool) -> list[Artist]:
    """One line per layer of ``panel.value`` against ``t_mid`` (its band when ``ci``), exact zeros on the floor."""
    ax.set_yscale("log")
    layers = sorted(colors)
    zero_x = {layer: table.loc[(table["layer"] == layer) & (table[panel.value] == 0.0), "t_mid"].to_numpy(float)
              for layer in layers}
    shifts = floor_marker_shifts({k: v for k, v in zero_x.items() if v.size})
    drawn: list[Artist] = []
    for layer in layers:
        d = table[table["layer"] == layer].sort_values("t_mid")
        x, y = d["t_mid"].to_numpy(float), d[panel.value].to_numpy(float)
        zero = y == 0.0
        (line,) = ax.plot(x, np.where(zero, np.nan, y), color=colors[layer], marker="o", markersize=2.2,
                          linewidth=0.9, gid=f"{panel.value}:{layer}", zorder=3 + layer / (len(layers) + 1))
        drawn.append(line)
        if ci:
            lo, hi = (np.where(zero, np.nan, d[c].to_numpy(float)) for c in (panel.low, panel.high))
            drawn.append(ax.fill_between(x, lo, hi, color=colors[layer], alpha=0.22, linewidth=0,
                                         gid=f"band:{panel.value}:{layer}", zorder=2))
        for shift in np.unique(shifts.get(layer, [])):
            at = zero_x[layer][shifts[layer] == shift]
            drawn.append(log_floor_markers(ax, at, colors[layer], f"zeros:{panel.value}:{layer}", float(shift)))
    return drawn


def _log_limits(axs: Sequence[Axes], table: pd.DataFrame, panels: Sequence[Panel],
                reference: float | None = None) -> None:
    """One log y range for ``axs``: every positive value and interval end of ``panels`` (and ``reference``), the
    floor :data:`FLOOR_ROOM` below the smallest; plain tick labels."""
    values = np.concatenate([table[c].to_numpy(float) for p in panels for c in (p.value, p.low, p.high)]
                            + ([np.array([reference])] if reference is not None else []))
    positive = values[np.isfinite(values) & (values > 0)]
    if not positive.size:
        return
    low, high = float(positive.min()) / FLOOR_ROOM, float(positive.max()) * 1.3
    for ax in axs:
        ax.set_ylim(low, high)
        log_format(ax)


def _t_axis(ax: Axes, table: pd.DataFrame, label: bool) -> None:
    """t from 0 to 1 (ticked at a grid's values when there are few), labelled when ``label``."""
    grid = bool(len(table)) and bool((table["t_low"] == table["t_high"]).all())
    ts = np.unique(table["t_mid"].to_numpy(float))
    if grid and ts.size <= 6:
        ax.set_xticks(ts, [format_number(t) for t in ts])
    else:
        ax.set_xticks(np.linspace(0.0, 1.0, 6), ["0", "0.2", "0.4", "0.6", "0.8", "1"])
    ax.set_xlim(0.0, 1.0)
    if label:
        ax.set_xlabel(T_LABEL)


def _layer_colorbar(axs: Sequence[Axes], layers: list[int],
                    colors: dict[int, tuple[float, float, float, float]]) -> Axes:
    """A discrete colour bar of the layers beside ``axs`` (integer ticks, thinned when many); returns its axes."""
    bounds = np.arange(len(layers) + 1) - 0.5
    mappable = ScalarMappable(BoundaryNorm(bounds, len(layers)), ListedColormap([colors[k] for k in layers]))
    cbar = add_colorbar(axs[0] if len(axs) == 1 else axs, mappable, "layer (0 = embeddings)")
    cbar.ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(len(layers), 8)))
    cbar.ax.yaxis.set_major_formatter(lambda v, _: str(layers[int(v)]) if 0 <= int(v) < len(layers) else "")
    cbar.ax.minorticks_off()
    return cbar.ax


__all__ = ["FLOOR_ROOM", "LIGHTEST", "MASK_RATIO_FIGURE", "MASK_RATIO_TABLE", "PANELS", "RATIO_PANEL", "Panel",
           "layer_colors", "mask_ratio_lines", "mask_ratio_panels", "mask_ratio_tables"]
