"""The gradient flow by masking ratio (masked diffusion): its figure and its ``summary.md`` section.

Draws the table of :func:`gradflow.analysis.ratio_by_mask_ratio`: the context / loss gradient-norm
ratio (y) against the masking ratio t (x), one line per depth, coloured by layer on a sequential
colour-blind-safe map (Paul Tol's YlOrBr, light = shallow, dark = deep, keyed by a colour bar), with
95% bootstrap bands. The y axis is linear from 0, so a structural zero (the last block's output: the
head is position-wise) sits on y = 0 as a triangle named "exactly 0" in the legend, never as a
small number. Reports include both for a run with ``mask_ratios.parquet`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from gradflow.analysis.mask_ratio import ratio_by_mask_ratio
from gradflow.analysis.run_data import Run
from gradflow.figures.canvas import add_colorbar, floor_marker_shifts, log_floor_markers, new_axes, zero_proxy
from gradflow.figures.fitting import legend_above, title_above_legend
from gradflow.figures.report_tables import mask_ratio_table, t_label
from gradflow.figures.style import sequential_cmap, styled
from gradflow.figures.tables import TextTable, latex_label, markdown_table
from gradflow.formatting import format_estimate, format_number
from gradflow.schema import MASK_RATIOS_FILE

MASK_RATIO_FIGURE = "ratio_by_mask_ratio"
"""Stem of the figure in a report."""
MASK_RATIO_TABLE = "mask_ratio_profile"
"""Name of the table (``tables/mask_ratio_profile.csv``, :data:`gradflow.schema.REPORT_TABLES`) in a report."""
LIGHTEST = 0.35
"""Where on the sequential map the shallowest layer sits (below it the yellows fade into white)."""


def mask_ratio_tables(run: Run, n_resamples: int = 2000, seed: int | None = 0) -> dict[str, pd.DataFrame]:
    """``{"mask_ratio_profile": ratio_by_mask_ratio(run)}`` for a run with ``mask_ratios.parquet``, else empty."""
    if run.mask_ratios is None:
        return {}
    return {MASK_RATIO_TABLE: ratio_by_mask_ratio(run, n_resamples=n_resamples, seed=seed)}


def layer_colors(layers: Sequence[int]) -> dict[int, tuple[float, float, float, float]]:
    """Layer -> its colour: evenly spaced on Paul Tol's YlOrBr from :data:`LIGHTEST` (shallowest) to the darkest."""
    ordered = sorted(int(x) for x in set(layers))
    cmap = sequential_cmap()
    spots = np.linspace(LIGHTEST, 1.0, len(ordered)) if len(ordered) > 1 else np.array([1.0])
    return {layer: cmap(float(s)) for layer, s in zip(ordered, spots)}


@styled
def mask_ratio_lines(table: pd.DataFrame, ax: Axes | None = None, ci: bool = True, legend: bool = True,
                     colorbar: bool = True, width: str | float = "single", title: str | None = None) -> list[Artist]:
    """Context / loss gradient-norm ratio against the masking ratio t, one line per layer, linear y from 0.

    ``table``: the :func:`gradflow.analysis.ratio_by_mask_ratio` table; each bin is drawn at ``t_mid``.
    Lines (gid ``ratio:<layer>``) join the non-zero ratios, bands (``band:<layer>``) are their 95% CIs;
    exact zeros (``exact_zero``) are triangles on y = 0 in the layer's colour (``zeros:<layer>``, side by
    side where several layers are zero at one t), and the dashed line at 1 (``reference``) is a context
    position getting as much gradient as a loss position. Returns those artists, the legend (exactly 0,
    95% CI, reference) and the colour bar's axes (``colorbar``: the layers).
    """
    ax = new_axes(ax, width, 0.74)
    layers = sorted(int(x) for x in table["layer"].unique())
    colors = layer_colors(layers)
    zero_x = {layer: table.loc[(table["layer"] == layer) & table["exact_zero"], "t_mid"].to_numpy(float)
              for layer in layers}
    shifts = floor_marker_shifts({k: v for k, v in zero_x.items() if v.size})
    drawn: list[Artist] = []
    for layer in layers:
        d = table[table["layer"] == layer].sort_values("t_mid")
        x, y = d["t_mid"].to_numpy(float), d["ratio"].to_numpy(float)
        zero = d["exact_zero"].to_numpy(bool)
        color = colors[layer]
        (line,) = ax.plot(x, np.where(zero, np.nan, y), color=color, marker="o", markersize=2.4, linewidth=1.0,
                          gid=f"ratio:{layer}", zorder=3 + layer / (len(layers) + 1))
        drawn.append(line)
        if ci:
            lo, hi = (np.where(zero, np.nan, d[c].to_numpy(float)) for c in ("ci_low", "ci_high"))
            drawn.append(ax.fill_between(x, lo, hi, color=color, alpha=0.22, linewidth=0, gid=f"band:{layer}",
                                         zorder=2))
        for shift in np.unique(shifts.get(layer, [])):
            at = zero_x[layer][shifts[layer] == shift]
            drawn.append(log_floor_markers(ax, at, color, f"zeros:{layer}", float(shift)))
    drawn.append(ax.axhline(1.0, color="#777777", linestyle="--", linewidth=0.6, zorder=1, gid="reference"))
    _axes(ax, table)
    handles: list[Artist] = []
    if any(v.size for v in zero_x.values()):
        handles.append(zero_proxy())
    if ci:
        handles.append(Patch(facecolor="#999999", alpha=0.35, linewidth=0, label="95% CI"))
    handles.append(Line2D([], [], color="#777777", linestyle="--", linewidth=0.6, label="context = loss"))
    if colorbar:
        drawn.append(_layer_colorbar(ax, layers, colors))
    shown = legend_above(ax, handles) if legend else None
    if title:
        title_above_legend(ax, title, shown)
    return drawn + ([shown] if shown is not None else [])


def _axes(ax: Axes, table: pd.DataFrame) -> None:
    """t from 0 to 1 (ticked at a grid's values when there are few), the ratio from exactly 0, labels."""
    grid = bool(len(table)) and bool((table["t_low"] == table["t_high"]).all())
    ts = np.unique(table["t_mid"].to_numpy(float))
    if grid and ts.size <= 6:
        ax.set_xticks(ts, [format_number(t) for t in ts])
    else:
        ax.set_xticks(np.linspace(0.0, 1.0, 6), ["0", "0.2", "0.4", "0.6", "0.8", "1"])
    ax.set_xlim(0.0, 1.0)
    top = np.nanmax(np.concatenate([table["ratio"].to_numpy(float), table["ci_high"].to_numpy(float), [1.0]]))
    ax.set_ylim(0.0, float(top) * 1.06)
    ax.set_xlabel("masking ratio t (fraction of tokens masked)")
    ax.set_ylabel("context / loss\ngradient-norm ratio")


def _layer_colorbar(ax: Axes, layers: list[int], colors: dict[int, tuple[float, float, float, float]]) -> Axes:
    """A discrete colour bar of the layers beside ``ax`` (integer ticks, thinned when many); returns its axes."""
    bounds = np.arange(len(layers) + 1) - 0.5
    mappable = ScalarMappable(BoundaryNorm(bounds, len(layers)), ListedColormap([colors[k] for k in layers]))
    cbar = add_colorbar(ax, mappable, "layer (0 = embeddings)")  # type: ignore[arg-type]
    cbar.ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(len(layers), 8)))
    cbar.ax.yaxis.set_major_formatter(lambda v, _: str(layers[int(v)]) if 0 <= int(v) < len(layers) else "")
    cbar.ax.minorticks_off()
    return cbar.ax


__all__ = ["LIGHTEST", "MASK_RATIO_FIGURE", "MASK_RATIO_TABLE", "layer_colors", "mask_ratio_lines",
           "mask_ratio_tables"]
