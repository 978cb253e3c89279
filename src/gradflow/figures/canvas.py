"""Shared drawing helpers of the figure modules: axes, layer axes, log axes, legends, heat-map cells, saving.

Every plot function takes ``ax=None`` (or ``axes=None`` for multi-panel figures; a new figure
of the preset ``width`` is created when None), draws inside :func:`~.style.gradflow_style`
(so the caller's rcParams are never changed), returns the artists it drew and never calls
``plt.show()``. Data artists carry a ``gid`` such as ``"profile:context"`` for tests and
post-editing.

Log axes cannot show 0: exact zeros are drawn as triangles on the axis floor
(:func:`log_floor_markers`) and named "exactly 0" in the legend (:func:`zero_proxy`); heat-map
cells that are exactly 0 are hatched grey (:func:`heatmap_cells`).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.collections import QuadMesh
from matplotlib.colorbar import Colorbar
from matplotlib.colors import Colormap, Normalize
from matplotlib.figure import Figure
from matplotlib.layout_engine import PlaceHolderLayoutEngine
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle
from matplotlib.text import Text
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter
from matplotlib.transforms import ScaledTranslation

from gradflow.figures.fitting import legend_above, title_above_legend, wrap_text
from gradflow.figures.style import WARNING_COLOR, ZERO_COLOR, figure_size, figure_width, gradflow_style
from gradflow.schema import REPORTED_ROLES

INCOMPLETE_BANNER = "INCOMPLETE RUN: partial data, not for publication"
"""Default banner text for runs with ``complete = false``."""

ZERO_MARKER = "v"
MAX_HEIGHT = 3.2
"""Tallest single-panel figure in inches (keeps double-column figures from growing square)."""
LAYER_LABEL = "layer (0 = embeddings)"
ZERO_HATCH = "////"


def new_axes(ax: Axes | None, width: str | float, aspect: float) -> Axes:
    """``ax`` itself, or the single axes of a new constrained-layout figure (height capped)."""
    if ax is not None:
        return ax
    w, h = figure_size(width, aspect)
    _, ax = plt.subplots(figsize=(w, min(h, MAX_HEIGHT)), layout="constrained")
    return ax


def present_roles(frame: pd.DataFrame, roles: Sequence[str] | None,
                  default: Sequence[str] = REPORTED_ROLES) -> list[str]:
    """Roles to draw (``roles``, else ``default``), in order, that occur in ``frame``."""
    wanted = list(roles) if roles is not None else list(default)
    have = set(frame["role"]) if "role" in frame else set()
    return [r for r in wanted if r in have]


def layer_axis(ax: Axes, layers: Sequence[int] | np.ndarray, label: str = LAYER_LABEL) -> None:
    """Integer layer ticks (thinned when there are many) and the layer label."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(len(layers), 12)))
    ax.set_xlabel(label)


def log_floor_markers(ax: Axes, x: np.ndarray, color: str, gid: str, shift_pt: float = 0.0) -> Line2D:
    """Triangles on the axis floor (axes y = 0) at ``x``: exact zeros on a log axis.

    ``shift_pt`` moves them sideways (in points) so that zeros of several roles at one layer do
    not hide each other.
    """
    transform = ax.get_xaxis_transform() + ScaledTranslation(shift_pt / 72.0, 0.0, ax.figure.dpi_scale_trans)
    (line,) = ax.plot(x, np.zeros(len(x)), linestyle="none", marker=ZERO_MARKER, markersize=4.5,
                      markerfacecolor=color, markeredgecolor="white", markeredgewidth=0.4,
                      transform=transform, clip_on=False, zorder=5, gid=gid)
    return line


ZERO_SPACING_PT = 4.5
"""Sideways distance between the zero markers of several roles at one layer (the markers' width)."""


def floor_marker_shifts(zero_x: dict[str, np.ndarray], spacing_pt: float = ZERO_SPACING_PT) -> dict[str, np.ndarray]:
    """key -> sideways shift in points of each of its exact zeros at ``zero_x[key]``.

    At an x where one key is zero its marker sits on x itself (on the layer's tick); where several are, their
    markers are side by side, ``spacing_pt`` apart, centred on x, in the order of ``zero_x``.
    """
    shifts = {key: np.zeros(len(x)) for key, x in zero_x.items()}
    for value in np.unique(np.concatenate([np.asarray(x, dtype=float) for x in zero_x.values()] or [np.empty(0)])):
        keys = [key for key, x in zero_x.items() if np.any(np.asarray(x, dtype=float) == value)]
        for rank, key in enumerate(keys):
            shifts[key][np.asarray(zero_x[key], dtype=float) == value] = (rank - (len(keys) - 1) / 2) * spacing_pt
    return shifts


def zero_proxy() -> Line2D:
    """Legend handle for exact zeros."""
    return Line2D([], [], linestyle="none", marker=ZERO_MARKER, markersize=4, color="#555555",
                  markeredgecolor="white", markeredgewidth=0.4, label="exactly 0")


def set_log_or_linear(ax: Axes, positive: np.ndarray) -> bool:
    """Use a log y axis when there are positive values; returns whether it is log."""
    if positive.size and np.nanmax(positive) > 0:
        ax.set_yscale("log")
        return True
    return False


def _tick(value: float) -> str:
    """A log-axis tick label: plain (0.3, 20) from 0.001 to 10^4, else ``3×10^-5`` in mathtext."""
    if value <= 0:
        return ""
    if 1e-3 <= value < 1e4:
        return f"{value:g}"
    exp = math.floor(math.log10(value) + 1e-9)
    mant = round(value / 10 ** exp, 6)
    return f"$10^{{{exp}}}$" if mant == 1 else f"${mant:g}\\times10^{{{exp}}}$"


def log_format(ax: Axes) -> None:
    """Plain tick labels (0.3, 1, 2) on a log y axis; 1-2-(3-)5 ticks when it spans under two decades."""
    if ax.get_yscale() != "log":
        return
    lo, hi = ax.get_ylim()
    decades = math.log10(hi / lo) if lo > 0 else math.inf
    if decades < 2.0:
        subs = (1.0, 2.0, 3.0, 5.0) if decades < 1.2 else (1.0, 2.0, 5.0)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _tick(v)))
    ax.yaxis.set_minor_formatter(NullFormatter())


def finish_log_panel(ax: Axes, drawn: list[Artist], ylabel: str, title: str | None, handles: list[Artist],
                     any_zero: bool) -> list[Artist]:
    """Plain log ticks, the y label, (when ``handles``) the legend above the axes and the title above it.

    The legend gets the "exactly 0" marker when ``any_zero``; returns ``drawn`` with the legend.
    """
    log_format(ax)
    ax.set_ylabel(ylabel)
    legend = legend_above(ax, handles + ([zero_proxy()] if any_zero else [])) if handles else None
    if title:
        title_above_legend(ax, title, legend)
    return drawn + ([legend] if legend is not None else [])


def fits_annotation(ax: Axes, n_cols: int, chars: int = 4, fontsize: float = 6.0) -> bool:
    """Whether ``chars``-character labels fit in cells of an axes ``n_cols`` cells wide."""
    width_pt = ax.get_position().width * ax.figure.get_figwidth() * 72.0
    return width_pt / max(n_cols, 1) >= chars * 0.62 * fontsize + 3.0


def text_color(rgba: tuple[float, ...]) -> str:
    """Black or white, whichever reads better on ``rgba``."""
    r, g, b = rgba[:3]
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def cell_label(value: float) -> str:
    """Compact cell label of about 2 significant digits (``.81``, ``1.2``, ``12``, ``2e-3``)."""
    if value == 0:
        return "0"
    if abs(value) < 0.01:
        mant, exp = f"{value:.0e}".split("e")
        return f"{mant}e{int(exp)}"
    if abs(value) >= 10:
        return f"{value:.0f}"
    if abs(value) >= 0.995:
        return f"{value:.1f}"
    return f"{value:.2f}".lstrip("0") if value > 0 else f"{value:.2f}"


def heatmap_cells(ax: Axes, x: np.ndarray, ylabels: list[str], values: np.ndarray, colors: np.ndarray,
                   annotate: bool, labels: np.ndarray, gid: str) -> list[Artist]:
    """Hatch exact-zero cells, mark missing cells and write cell labels."""
    drawn: list[Artist] = []
    for i in range(len(ylabels)):
        for j, xv in enumerate(x):
            v = values[i, j]
            if np.isnan(v):
                continue
            if v == 0:
                drawn.append(ax.add_patch(Rectangle((xv - 0.5, i - 0.5), 1, 1, facecolor=ZERO_COLOR, hatch=ZERO_HATCH,
                                                    edgecolor="white", linewidth=0.0, gid=f"{gid}:zero")))
            if annotate or v == 0:
                color = "black" if v == 0 else text_color(colors[i, j])
                drawn.append(ax.text(xv, i, labels[i, j], ha="center", va="center", fontsize=6, color=color,
                                     gid=f"{gid}:label"))
    return drawn


@dataclass(frozen=True)
class HeatmapSpec:
    """What a layer x row heat map shows: (rows, layers) ``values`` labelled in cells, ``colour`` coloured."""

    x: np.ndarray
    rows: list[str]
    row_labels: list[str]
    values: np.ndarray
    colour: np.ndarray
    cmap: Colormap
    norm: Normalize
    gid: str
    layer_label: str = LAYER_LABEL


def draw_heatmap(ax: Axes, spec: HeatmapSpec, annotate: bool | None) -> tuple[QuadMesh, list[Artist]]:
    """The mesh, zero hatching, cell labels (``annotate=None``: when they fit) and bare axes of a heat map."""
    x, rows = spec.x, spec.rows
    mesh = ax.pcolormesh(np.append(x - 0.5, x[-1] + 0.5), np.arange(len(rows) + 1) - 0.5,
                         np.ma.masked_invalid(spec.colour), cmap=spec.cmap, norm=spec.norm, edgecolors="white",
                         linewidth=0.3, gid=spec.gid)
    drawn: list[Artist] = [mesh]
    annotate = fits_annotation(ax, len(x)) if annotate is None else annotate
    labels = np.vectorize(lambda v: "" if np.isnan(v) else cell_label(v))(spec.values)
    colors = spec.cmap(spec.norm(np.nan_to_num(spec.colour)))
    drawn += heatmap_cells(ax, x, rows, spec.values, colors, annotate, labels, spec.gid)
    ax.set_yticks(range(len(rows)), spec.row_labels)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.tick_params(axis="both", length=0)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    layer_axis(ax, x, spec.layer_label)
    return mesh, drawn


def add_colorbar(ax: Axes | Sequence[Axes], mesh: QuadMesh | ScalarMappable, label: str) -> Colorbar:
    """A slim colour bar beside ``ax`` (several axes: beside them all; its axes' gid is ``colorbar``)."""
    fig = ax.figure if isinstance(ax, Axes) else ax[0].figure
    cbar = fig.colorbar(mesh, ax=ax if isinstance(ax, Axes) else list(ax), fraction=0.05, pad=0.02, aspect=15)
    cbar.set_label(label)
    cbar.outline.set_linewidth(0.4)
    cbar.ax.tick_params(width=0.4, length=2)
    cbar.ax.set_gid("colorbar")
    return cbar


def layer_grid(frame: pd.DataFrame, row: str, rows: list[str], value: str) -> tuple[np.ndarray, np.ndarray]:
    """(x values, rows x columns array of ``value``) of a tidy table, NaN where missing."""
    x = np.sort(frame["layer"].unique())
    wide = frame.pivot_table(index=row, columns="layer", values=value, aggfunc="first")
    return x, wide.reindex(index=rows, columns=x).to_numpy(dtype=float)


def panel_grid(n: int, axes: Sequence[Axes] | None, width: str | float, panel_aspect: float,
                max_cols: int, sharey: bool = True) -> tuple[list[Axes], list[Axes]]:
    """(panels, spare axes): ``axes`` itself, or a new grid of ``n`` panels whose surplus is blanked."""
    if axes is not None:
        return list(axes), []
    ncols = min(n, max_cols)
    nrows = math.ceil(n / ncols)
    w = figure_width(width)
    fig, grid = plt.subplots(nrows, ncols, figsize=(w, w / ncols * panel_aspect * nrows + 0.45),
                             layout="constrained", sharey=sharey, squeeze=False)
    flat = list(grid.ravel())
    for extra in flat[n:]:
        extra.set_axis_off()
    return flat[:n], flat[n:]


def sublayer_ticklabel(name: str) -> str:
    """``attn.norm`` -> ``attn\\nnorm``: two short lines fit a column-width bar chart."""
    return name.replace(".", "\n", 1)


def add_banner(fig: Figure, text: str = INCOMPLETE_BANNER) -> Text:
    """A warning banner across the top of ``fig`` (used for runs with ``complete = false``), wrapped to its width."""
    with gradflow_style(fig.get_figwidth()):
        text = wrap_text(text, fig.get_figwidth() * 72.0 - 16.0, 7, "bold")
        return fig.suptitle(text, color=WARNING_COLOR, fontsize=7, fontweight="bold",
                            bbox=dict(boxstyle="round,pad=0.25", facecolor="#FFF3CD", edgecolor=WARNING_COLOR,
                                      linewidth=0.6))


FIXED_METADATA: dict[str, dict[str, str | None]] = {"pdf": {"CreationDate": None}, "svg": {"Date": None}}
"""Metadata that keeps saved files byte-stable: no creation dates (PNG has none; Software stays)."""


def save_figure(fig: Figure, path_stem: str | Path, formats: Sequence[str] = ("pdf", "png"),
                dpi: int = 300) -> list[Path]:
    """Write ``fig`` as ``<path_stem>.<fmt>`` for each format (vector PDF, ``dpi`` PNG); returns the paths.

    Saving the same figure again gives byte-identical files: the layout is settled first and
    held while every format is written (:func:`settled_layout`), PDF and SVG carry no creation
    date (:data:`FIXED_METADATA`), PNG never has one, and PostScript dates its files from
    ``SOURCE_DATE_EPOCH`` (0 unless the caller set it, as for reproducible builds).
    """
    stem = Path(path_stem)
    if stem.suffix.lstrip(".") in formats:
        stem = stem.with_suffix("")
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    with gradflow_style(fig.get_figwidth()), settled_layout(fig):
        for fmt in formats:
            path = stem.parent / f"{stem.name}.{fmt}"
            with _source_date_epoch(fmt in ("ps", "eps")):
                fig.savefig(path, format=fmt, dpi=dpi, metadata=FIXED_METADATA.get(fmt))
            paths.append(path)
    return paths


@contextmanager
def settled_layout(fig: Figure, max_draws: int = 12) -> Iterator[None]:
    """Inside the block, ``fig`` keeps the fixed point of its layout engine; the engine comes back after.

    Constrained layout refines the axes' positions a little at every draw (and differently at
    each dpi), so a figure saved twice would differ in its last digits. Here the layout is drawn
    (at the figure's dpi, without rendering) until the positions move less than 1e-10 of the
    figure, rounded to 1e-7 (well under a thousandth of a point) and held while the block saves.
    """
    engine = fig.get_layout_engine()
    if engine is None or isinstance(engine, PlaceHolderLayoutEngine):
        yield
        return
    fig.draw_without_rendering()  # the layout every figure gets from one draw (warnings, if any, are the caller's)
    first = before = np.array([ax.get_position().bounds for ax in fig.axes]).reshape(-1, 4)
    for _ in range(max_draws - 1):  # each draw moves the axes about 1000 times less than the one before
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fig.draw_without_rendering()
        now = np.array([ax.get_position().bounds for ax in fig.axes]).reshape(-1, 4)
        if caught or (now[:, 2:] <= 0).any():  # the engine does not converge here (e.g. a symlog colour bar
            for ax, bounds in zip(fig.axes, first):  # whose labels change with its size): keep the first layout
                ax.set_position(bounds)
            break
        if np.abs(now - before).max(initial=0.0) < 1e-10:
            break
        before = now
    for ax in fig.axes:
        in_layout = ax.get_in_layout()
        ax.set_position(np.round(ax.get_position().bounds, 7))
        ax.set_in_layout(in_layout)  # set_position takes an axes out of the layout
    fig.set_layout_engine("none")
    try:
        yield
    finally:
        fig.set_layout_engine(engine)


@contextmanager
def _source_date_epoch(needed: bool) -> Iterator[None]:
    """Set ``SOURCE_DATE_EPOCH`` to 0 inside the block when ``needed`` and the caller has not set it."""
    if not needed or "SOURCE_DATE_EPOCH" in os.environ:
        yield
        return
    os.environ["SOURCE_DATE_EPOCH"] = "0"
    try:
        yield
    finally:
        os.environ.pop("SOURCE_DATE_EPOCH", None)
