"""Figures comparing runs: depth profiles side by side, ratios and their differences, last-block shares.

Inputs are the tables of :class:`gradflow.analysis.Comparison`; runs differ by shade, dash,
marker or hatch (:func:`gradflow.figures.style.run_style`); see :mod:`gradflow.figures.canvas`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from gradflow.figures.canvas import LAYER_LABEL, new_axes, panel_grid, present_roles, sublayer_ticklabel, zero_proxy
from gradflow.figures.fitting import fitted_legend, legend_above, legend_below, wrap_title, wrap_ylabel
from gradflow.figures.profiles import depth_profile
from gradflow.figures.style import RUN_HATCHES, figure_width, role_color, role_label, run_style, shade, styled
from gradflow.schema import sorted_sublayers


@styled
def comparison_profiles(profiles: pd.DataFrame, labels: Sequence[str] | None = None,
                        roles: Sequence[str] | None = None, axes: Sequence[Axes] | None = None,
                        width: str | float = "double") -> list[Artist]:
    """Small multiples: one depth-profile panel per run, shared log y, one legend for all.

    ``profiles``: :attr:`gradflow.analysis.Comparison.profiles` (``label`` column). Returns the
    artists of every panel plus the legend (in a spare grid cell when there is one, else below).
    """
    labels = list(labels) if labels is not None else list(dict.fromkeys(profiles["label"]))
    axs, spare = panel_grid(len(labels), axes, width, 0.8, 4 if figure_width(width) > 4 else 2)
    drawn: list[Artist] = []
    for ax, label in zip(axs, labels):
        drawn += depth_profile(profiles[profiles["label"] == label], ax=ax, roles=roles, legend=False,
                               width=width, title=str(label))
    for ax in axs:
        spec = ax.get_subplotspec()
        if spec is not None and not spec.is_first_col() and ax.get_shared_y_axes().joined(ax, axs[0]):
            ax.set_ylabel("")
    roles_drawn = present_roles(profiles, roles)
    handles: list[Artist] = [Line2D([], [], color=role_color(r), marker="o", markersize=2.5, label=role_label(r))
                             for r in roles_drawn]
    if any(str(a.get_gid() or "").startswith("zeros:") for a in drawn):
        handles.append(zero_proxy())
    fig = axs[0].figure
    if spare:
        cell = spare[0].get_position().width * fig.get_figwidth() * 72.0
        drawn.append(fitted_legend(spare[0], handles, cell, 1, loc="center", frameon=False))
    else:
        drawn.append(legend_below(fig, handles))
    return drawn


def _depth_column(frame: pd.DataFrame) -> tuple[str, str]:
    """Plot against ``layer`` when all runs have the same depth, else against relative depth."""
    if "relative_depth" in frame and frame.groupby("label")["layer"].max().nunique() > 1:
        return "relative_depth", "relative depth (layer / blocks)"
    return "layer", LAYER_LABEL


@styled
def comparison_ratios(comparison: object, role: str = "context", axes: Sequence[Axes] | None = None,
                      width: str | float = "double") -> list[Artist]:
    """Two panels: the role / loss ratio by layer for every run, and each run minus the baseline.

    ``comparison``: a :class:`gradflow.analysis.Comparison`. Runs share the role's colour in
    shades and differ by dash and marker; bands are bootstrap CIs (of the difference in the second
    panel). The panels sit side by side at page width and stacked at column width; the legend of
    the runs goes under the figure (into the first panel when ``axes`` are given). Runs of different depth
    are drawn against relative depth (layer / blocks), and each difference pairs layers at the same relative
    depth (``ratio_differences``' ``layer`` and ``baseline_layer``), so the second panel spans 0 to 1. Returns lines
    (gid ``ratio:<label>``, ``difference:<label>``), bands and the legend.
    """
    ratios = comparison.ratios[comparison.ratios["role"] == role]  # type: ignore[attr-defined]
    diffs = comparison.ratio_differences  # type: ignore[attr-defined]
    diffs = diffs[diffs["role"] == role]
    labels: list[str] = list(comparison.labels)  # type: ignore[attr-defined]
    baseline: str = comparison.baseline  # type: ignore[attr-defined]
    wide = figure_width(width) > 5
    axs, _ = panel_grid(2, axes, width, 0.62 if wide else 0.36, 2 if wide else 1, sharey=False)
    col, xlabel = _depth_column(ratios)
    drawn: list[Artist] = []
    handles: list[Artist] = []
    for k, label in enumerate(labels):
        st = run_style(k, len(labels), role)
        d = ratios[ratios["label"] == label].sort_values(col)
        (line,) = axs[0].plot(d[col], d["ratio"], markersize=2.5, label=str(label), gid=f"ratio:{label}", **st)
        handles.append(line)
        drawn += [line, axs[0].fill_between(d[col], d["ci_low"], d["ci_high"], color=st["color"], alpha=0.18,
                                            linewidth=0, gid=f"band:{label}")]
        dd = diffs[diffs["label"] == label].sort_values("layer")
        if len(dd) and label != baseline:
            xd = dd[col]  # a difference row holds the run's layer and its relative depth (matched to the baseline's)
            (dl,) = axs[1].plot(xd, dd["difference"], markersize=2.5, gid=f"difference:{label}", **st)
            drawn += [dl, axs[1].fill_between(xd, dd["ci_low"], dd["ci_high"], color=st["color"], alpha=0.18,
                                              linewidth=0, gid=f"diffband:{label}")]
    axs[0].axhline(1.0, color="#888888", linewidth=0.5, linestyle=":", zorder=1)
    axs[1].axhline(0.0, color="#888888", linewidth=0.5, linestyle=":", zorder=1)
    wrap_ylabel(axs[0], f"{role} / loss gradient norm")
    wrap_ylabel(axs[1], "difference in ratio")
    for ax in axs:
        ax.set_xlabel(xlabel)
        if col == "layer":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=12))
    wrap_title(axs[0], "ratio (95% CI)")
    wrap_title(axs[1], f"run − {baseline} (95% CI)" if col == "layer" else
               f"run − {baseline} at the same relative depth (95% CI)")
    if axes is None:
        drawn.append(legend_below(axs[0].figure, handles, handlelength=2.2))
    else:
        drawn.append(axs[0].legend(loc="best", handlelength=2.2))
    return drawn


@styled
def comparison_last_block(comparison: object, ax: Axes | None = None, width: str | float = "double") -> list[Artist]:
    """Grouped bars: each run's last-block share per sublayer, with its earlier-block mean as a tick.

    ``comparison``: a :class:`gradflow.analysis.Comparison`. Returns the bars (gid
    ``last:<label>``), the earlier-mean ticks (``earlier:<label>``) and the legend.
    """
    last = comparison.last_block  # type: ignore[attr-defined]
    labels: list[str] = list(comparison.labels)  # type: ignore[attr-defined]
    wide = figure_width(width) > 5
    ax = new_axes(ax, width, 0.32 if wide else 0.72)
    role = str(last["role"].iloc[0]) if len(last) else "context"
    subs = sorted_sublayers(last["sublayer"].unique())
    x = np.arange(len(subs))
    w = 0.8 / max(len(labels), 1)
    drawn: list[Artist] = []
    for k, label in enumerate(labels):
        d = last[last["label"] == label].set_index("sublayer").reindex(subs)
        xs = x - 0.4 + w * (k + 0.5)
        color = shade(role_color(role), k, len(labels))
        bars = ax.bar(xs, d["share"].fillna(0), w * 0.92, color=color, hatch=RUN_HATCHES[k % len(RUN_HATCHES)],
                      edgecolor="white", linewidth=0.0, label=str(label), gid=f"last:{label}")
        ticks = ax.hlines(d["earlier_mean"], xs - w * 0.46, xs + w * 0.46, color="black", linewidth=0.9,
                          gid=f"earlier:{label}")
        drawn += [*bars.patches, ticks]
        top = float(np.nanmax(np.r_[last["share"], last["earlier_mean"], 0.05]))
        for xi, v in zip(xs, d["share"]):
            if v == 0:
                drawn.append(ax.text(xi, top * 0.015, "0", ha="center", va="bottom", fontsize=6.5, color=color,
                                     fontweight="bold", gid=f"last:{label}:zero"))
    ax.set_xticks(x, [sublayer_ticklabel(s) for s in subs])
    ax.tick_params(axis="x", length=0)
    ax.set_ylabel(f"{role} share,\nlast block")
    ax.set_ylim(0, min(1.0, float(np.nanmax(np.r_[last["share"], last["earlier_mean"], 0.05])) * 1.15))
    handles = [Patch(facecolor=shade(role_color(role), k, len(labels)), hatch=RUN_HATCHES[k % len(RUN_HATCHES)],
                     edgecolor="white", label=str(lab)) for k, lab in enumerate(labels)]
    handles.append(Line2D([], [], color="black", linewidth=0.9, label="earlier blocks (mean)"))
    drawn.append(legend_above(ax, handles, ncols=len(handles) if wide else 2))
    return drawn


__all__ = ["comparison_last_block", "comparison_profiles", "comparison_ratios"]
