"""The channel view figure: a tokens x sites heat map of one sentence, drawn from its table.

The table is :func:`gradflow.runs.channels.channel_table`'s (or ``channel_view.csv``): one row
per (site, position) with ``position``, ``token``, ``input_token``, ``role``, ``site``, ``layer``,
``point`` and the value columns. Rows of the heat map are the sentence's tokens (their role
coloured on the axis), columns the sites from the embeddings to the last block, labelled with
their site names (``embeddings.out``, ``blocks.0.mid`` ... ``blocks.{L-1}.out``: blocks count from 0,
as in the table, the CSV and every run directory; the last block is bracketed). Exact zeros are
hatched grey cells. Gradient norms use a log colour scale; attributions (``attribution_sum``, ``ig_sum``) a signed
symmetric-log scale.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes

from gradflow.figures.canvas import log_format, save_figure
from gradflow.figures.fitting import wrap_title
from gradflow.figures.style import ZERO_COLOR, diverging_cmap, gradflow_style, role_color
from gradflow.roles import TOKEN_ROLES

VALUE_LABEL: dict[str, str] = {"grad_norm": "gradient norm ||dL/dh||",
                               "attribution_sum": "gradient x activation (sum over h)",
                               "ig_sum": "integrated gradients (sum over h)"}
"""Colour-bar label of each value column (other columns are labelled by their name)."""
SIGNED: tuple[str, ...] = ("attribution_sum", "ig_sum")
"""Value columns drawn on a signed scale."""


def _display(token: str) -> str:
    """A token as shown on the axis (byte-level BPE and SentencePiece space marks removed)."""
    return token.replace("Ġ", "").replace("▁", "") or token


def _site_info(table: pd.DataFrame) -> pd.DataFrame:
    """One row per site (index ``site``) with its ``layer`` and ``point``."""
    return table.drop_duplicates("site").set_index("site")[["layer", "point"]]


def _site_labels(table: pd.DataFrame, sites: list[str]) -> list[str]:
    """The site names themselves (``embeddings.out``, ``blocks.0.mid``, ...): the one numbering of blocks, from 0,
    that the table, the CSV and run directories use (the ``layer`` column is the block's index + 1)."""
    return [str(s) for s in sites]


def _token_label(row: pd.Series) -> str:
    label = _display(str(row["token"]))
    if row["input_token"] != row["token"]:
        label = f"{label} \u2192 {_display(str(row['input_token']))}"
    return f"{label}  {int(row['position'])}"


def _norm(values: np.ndarray, signed: bool):
    from matplotlib.colors import LogNorm, Normalize, SymLogNorm

    nonzero = np.abs(values[np.isfinite(values) & (values != 0)])
    if nonzero.size == 0:
        return Normalize(-1, 1) if signed else Normalize(0, 1)
    top = float(nonzero.max())
    if signed:
        return SymLogNorm(linthresh=max(top * 1e-3, float(nonzero.min())), vmin=-top, vmax=top, base=10)
    return LogNorm(vmin=max(float(nonzero.min()), top * 1e-8), vmax=top)


def plot_channel_view(table: pd.DataFrame, value: str = "grad_norm", ax: Axes | None = None,
                      title: str | None = None, colorbar: bool = True, legend: bool = True) -> list[Artist]:
    """Tokens x sites heat map of ``value`` from a channel-view table (see the module docstring).

    Rows: tokens in order, labelled ``token [-> input] position`` and coloured by role, with a
    role strip on the left. Columns: sites from the embeddings to the last block, which is
    bracketed. Exact zeros are hatched grey. Returns the mesh (gid ``channels``), zero patches,
    role strip, bracket, legend and colour bar's axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.transforms import ScaledTranslation

    signed = value in SIGNED
    sites = list(dict.fromkeys(table["site"]))
    tokens = table[table["site"] == sites[0]].sort_values("position")
    grid = table.pivot_table(index="position", columns="site", values=value, aggfunc="first")
    values = grid.reindex(index=tokens["position"], columns=sites).to_numpy(dtype=float)
    n_tok, n_site = values.shape
    with gradflow_style("single"):
        if ax is None:
            _, ax = plt.subplots(figsize=(min(7.0, 2.3 + 0.24 * n_site), 1.1 + 0.14 * n_tok), layout="constrained")
        cmap = diverging_cmap() if signed else plt.get_cmap("viridis").with_extremes(bad="white")
        norm = _norm(values, signed)
        shown = np.ma.masked_where(~np.isfinite(values) | (values == 0), values)
        mesh = ax.pcolormesh(np.arange(n_site + 1) - 0.5, np.arange(n_tok + 1) - 0.5, shown, cmap=cmap, norm=norm,
                             edgecolors="white", linewidth=0.2, gid="channels")
        drawn: list[Artist] = [mesh]
        for i, j in zip(*np.nonzero(values == 0)):
            drawn.append(ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=ZERO_COLOR, hatch="////",
                                                edgecolor="white", linewidth=0.0, gid="channels:zero")))
        roles = tokens["role"].tolist()
        for i, role in enumerate(roles):
            drawn.append(ax.add_patch(Rectangle((-1.25, i - 0.5), 0.55, 1, facecolor=role_color(role), linewidth=0,
                                                clip_on=False, gid=f"channels:role:{role}")))
        ax.set_xlim(-1.3, n_site - 0.5)
        ax.set_ylim(n_tok - 0.5, -0.5)
        ax.set_yticks(range(n_tok), [_token_label(r) for _, r in tokens.iterrows()], fontsize=6)
        for label, role in zip(ax.get_yticklabels(), roles):
            label.set_color(role_color(role))
            if role in ("masked", "random", "kept"):
                label.set_fontweight("bold")
        ax.set_xticks(range(n_site), _site_labels(table, sites), rotation=90, fontsize=6)
        ax.tick_params(axis="both", length=0)
        for side in ("left", "bottom"):
            ax.spines[side].set_visible(False)
        ax.set_xlabel("site (blocks count from 0); layers run left to right")
        drawn += _last_block_bracket(ax, table, sites)
        if title:
            wrap_title(ax, title, pad=22)
        if legend:
            present = [r for r in TOKEN_ROLES if r in roles]
            handles = [Patch(facecolor=role_color(r), label=r) for r in present]
            handles.append(Patch(facecolor=ZERO_COLOR, hatch="////", edgecolor="white", label="exactly 0"))
            # below the site names and the axis label, however long the names (measured, in inches)
            renderer = ax.figure.canvas.get_renderer()
            depth = (ax.get_window_extent(renderer).y0 - ax.xaxis.get_tightbbox(renderer).y0) / ax.figure.dpi
            below = ax.transAxes + ScaledTranslation(0, -(depth + 0.04), ax.figure.dpi_scale_trans)
            drawn.append(ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), bbox_transform=below,
                                   ncols=min(len(handles), 5), fontsize=6, frameon=False, handlelength=1.2,
                                   columnspacing=0.8))
        if colorbar:
            cbar = ax.figure.colorbar(mesh, ax=ax, fraction=0.06, pad=0.02, aspect=25)
            cbar.set_label(VALUE_LABEL.get(value, value), fontsize=6)
            cbar.ax.tick_params(labelsize=6, width=0.4, length=2)
            cbar.outline.set_linewidth(0.4)
            cbar.ax.set_gid("colorbar")
            if signed:
                cbar.set_ticks(_symlog_ticks(norm))
            else:  # a log scale: plain 1-2-5 ticks, no crowded minor labels
                log_format(cbar.ax)
            drawn.append(cbar.ax)
    return drawn


def _last_block_bracket(ax: Axes, table: pd.DataFrame, sites: list[str]) -> list[Artist]:
    """Dashed line before the last block's columns (the sites of the highest layer) and a label above them."""
    layer = _site_info(table)["layer"]
    last = int(layer.max())
    cols = [j for j, s in enumerate(sites) if int(layer[s]) == last]
    left = min(cols) - 0.5
    line = ax.axvline(left, color="#222222", linewidth=0.8, linestyle="--", gid="channels:last_block")
    text = ax.text((left + max(cols) + 0.5) / 2, -0.6, "after the\nlast attention", ha="center", va="bottom",
                   fontsize=5.5, gid="channels:last_block_label")
    return [line, text]


def _symlog_ticks(norm) -> list[float]:
    """0 and +-10^k for the decades above the linear band (ticks inside it would overprint 0)."""
    low = math.floor(math.log10(norm.linthresh)) + 1
    high = math.floor(math.log10(norm.vmax))
    decades = [10.0 ** k for k in range(low, high + 1)] or [norm.vmax]
    return [-d for d in reversed(decades)] + [0.0] + decades


def save_channel_view(table: pd.DataFrame, path_stem: str | Path, value: str = "grad_norm", title: str | None = None,
                      formats: Sequence[str] = ("pdf", "png")) -> list[Path]:
    """Draw :func:`plot_channel_view` of ``value`` and write it as ``<path_stem>.<fmt>``; returns the paths."""
    import matplotlib.pyplot as plt

    drawn = plot_channel_view(table, value, title=title)
    fig = drawn[0].axes.figure
    try:
        return save_figure(fig, path_stem, formats)
    finally:
        plt.close(fig)


__all__ = ["SIGNED", "VALUE_LABEL", "plot_channel_view", "save_channel_view"]
