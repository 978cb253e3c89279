"""Figures of one run's channels: the depth profile, the ratio heat map, the per-layer distributions.

Plot conventions (``ax=None``, scoped style, returned artists, ``gid`` names, exact zeros on log
axes) are those of :mod:`gradflow.figures.canvas`; the roles drawn by default are
:data:`gradflow.schema.REPORTED_ROLES`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.collections import QuadMesh
from matplotlib.colors import Normalize
from matplotlib.ticker import NullLocator

from gradflow.figures.canvas import (
    HeatmapSpec,
    add_colorbar,
    draw_heatmap,
    finish_log_panel,
    floor_marker_shifts,
    layer_axis,
    layer_grid,
    log_floor_markers,
    new_axes,
    present_roles,
    set_log_or_linear,
)
from gradflow.figures.fitting import wrap_title
from gradflow.figures.style import diverging_cmap, role_color, role_label, styled


@styled
def depth_profile(profile: pd.DataFrame, ax: Axes | None = None, roles: Sequence[str] | None = None,
                  ci: bool = True, legend: bool = True, width: str | float = "single",
                  title: str | None = None) -> list[Artist]:
    """Mean gradient norm by layer, one line per role with its bootstrap CI band, log y.

    ``profile``: the :func:`gradflow.analysis.role_profile` table (``layer``, ``role``,
    ``grad_norm_mean``, ``ci_low``, ``ci_high``). Exact zeros are triangles on the axis floor, on
    their layer's tick (side by side, centred on it, where several roles are zero at one layer).
    Returns the lines (gid ``profile:<role>``), bands (``band:<role>``), zero markers
    (``zeros:<role>``, one artist per role and sideways shift) and the legend.
    """
    ax = new_axes(ax, width, 0.72)
    drawn: list[Artist] = []
    handles: list[Artist] = []
    any_zero = False
    roles = present_roles(profile, roles)
    set_log_or_linear(ax, profile.loc[profile["role"].isin(roles), "grad_norm_mean"].to_numpy())
    zero_x = {}
    for role in roles:
        d = profile[profile["role"] == role]
        y = d["grad_norm_mean"].to_numpy(dtype=float)
        zero_x[role] = np.sort(d["layer"].to_numpy()[np.isfinite(y) & ~(y > 0)])
    shifts = floor_marker_shifts(zero_x)
    for role in roles:
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
        if zero_x[role].size:
            any_zero = True
            for shift in np.unique(shifts[role]):
                at = zero_x[role][shifts[role] == shift]
                drawn.append(log_floor_markers(ax, at, color, f"zeros:{role}", float(shift)))
    layer_axis(ax, profile["layer"].unique())
    return finish_log_panel(ax, drawn, "gradient norm (mean)", title, handles if legend else [], any_zero)


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
    ax = new_axes(ax, width, 0.5)
    roles = present_roles(ratios, roles)
    x, values = layer_grid(ratios[ratios["role"].isin(roles)], "role", roles, "ratio")
    with np.errstate(divide="ignore", invalid="ignore"):
        logv = np.where(values > 0, np.log2(values), np.nan)
    finite = np.abs(logv[np.isfinite(logv)])
    span = max(1.0, float(np.ceil(finite.max()))) if finite.size else 1.0
    norm = Normalize(-span, span)  # symmetric: halving and doubling look equally strong
    spec = HeatmapSpec(x, roles, [role_label(r) for r in roles], values, logv, diverging_cmap(), norm, "heatmap")
    mesh, drawn = draw_heatmap(ax, spec, annotate)
    if title:
        wrap_title(ax, title)
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


def _log2_colorbar(ax: Axes, mesh: QuadMesh, low: float, high: float) -> Axes:
    """Colour bar of a log2 ratio, ticked as ratios (1/4, 1/2, 1, 2, 4); returns its axes."""
    cbar = add_colorbar(ax, mesh, "ratio to loss positions")
    ticks = _log2_ticks(low, high)
    cbar.set_ticks(ticks, labels=[_ratio_label(int(t)) for t in ticks])
    cbar.ax.yaxis.set_minor_locator(NullLocator())
    return cbar.ax


@styled
def distribution_ranges(quantiles: pd.DataFrame, ax: Axes | None = None, roles: Sequence[str] | None = None,
                        legend: bool = True, width: str | float = "single", title: str | None = None) -> list[Artist]:
    """Per layer and role: median gradient norm (dot) and its 5-95% range (bar), log y.

    ``quantiles``: the :func:`gradflow.analysis.channel_quantiles` table. Roles sit side by side
    within a layer. Zeros are drawn on the axis floor: a zero median as a triangle, a zero q05 as
    a range reaching down to the floor. Returns the ranges (gid ``range:<role>``), the medians
    (``median:<role>``) and the legend.
    """
    ax = new_axes(ax, width, 0.72)
    roles = present_roles(quantiles, roles)
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
            drawn.append(log_floor_markers(ax, x[zero], color, f"zeros:{role}"))
    layer_axis(ax, d["layer"].unique())
    ax.xaxis.set_minor_locator(NullLocator())
    return finish_log_panel(ax, drawn, "gradient norm per position\n(median, 5–95%)", title,
                            handles if legend else [], any_zero)


__all__ = ["depth_profile", "distribution_ranges", "ratio_heatmap"]
