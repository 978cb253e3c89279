"""Fitting text into column-width figures: measured widths, wrapped titles and labels, legends that fit.

A figure saved at its column width cannot let anything hang outside it, and its panels' titles
and labels must not run into each other. Text widths here are measured from the glyphs of the
current font (:func:`text_width`), so wrapping (:func:`wrap_text`, :func:`wrap_title`,
:func:`wrap_ylabel`) and legends (:func:`fitted_legend`: the fewest balanced rows that fit,
long labels wrapped) hold for any label. Panel sizes are known before constrained layout runs
from the grid cell and the figure size, less room for the tick labels (:data:`Y_DECORATION_PT`,
:data:`X_DECORATION_PT`).
"""

from __future__ import annotations

import math

import matplotlib as mpl
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.legend import Legend
from matplotlib.text import Text
from matplotlib.textpath import text_to_path

Y_DECORATION_PT = 34.0
"""Room taken beside an axes by its y tick labels and y label (points), for widths known before layout."""
X_DECORATION_PT = 40.0
"""Room taken above and below an axes by its title, x tick labels and x label (points)."""


def text_width(text: str, fontsize: float | str | None = None, weight: str = "normal") -> float:
    """Width in points of the widest line of ``text`` in the current font (measured from the glyphs)."""
    prop = FontProperties(size=fontsize if fontsize is not None else mpl.rcParams["font.size"], weight=weight)
    return max((text_to_path.get_text_width_height_descent(line, prop, ismath=False)[0]
                for line in text.split("\n")), default=0.0)


def wrap_text(text: str, width_pt: float, fontsize: float | str | None = None, weight: str = "normal") -> str:
    """``text`` broken at spaces into lines no wider than ``width_pt`` (a longer single word keeps its line)."""
    lines: list[str] = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split(" "):
            trial = f"{line} {word}" if line else word
            if line and text_width(trial, fontsize, weight) > width_pt:
                lines.append(line)
                line = word
            else:
                line = trial
        lines.append(line)
    return "\n".join(lines)


def wrap_title(ax: Axes, title: str, **kwargs: object) -> Text:
    """Set ``title`` wrapped to the axes' width (known before layout from its grid cell and the figure)."""
    fontsize = mpl.rcParams["axes.titlesize"]
    return ax.set_title(wrap_text(title, axes_width_pt(ax) * 0.98, fontsize), **kwargs)  # type: ignore[arg-type]


def wrap_ylabel(ax: Axes, label: str) -> Text:
    """Set the y label wrapped to the axes' height (known before layout from its grid cell and the figure)."""
    fig = ax.get_figure()
    spec = ax.get_subplotspec()
    share = 1.0
    if spec is not None:
        share = (spec.rowspan.stop - spec.rowspan.start) / spec.get_gridspec().nrows
    height = max(fig.get_figheight() * 72.0 * share - X_DECORATION_PT, 36.0)
    return ax.set_ylabel(wrap_text(label, height, mpl.rcParams["axes.labelsize"]))


def axes_width_pt(ax: Axes) -> float:
    """About the width in points the axes will get: its share of the figure less room for y tick labels."""
    fig = ax.get_figure()
    spec = ax.get_subplotspec()
    share = 1.0
    if spec is not None:
        share = (spec.colspan.stop - spec.colspan.start) / spec.get_gridspec().ncols
    return max(fig.get_figwidth() * 72.0 * share - Y_DECORATION_PT, 36.0)


def fitted_legend(parent: Axes | Figure, handles: list[Artist], width_pt: float, max_cols: int | None = None,
                  **kwargs: object) -> Legend:
    """A legend of ``handles`` in the fewest balanced rows that fit ``width_pt`` (long labels are wrapped).

    Columns are tried from one row upwards (at most ``max_cols`` a row); the legend's width is
    measured, so whatever the labels and font, it never reaches past ``width_pt``.
    """
    fontsize = kwargs.get("fontsize", mpl.rcParams["legend.fontsize"])
    handle_pt = (mpl.rcParams["legend.handlelength"] + mpl.rcParams["legend.handletextpad"] + 1.0) * \
        FontProperties(size=fontsize).get_size_in_points()  # type: ignore[arg-type]
    labels = [wrap_text(str(h.get_label()), width_pt - handle_pt, fontsize) for h in handles]  # type: ignore[arg-type]
    n = len(handles)
    limit = width_pt * parent.get_figure().dpi / 72.0  # type: ignore[union-attr]
    tried: set[int] = set()
    for rows in range(1, n + 1):
        ncols = min(math.ceil(n / rows), max_cols or n)
        if ncols in tried:
            continue
        tried.add(ncols)
        legend = parent.legend(handles=handles, labels=labels, ncols=ncols, **kwargs)  # type: ignore[arg-type]
        if ncols == 1 or legend.get_window_extent().width <= limit:
            return legend
        legend.remove()
    raise AssertionError("unreachable: one column is always accepted")


def legend_above(ax: Axes, handles: list[Artist], ncols: int | None = None) -> Artist:
    """A frameless legend in as few rows as fit just above the axes (at most ``ncols`` a row).

    It starts at the axes' left edge and may reach past its right edge up to the figure's, so
    its width is capped at the figure's width less room for the y tick labels and label.
    """
    width = ax.get_figure().get_figwidth() * 72.0 - Y_DECORATION_PT
    return fitted_legend(ax, handles, width, ncols, loc="lower left", bbox_to_anchor=(0.0, 1.01),
                         borderaxespad=0.0, columnspacing=0.9, handlelength=1.4)


def legend_below(fig: Figure, handles: list[Artist], max_cols: int | None = None, **kwargs: object) -> Legend:
    """A frameless figure legend under every panel (constrained layout makes room), as few rows as fit."""
    return fitted_legend(fig, handles, fig.get_figwidth() * 72.0 - 8.0, max_cols, loc="outside lower center",
                         frameon=False, **kwargs)


def title_above_legend(ax: Axes, title: str, legend: Artist | None) -> Text:
    """``title`` wrapped to the axes, raised above a legend drawn above the axes (``legend_above``)."""
    pad = mpl.rcParams["axes.titlepad"]
    if legend is not None:
        pad += legend.get_window_extent().height * 72.0 / ax.get_figure().dpi + 2.0
    return wrap_title(ax, title, pad=pad)


__all__ = ["X_DECORATION_PT", "Y_DECORATION_PT", "axes_width_pt", "fitted_legend", "legend_above", "legend_below",
           "text_width", "title_above_legend", "wrap_text", "wrap_title", "wrap_ylabel"]
