"""Publication figures from the tidy tables of :mod:`gradflow.analysis`.

Every plot function takes ``ax=None`` (or ``axes=None`` for multi-panel figures; a new figure
of the preset ``width`` is created when None), draws inside :func:`~.style.gradflow_style`
(so the caller's rcParams are never changed), returns the artists it drew and never calls
``plt.show()``. Data artists carry a ``gid`` such as ``"profile:context"`` for tests and
post-editing. Log axes cannot show 0: exact zeros are drawn as triangles on the axis floor and
named "exactly 0" in the legend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.text import Text
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter, NullLocator
from matplotlib.transforms import ScaledTranslation

from gradflow.analysis import SUBLAYER_ORDER
from gradflow.figures.style import (
    ROLE_COLORS,
    RUN_HATCHES,
    WARNING_COLOR,
    ZERO_COLOR,
    diverging_cmap,
    figure_size,
    figure_width,
    gradflow_style,
    lighten,
    role_color,
    role_label,
    run_style,
    sequential_cmap,
    shade,
    styled,
)

PLOT_ROLES: tuple[str, ...] = ("masked", "random", "kept", "context", "special")
"""Roles drawn by default (``pad`` carries no signal; pass ``roles=`` to add it or ``loss``)."""

INCOMPLETE_BANNER = "INCOMPLETE RUN: partial data, not for publication"
"""Default banner text for runs with ``complete = false``."""

ZERO_MARKER = "v"
MAX_HEIGHT = 3.2
"""Tallest single-panel figure in inches (keeps double-column figures from growing square)."""
LAYER_LABEL = "layer (0 = embeddings)"
ZERO_HATCH = "////"


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------

def _new_axes(ax: Axes | None, width: str | float, aspect: float) -> Axes:
    """``ax`` itself, or the single axes of a new constrained-layout figure (height capped)."""
    if ax is not None:
        return ax
    w, h = figure_size(width, aspect)
    _, ax = plt.subplots(figsize=(w, min(h, MAX_HEIGHT)), layout="constrained")
    return ax


def _present(frame: pd.DataFrame, roles: Sequence[str] | None, default: Sequence[str]) -> list[str]:
    """Roles to draw, in order, that occur in ``frame``."""
    wanted = list(roles) if roles is not None else list(default)
    have = set(frame["role"]) if "role" in frame else set()
    return [r for r in wanted if r in have]


def _layer_axis(ax: Axes, layers: Sequence[int] | np.ndarray, label: str = LAYER_LABEL) -> None:
    """Integer layer ticks (thinned when there are many) and the layer label."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(len(layers), 12)))
    ax.set_xlabel(label)


def _log_floor_markers(ax: Axes, x: np.ndarray, color: str, gid: str, shift_pt: float = 0.0) -> Line2D:
    """Triangles on the axis floor (axes y = 0) at ``x``: exact zeros on a log axis.

    ``shift_pt`` moves them sideways (in points) so that zeros of several roles at one layer do
    not hide each other.
    """
    transform = ax.get_xaxis_transform() + ScaledTranslation(shift_pt / 72.0, 0.0, ax.figure.dpi_scale_trans)
    (line,) = ax.plot(x, np.zeros(len(x)), linestyle="none", marker=ZERO_MARKER, markersize=4.5,
                      markerfacecolor=color, markeredgecolor="white", markeredgewidth=0.4,
                      transform=transform, clip_on=False, zorder=5, gid=gid)
    return line


def _zero_proxy() -> Line2D:
    """Legend handle for exact zeros."""
    return Line2D([], [], linestyle="none", marker=ZERO_MARKER, markersize=4, color="#555555",
                  markeredgecolor="white", markeredgewidth=0.4, label="exactly 0")


def _legend_above(ax: Axes, handles: list[Artist], ncols: int | None = None) -> Artist:
    """A frameless legend in one or two rows just above the axes."""
    n = len(handles)
    ncols = ncols or (n if n <= 4 or ax.figure.get_figwidth() > 5 else math.ceil(n / 2))
    return ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.01), ncols=ncols,
                     borderaxespad=0.0, columnspacing=0.9, handlelength=1.4)


def _set_log_or_linear(ax: Axes, positive: np.ndarray) -> bool:
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


def _log_format(ax: Axes) -> None:
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


def _fits_annotation(ax: Axes, n_cols: int, chars: int = 4, fontsize: float = 6.0) -> bool:
    """Whether ``chars``-character labels fit in cells of an axes ``n_cols`` cells wide."""
    width_pt = ax.get_position().width * ax.figure.get_figwidth() * 72.0
    return width_pt / max(n_cols, 1) >= chars * 0.62 * fontsize + 3.0


def _text_color(rgba: tuple[float, ...]) -> str:
    """Black or white, whichever reads better on ``rgba``."""
    r, g, b = rgba[:3]
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def _fmt(value: float) -> str:
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


# ----------------------------------------------------------------------------------------------
# (a) depth profile
# ----------------------------------------------------------------------------------------------

@styled
def depth_profile(profile: pd.DataFrame, ax: Axes | None = None, roles: Sequence[str] | None = None,
                  ci: bool = True, legend: bool = True, width: str | float = "single",
                  title: str | None = None) -> list[Artist]:
    """Mean gradient norm by layer, one line per role with its bootstrap CI band, log y.

    ``profile``: the :func:`gradflow.analysis.role_profile` table (``layer``, ``role``,
    ``grad_norm_mean``, ``ci_low``, ``ci_high``). Exact zeros are triangles on the axis floor.
    Returns the lines (gid ``profile:<role>``), bands (``band:<role>``), zero markers
    (``zeros:<role>``) and the legend.
    """
    ax = _new_axes(ax, width, 0.72)
    drawn: list[Artist] = []
    handles: list[Artist] = []
    any_zero = False
    roles = _present(profile, roles, PLOT_ROLES)
    _set_log_or_linear(ax, profile.loc[profile["role"].isin(roles), "grad_norm_mean"].to_numpy())
    for k, role in enumerate(roles):
        d = profile[profile["role"] == role].sort_values("layer")
        x, y = d["layer"].to_numpy(), d["grad_norm_mean"].to_numpy(dtype=float)
        pos = y > 0
        color = role_color(role)
        (line,) = ax.plot(x, np.where(pos, y, np.nan), color=color, marker="o", markersize=2.5,
                          label=role_label(role), gid=f"profile:{role}", zorder=3)
        drawn.append(line)
        handles.append(line)
        if ci and {"ci_low", "ci_high"} <= set(d.columns):
            lo = np.where(pos & (d["ci_low"].to_numpy(dtype=float) > 0), d["ci_low"], np.nan)
            hi = np.where(pos, d["ci_high"].to_numpy(dtype=float), np.nan)
            drawn.append(ax.fill_between(x, lo, hi, color=color, alpha=0.14, linewidth=0, gid=f"band:{role}",
                                         zorder=2))
        if (~pos & np.isfinite(y)).any():
            any_zero = True
            shift = (k - (len(roles) - 1) / 2) * 3.5
            drawn.append(_log_floor_markers(ax, x[~pos & np.isfinite(y)], color, f"zeros:{role}", shift))
    _layer_axis(ax, profile["layer"].unique())
    _log_format(ax)
    ax.set_ylabel("gradient norm (mean)")
    if title:
        ax.set_title(title)
    if legend and handles:
        drawn.append(_legend_above(ax, handles + ([_zero_proxy()] if any_zero else [])))
    return drawn


# ----------------------------------------------------------------------------------------------
# (b) ratio heat map
# ----------------------------------------------------------------------------------------------

def _heatmap_cells(ax: Axes, x: np.ndarray, ylabels: list[str], values: np.ndarray, colors: np.ndarray,
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
                color = "black" if v == 0 else _text_color(colors[i, j])
                drawn.append(ax.text(xv, i, labels[i, j], ha="center", va="center", fontsize=6, color=color,
                                     gid=f"{gid}:label"))
    return drawn


def _grid(frame: pd.DataFrame, row: str, rows: list[str], value: str) -> tuple[np.ndarray, np.ndarray]:
    """(x values, rows x columns array of ``value``) of a tidy table, NaN where missing."""
    x = np.sort(frame["layer"].unique())
    wide = frame.pivot_table(index=row, columns="layer", values=value, aggfunc="first")
    return x, wide.reindex(index=rows, columns=x).to_numpy(dtype=float)


@styled
def ratio_heatmap(ratios: pd.DataFrame, ax: Axes | None = None, roles: Sequence[str] | None = None,
                  annotate: bool | None = None, colorbar: bool = True, width: str | float = "single",
                  title: str | None = None) -> list[Artist]:
    """Layer x role heat map of each role's gradient norm over the pooled loss-position norm.

    ``ratios``: the :func:`gradflow.analysis.role_ratios` table. Colour is log2(ratio) on a
    symmetric diverging map centred on 1 (equal to the loss positions); exact zeros are hatched
    grey cells.
    ``annotate=None`` writes the ratio in each cell when cells are wide enough. Returns the mesh
    (gid ``heatmap``), zero patches, cell labels and the colour bar's axes (``colorbar``).
    """
    ax = _new_axes(ax, width, 0.5)
    roles = _present(ratios, roles, PLOT_ROLES)
    x, values = _grid(ratios[ratios["role"].isin(roles)], "role", roles, "ratio")
    with np.errstate(divide="ignore", invalid="ignore"):
        logv = np.where(values > 0, np.log2(values), np.nan)
    finite = np.abs(logv[np.isfinite(logv)])
    span = max(1.0, float(np.ceil(finite.max()))) if finite.size else 1.0
    norm = Normalize(-span, span)  # symmetric: halving and doubling look equally strong
    cmap = diverging_cmap()
    mesh = ax.pcolormesh(np.append(x - 0.5, x[-1] + 0.5), np.arange(len(roles) + 1) - 0.5,
                         np.ma.masked_invalid(logv), cmap=cmap, norm=norm, edgecolors="white", linewidth=0.3,
                         gid="heatmap")
    drawn: list[Artist] = [mesh]
    annotate = _fits_annotation(ax, len(x)) if annotate is None else annotate
    labels = np.vectorize(lambda v: "" if np.isnan(v) else _fmt(v))(values)
    drawn += _heatmap_cells(ax, x, roles, values, cmap(norm(np.nan_to_num(logv))), annotate, labels, "heatmap")
    ax.set_yticks(range(len(roles)), [role_label(r) for r in roles])
    ax.set_ylim(len(roles) - 0.5, -0.5)
    ax.tick_params(axis="y", length=0)
    ax.tick_params(axis="x", length=0)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    _layer_axis(ax, x)
    if title:
        ax.set_title(title)
    if colorbar:
        drawn.append(_log2_colorbar(ax, mesh, -span, span))
    return drawn


def _log2_ticks(low: float, high: float, max_per_side: int = 3) -> np.ndarray:
    """Integer log2 ticks from ``low`` to ``high`` always including 0, at most ``max_per_side`` per side."""
    neg_step = max(1, math.ceil(-low / max_per_side))
    pos_step = max(1, math.ceil(high / max_per_side))
    neg = -np.arange(neg_step, int(-low) + 1, neg_step)[::-1]
    pos = np.arange(pos_step, int(high) + 1, pos_step)
    return np.concatenate([neg, [0], pos]).astype(int)


def _ratio_label(k: int) -> str:
    """2**k as a ratio label: 1/4, 1/2, 1, 2, 4."""
    return f"1/{2 ** -k:g}" if k < 0 else f"{2 ** k:g}"


def _log2_colorbar(ax: Axes, mesh: Artist, low: float, high: float) -> Axes:
    """Colour bar of a log2 ratio, ticked as ratios (1/4, 1/2, 1, 2, 4); returns its axes."""
    cbar = ax.figure.colorbar(mesh, ax=ax, fraction=0.05, pad=0.02, aspect=15)
    ticks = _log2_ticks(low, high)
    cbar.set_ticks(ticks, labels=[_ratio_label(int(t)) for t in ticks])
    cbar.ax.yaxis.set_minor_locator(NullLocator())
    cbar.set_label("ratio to loss positions")
    cbar.outline.set_linewidth(0.4)
    cbar.ax.tick_params(width=0.4, length=2)
    cbar.ax.set_gid("colorbar")
    return cbar.ax


@styled
def sublayer_heatmap(shares: pd.DataFrame, value: str = "coverage", role: str = "context", ax: Axes | None = None,
                     annotate: bool | None = None, colorbar: bool = True, width: str | float = "single",
                     title: str | None = None) -> list[Artist]:
    """Layer x sublayer heat map of a role's ``coverage`` or ``share`` (both in [0, 1]).

    ``shares``: the :func:`gradflow.analysis.sublayer_shares` (or ``context_share``) table.
    Exact zeros are hatched grey cells. Returns the mesh (gid ``sublayers``), zero patches, labels
    and the colour bar's axes (``colorbar``).
    """
    ax = _new_axes(ax, width, 0.62)
    d = shares[shares["role"] == role]
    subs = sorted(d["sublayer"].unique(), key=lambda s: SUBLAYER_ORDER.index(s) if s in SUBLAYER_ORDER else 99)
    x, values = _grid(d, "sublayer", subs, value)
    cmap, norm = sequential_cmap(), Normalize(0.0, 1.0)
    mesh = ax.pcolormesh(np.append(x - 0.5, x[-1] + 0.5), np.arange(len(subs) + 1) - 0.5,
                         np.ma.masked_invalid(values), cmap=cmap, norm=norm, edgecolors="white", linewidth=0.3,
                         gid="sublayers")
    drawn: list[Artist] = [mesh]
    annotate = _fits_annotation(ax, len(x)) if annotate is None else annotate
    labels = np.vectorize(lambda v: "" if np.isnan(v) else _fmt(v))(values)
    drawn += _heatmap_cells(ax, x, subs, values, cmap(norm(np.nan_to_num(values))), annotate, labels, "sublayers")
    ax.set_yticks(range(len(subs)), subs)
    ax.set_ylim(len(subs) - 0.5, -0.5)
    ax.tick_params(axis="both", length=0)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    _layer_axis(ax, x, "layer (block)")
    if title:
        ax.set_title(title)
    if colorbar:
        cbar = ax.figure.colorbar(mesh, ax=ax, fraction=0.05, pad=0.02, aspect=15)
        cbar.set_label(f"{role} {value}")
        cbar.outline.set_linewidth(0.4)
        cbar.ax.tick_params(width=0.4, length=2)
        cbar.ax.set_gid("colorbar")
        drawn.append(cbar.ax)
    return drawn


# ----------------------------------------------------------------------------------------------
# (c) last-block sublayer bars
# ----------------------------------------------------------------------------------------------

def _sublayer_ticklabel(name: str) -> str:
    """``attn.norm`` -> ``attn\\nnorm``: two short lines fit a column-width bar chart."""
    return name.replace(".", "\n", 1)


@styled
def last_block_bars(deficit: pd.DataFrame, ax: Axes | None = None, legend: bool = True,
                    width: str | float = "single", title: str | None = None) -> list[Artist]:
    """Per sublayer: the role's share in the last block next to the earlier blocks' mean.

    ``deficit``: the :func:`gradflow.analysis.last_block_deficit` table. The earlier-block bar
    carries a min-max range; exact zeros in the last block are labelled "0". Returns the bars
    (gid ``last`` / ``earlier``), the range lines, the zero labels and the legend.
    """
    ax = _new_axes(ax, width, 0.62)
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
    ax.set_xticks(x, [_sublayer_ticklabel(s) for s in deficit["sublayer"]])
    ax.tick_params(axis="x", length=0)
    ax.set_ylim(0, min(1.0, top * 1.12) if top > 0 else 1.0)
    ax.set_xlim(-0.6, len(x) - 0.4)
    ax.set_ylabel(f"{role} share of\nweight-gradient signal")
    if title:
        ax.set_title(title)
    if legend:
        drawn.append(_legend_above(ax, [earlier, last], ncols=2))
    return drawn


# ----------------------------------------------------------------------------------------------
# (d) distributions per layer and role
# ----------------------------------------------------------------------------------------------

@styled
def distribution_ranges(quantiles: pd.DataFrame, ax: Axes | None = None, roles: Sequence[str] | None = None,
                        legend: bool = True, width: str | float = "single", title: str | None = None) -> list[Artist]:
    """Per layer and role: median gradient norm (dot) and its 5-95% range (bar), log y.

    ``quantiles``: the :func:`gradflow.analysis.channel_quantiles` table. Roles sit side by side
    within a layer. Zeros are drawn on the axis floor: a zero median as a triangle, a zero q05 as
    a range reaching down to the floor. Returns the ranges (gid ``range:<role>``), the medians
    (``median:<role>``) and the legend.
    """
    ax = _new_axes(ax, width, 0.72)
    roles = _present(quantiles, roles, PLOT_ROLES)
    d = quantiles[quantiles["role"].isin(roles)]
    positive = d[["q05", "median", "q95"]].to_numpy(dtype=float)
    positive = positive[positive > 0]
    if positive.size == 0:
        raise ValueError("distribution_ranges: every quantile is zero; nothing to draw on a log axis")
    floor, ceil = positive.min() / 2.5, positive.max() * 1.6
    ax.set_yscale("log")
    ax.set_ylim(floor, ceil)
    offsets = (np.arange(len(roles)) - (len(roles) - 1) / 2) * min(0.16, 0.8 / max(len(roles), 1))
    drawn: list[Artist] = []
    handles: list[Artist] = []
    any_zero = False
    for off, role in zip(offsets, roles):
        r = d[d["role"] == role].sort_values("layer")
        x = r["layer"].to_numpy() + off
        lo, med, hi = (np.where(r[c].to_numpy(dtype=float) > 0, r[c], floor) for c in ("q05", "median", "q95"))
        color = role_color(role)
        keep = r["q95"].to_numpy(dtype=float) > 0
        drawn.append(ax.vlines(x[keep], lo[keep], hi[keep], color=color, linewidth=1.1, alpha=0.55,
                               gid=f"range:{role}"))
        zero = r["median"].to_numpy(dtype=float) == 0
        any_zero |= bool(zero.any() or (r["q05"].to_numpy(dtype=float) == 0).any())
        (m,) = ax.plot(x[~zero], med[~zero], linestyle="none", marker="o", markersize=2.6, color=color,
                       markeredgewidth=0, label=role_label(role), gid=f"median:{role}")
        drawn.append(m)
        handles.append(m)
        if zero.any():
            drawn.append(_log_floor_markers(ax, x[zero], color, f"zeros:{role}"))
    _layer_axis(ax, d["layer"].unique())
    ax.xaxis.set_minor_locator(NullLocator())
    _log_format(ax)
    ax.set_ylabel("gradient norm per position\n(median, 5–95%)")
    if title:
        ax.set_title(title)
    if legend and handles:
        drawn.append(_legend_above(ax, handles + ([_zero_proxy()] if any_zero else [])))
    return drawn


# ----------------------------------------------------------------------------------------------
# (e) comparison across runs
# ----------------------------------------------------------------------------------------------

def _panel_grid(n: int, axes: Sequence[Axes] | None, width: str | float, panel_aspect: float,
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


@styled
def comparison_profiles(profiles: pd.DataFrame, labels: Sequence[str] | None = None,
                        roles: Sequence[str] | None = None, axes: Sequence[Axes] | None = None,
                        width: str | float = "double") -> list[Artist]:
    """Small multiples: one depth-profile panel per run, shared log y, one legend for all.

    ``profiles``: :attr:`gradflow.analysis.Comparison.profiles` (``label`` column). Returns the
    artists of every panel plus the legend (in a spare grid cell when there is one, else below).
    """
    labels = list(labels) if labels is not None else list(dict.fromkeys(profiles["label"]))
    axs, spare = _panel_grid(len(labels), axes, width, 0.8, 4 if figure_width(width) > 4 else 2)
    drawn: list[Artist] = []
    for ax, label in zip(axs, labels):
        drawn += depth_profile(profiles[profiles["label"] == label], ax=ax, roles=roles, legend=False,
                               width=width, title=str(label))
    for ax in axs:
        spec = ax.get_subplotspec()
        if spec is not None and not spec.is_first_col() and ax.get_shared_y_axes().joined(ax, axs[0]):
            ax.set_ylabel("")
    roles_drawn = _present(profiles, roles, PLOT_ROLES)
    handles: list[Artist] = [Line2D([], [], color=role_color(r), marker="o", markersize=2.5, label=role_label(r))
                             for r in roles_drawn]
    if any(str(a.get_gid() or "").startswith("zeros:") for a in drawn):
        handles.append(_zero_proxy())
    if spare:
        drawn.append(spare[0].legend(handles=handles, loc="center", frameon=False))
    else:
        fig = axs[0].figure
        ncols = len(handles) if fig.get_figwidth() > 5 else min(len(handles), 3)
        drawn.append(fig.legend(handles=handles, loc="outside lower center", ncols=ncols, frameon=False))
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
    shades and differ by dash and marker; bands are bootstrap CIs (of the difference on the right).
    Returns lines (gid ``ratio:<label>``, ``difference:<label>``), bands and the legend.
    """
    ratios = comparison.ratios[comparison.ratios["role"] == role]  # type: ignore[attr-defined]
    diffs = comparison.ratio_differences  # type: ignore[attr-defined]
    diffs = diffs[diffs["role"] == role]
    labels: list[str] = list(comparison.labels)  # type: ignore[attr-defined]
    baseline: str = comparison.baseline  # type: ignore[attr-defined]
    axs, _ = _panel_grid(2, axes, width, 0.62, 2, sharey=False)
    col, xlabel = _depth_column(ratios)
    drawn: list[Artist] = []
    for k, label in enumerate(labels):
        st = run_style(k, len(labels), role)
        d = ratios[ratios["label"] == label].sort_values(col)
        (line,) = axs[0].plot(d[col], d["ratio"], markersize=2.5, label=str(label), gid=f"ratio:{label}", **st)
        drawn += [line, axs[0].fill_between(d[col], d["ci_low"], d["ci_high"], color=st["color"], alpha=0.18,
                                            linewidth=0, gid=f"band:{label}")]
        dd = diffs[diffs["label"] == label].sort_values("layer")
        if len(dd) and label != baseline:
            xd = dd["layer"] if col == "layer" else dd["layer"].map(d.set_index("layer")[col])
            (dl,) = axs[1].plot(xd, dd["difference"], markersize=2.5, gid=f"difference:{label}", **st)
            drawn += [dl, axs[1].fill_between(xd, dd["ci_low"], dd["ci_high"], color=st["color"], alpha=0.18,
                                              linewidth=0, gid=f"diffband:{label}")]
    axs[0].axhline(1.0, color="#888888", linewidth=0.5, linestyle=":", zorder=1)
    axs[1].axhline(0.0, color="#888888", linewidth=0.5, linestyle=":", zorder=1)
    axs[0].set_ylabel(f"{role} / loss gradient norm")
    axs[1].set_ylabel(f"difference to {baseline}")
    for ax in axs:
        ax.set_xlabel(xlabel)
        if col == "layer":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=12))
    axs[0].set_title("ratio (95% CI)")
    axs[1].set_title(f"run − {baseline} (95% CI)")
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
    ax = _new_axes(ax, width, 0.32 if wide else 0.72)
    role = str(last["role"].iloc[0]) if len(last) else "context"
    subs = sorted(last["sublayer"].unique(), key=lambda s: SUBLAYER_ORDER.index(s) if s in SUBLAYER_ORDER else 99)
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
    ax.set_xticks(x, [_sublayer_ticklabel(s) for s in subs])
    ax.tick_params(axis="x", length=0)
    ax.set_ylabel(f"{role} share,\nlast block")
    ax.set_ylim(0, min(1.0, float(np.nanmax(np.r_[last["share"], last["earlier_mean"], 0.05])) * 1.15))
    handles = [Patch(facecolor=shade(role_color(role), k, len(labels)), hatch=RUN_HATCHES[k % len(RUN_HATCHES)],
                     edgecolor="white", label=str(lab)) for k, lab in enumerate(labels)]
    handles.append(Line2D([], [], color="black", linewidth=0.9, label="earlier blocks (mean)"))
    drawn.append(_legend_above(ax, handles, ncols=len(handles) if wide else 2))
    return drawn


# ----------------------------------------------------------------------------------------------
# Banner and saving
# ----------------------------------------------------------------------------------------------

def add_banner(fig: Figure, text: str = INCOMPLETE_BANNER) -> Text:
    """A warning banner across the top of ``fig`` (used for runs with ``complete = false``)."""
    with gradflow_style(fig.get_figwidth()):
        return fig.suptitle(text, color=WARNING_COLOR, fontsize=7, fontweight="bold",
                            bbox=dict(boxstyle="round,pad=0.25", facecolor="#FFF3CD", edgecolor=WARNING_COLOR,
                                      linewidth=0.6))


def save_figure(fig: Figure, path_stem: str | Path, formats: Sequence[str] = ("pdf", "png"),
                dpi: int = 300) -> list[Path]:
    """Write ``fig`` as ``<path_stem>.<fmt>`` for each format (vector PDF, ``dpi`` PNG); returns the paths."""
    stem = Path(path_stem)
    if stem.suffix.lstrip(".") in formats:
        stem = stem.with_suffix("")
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    with gradflow_style(fig.get_figwidth()):
        for fmt in formats:
            path = stem.parent / f"{stem.name}.{fmt}"
            fig.savefig(path, format=fmt, dpi=dpi)
            paths.append(path)
    return paths


__all__ = [
    "INCOMPLETE_BANNER", "PLOT_ROLES", "ROLE_COLORS", "add_banner", "comparison_last_block", "comparison_profiles",
    "comparison_ratios", "depth_profile", "distribution_ranges", "last_block_bars", "ratio_heatmap",
    "save_figure", "sublayer_heatmap",
]
