"""Figures of one run's sublayers: the layer x sublayer heat map and the last-block bars.

Sublayers are drawn in the standard order of :mod:`gradflow.schema`; plot conventions are
those of :mod:`gradflow.figures.canvas`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.colors import Normalize

from gradflow.figures.canvas import HeatmapSpec, add_colorbar, draw_heatmap, layer_grid, new_axes, sublayer_ticklabel
from gradflow.figures.fitting import legend_above, title_above_legend, wrap_title
from gradflow.figures.style import lighten, role_color, sequential_cmap, styled
from gradflow.schema import sorted_sublayers


@styled
def sublayer_heatmap(shares: pd.DataFrame, value: str = "coverage", role: str = "context", ax: Axes | None = None,
                     annotate: bool | None = None, colorbar: bool = True, width: str | float = "single",
                     title: str | None = None) -> list[Artist]:
    """Layer x sublayer heat map of a role's ``coverage`` or ``share`` (both in [0, 1]).

    ``shares``: the :func:`gradflow.analysis.sublayer_shares` (or ``context_share``) table.
    Exact zeros are hatched grey cells. Returns the mesh (gid ``sublayers``), zero patches, labels
    and the colour bar's axes (``colorbar``).
    """
    ax = new_axes(ax, width, 0.62)
    d = shares[shares["role"] == role]
    subs = sorted_sublayers(d["sublayer"].unique())
    x, values = layer_grid(d, "sublayer", subs, value)
    spec = HeatmapSpec(x, subs, subs, values, values, sequential_cmap(), Normalize(0.0, 1.0), "sublayers",
                       "layer (block)")
    mesh, drawn = draw_heatmap(ax, spec, annotate)
    if title:
        wrap_title(ax, title)
    if colorbar:
        drawn.append(add_colorbar(ax, mesh, f"{role} {value}").ax)
    return drawn


@styled
def last_block_bars(deficit: pd.DataFrame, ax: Axes | None = None, legend: bool = True,
                    width: str | float = "single", title: str | None = None) -> list[Artist]:
    """Per sublayer: the role's share in the last block next to the earlier blocks' mean.

    ``deficit``: the :func:`gradflow.analysis.last_block_deficit` table. The earlier-block bar
    carries a min-max range; exact zeros in the last block are labelled "0". Returns the bars
    (gid ``last`` / ``earlier``), the range lines, the zero labels and the legend.
    """
    ax = new_axes(ax, width, 0.62)
    role = str(deficit["role"].iloc[0]) if len(deficit) else "context"
    layer = int(deficit["layer"].iloc[0]) if len(deficit) else 0
    x = np.arange(len(deficit))
    w = 0.38
    color = role_color(role)
    earlier = ax.bar(x - w / 2, deficit["earlier_mean"], w, color=lighten(color, 0.6), edgecolor=color,
                     linewidth=0.5, label=f"blocks 1–{layer - 1} (mean, range)", gid="earlier")
    last = ax.bar(x + w / 2, deficit["share"], w, color=color, label=f"last block ({layer})", gid="last")
    lo = (deficit["earlier_mean"] - deficit["earlier_min"]).clip(lower=0).fillna(0)
    hi = (deficit["earlier_max"] - deficit["earlier_mean"]).clip(lower=0).fillna(0)
    err = ax.vlines(x - w / 2, deficit["earlier_mean"] - lo, deficit["earlier_mean"] + hi, color="#333333",
                    linewidth=0.6, gid="range")
    drawn: list[Artist] = [*earlier.patches, *last.patches, err]
    top = float(np.nanmax(np.r_[deficit["share"], deficit["earlier_max"], 0.05]))
    for xi, v in zip(x, deficit["share"]):
        if v == 0:
            drawn.append(ax.text(xi + w / 2, top * 0.015, "0", ha="center", va="bottom", fontsize=6.5, color=color,
                                 fontweight="bold", gid="last:zero"))
    ax.set_xticks(x, [sublayer_ticklabel(s) for s in deficit["sublayer"]])
    ax.tick_params(axis="x", length=0)
    ax.set_ylim(0, min(1.0, top * 1.12) if top > 0 else 1.0)
    ax.set_xlim(-0.6, len(x) - 0.4)
    ax.set_ylabel(f"{role} share of\nweight-gradient signal")
    handle = legend_above(ax, [earlier, last], ncols=2) if legend else None
    if title:
        title_above_legend(ax, title, handle)
    return drawn + ([handle] if handle is not None else [])


__all__ = ["last_block_bars", "sublayer_heatmap"]
