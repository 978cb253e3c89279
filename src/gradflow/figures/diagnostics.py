"""Figures of the representation diagnostics (one per table; ``ax=None`` creates a figure)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator

from gradflow.figures.canvas import LAYER_LABEL, MAX_HEIGHT, save_figure
from gradflow.figures.style import figure_size, gradflow_style, role_color, role_label, styled
from gradflow.roles import LOSS_ROLES
from gradflow.schema import LOSS


def _axes(ax, width: str | float = "single", aspect: float = 0.68):
    """``ax`` itself, or the axes of a new figure of ``width`` (height capped, see :data:`MAX_HEIGHT`)."""
    if ax is not None:
        return ax
    w, h = figure_size(width, aspect)
    _, ax = plt.subplots(figsize=(w, min(h, MAX_HEIGHT)), layout="constrained")
    return ax


def _role_lines(ax, table: pd.DataFrame, value: str, roles: Iterable[str]) -> list:
    """One line of ``value`` by layer per role (the pooled ``loss`` dashed)."""
    drawn = []
    for role in roles:
        d = table[table["role"] == role].sort_values("layer")
        if d.empty:
            continue
        style = {"linestyle": "--"} if role == LOSS else {}
        drawn += ax.plot(d["layer"], d[value], marker="o", color=role_color(role), label=role_label(role),
                         gid=f"{value}:{role}", **style)
    return drawn


def _finish(ax, drawn: list, xlabel: str, ylabel: str) -> None:
    """Axis labels, integer layer ticks and a legend when something was labelled."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if drawn and any(a.get_label() and not a.get_label().startswith("_") for a in drawn):
        drawn.append(ax.legend(loc="best", ncols=2))


@styled
def plot_logit_lens(table: pd.DataFrame, ax=None,
                    roles: Sequence[str] = ("context", *LOSS_ROLES), width: str | float = "single") -> list:
    """Top-1 recovery of the original token vs layer, one line per role. Returns the artists."""
    ax = _axes(ax, width)
    drawn = _role_lines(ax, table, "top1_original", roles)
    ax.set_ylim(-0.03, 1.03)
    _finish(ax, drawn, LAYER_LABEL, "top-1 = original token")
    ax.set_title("logit lens")
    return drawn


@styled
def plot_input_shift(table: pd.DataFrame, ax=None, width: str | float = "single") -> list:
    """Probe AUROC (loss vs context FFN inputs) per block with its 95% interval; 0.5 = no shift."""
    ax, d = _axes(ax, width), table.sort_values("layer")
    color = role_color(LOSS)
    band = ax.fill_between(d["layer"], d["auroc_ci_low"], d["auroc_ci_high"], color=color, alpha=0.15,
                           linewidth=0, gid="input_shift:ci")
    line = ax.plot(d["layer"], d["auroc"], marker="o", color=color, label="probe AUROC", gid="input_shift:auroc")
    chance = ax.axhline(0.5, color="#777777", linewidth=0.6, linestyle=":", label="chance")
    ax.set_ylim(0.4, 1.02)
    drawn = [band, *line, chance]
    _finish(ax, drawn, "block (FFN input)", "AUROC loss vs context")
    ax.set_title("input shift")
    return drawn


@styled
def plot_frechet(table: pd.DataFrame, ax=None, width: str | float = "single") -> list:
    """Frechet distance between loss and context FFN-input Gaussians per block (log scale if > 0)."""
    ax, d = _axes(ax, width), table.sort_values("layer")
    drawn = ax.plot(d["layer"], d["frechet_distance"], marker="o", color=role_color(LOSS),
                    label="Frechet distance", gid="frechet:distance")
    drawn += ax.plot(d["layer"], d["mean_shift_sq"], marker="s", linestyle="--", color=role_color("context"),
                     label="mean shift squared", gid="frechet:mean")
    values = d[["frechet_distance", "mean_shift_sq"]].to_numpy(dtype=float)
    if np.all(values > 0) and values.max() / values.min() > 20:
        ax.set_yscale("log")  # only when the values span decades; narrow ranges read better linear
    else:
        ax.set_ylim(bottom=0)
    _finish(ax, drawn, "block (FFN input)", "squared activation units")
    ax.set_title("loss vs context FFN inputs")
    return drawn


@styled
def plot_anisotropy(table: pd.DataFrame, ax=None, roles: Sequence[str] = ("context", "masked", "special", LOSS),
                    width: str | float = "single") -> list:
    """Mean pairwise cosine of hidden states vs layer, one line per role."""
    ax = _axes(ax, width)
    drawn = _role_lines(ax, table, "mean_pairwise_cosine", roles)
    _finish(ax, drawn, LAYER_LABEL, "mean pairwise cosine")
    ax.set_title("anisotropy")
    return drawn


@styled
def plot_transformation(table: pd.DataFrame, ax=None, roles: Sequence[str] = ("context", LOSS),
                        width: str | float = "single") -> list:
    """Relative change each block makes to a position's hidden state (mean +- std), last block shaded."""
    ax = _axes(ax, width)
    drawn = []
    offsets = np.linspace(-0.12, 0.12, len(roles)) if len(roles) > 1 else [0.0]
    for off, role in zip(offsets, roles):
        d = table[table["role"] == role].sort_values("layer")
        if d.empty:
            continue
        bars = ax.errorbar(d["layer"] + off, d["rel_change_mean"], yerr=d["rel_change_std"], marker="o",
                           color=role_color(role), label=role_label(role), linestyle="-",
                           gid=f"transformation:{role}")
        drawn.append(bars)
    last = table.loc[table["last_block"].astype(bool), "layer"]
    if not last.empty:
        drawn.append(ax.axvspan(float(last.iloc[0]) - 0.4, float(last.iloc[0]) + 0.4, color="#DDDDDD", zorder=0,
                                linewidth=0, gid="transformation:last_block"))
    ax.set_ylim(bottom=0)
    _finish(ax, drawn, "block (last shaded)", r"$\|h_i - h_{i-1}\| \,/\, \|h_{i-1}\|$")
    ax.set_title("how much each block changes a channel")
    return drawn


FIGURES: dict[str, tuple[str, Callable[..., list]]] = {
    "logit_lens": ("logit_lens", plot_logit_lens),
    "input_shift": ("input_shift", plot_input_shift),
    "frechet": ("input_shift", plot_frechet),
    "anisotropy": ("anisotropy", plot_anisotropy),
    "transformation": ("transformation", plot_transformation),
}
"""Figure name -> (table it draws, plot function)."""


def plot_diagnostics(tables: dict[str, pd.DataFrame], out_dir: str | Path,
                     formats: Sequence[str] = ("pdf", "png")) -> list[Path]:
    """One figure per diagnostic (``<name>.<fmt>`` in ``out_dir``, see :data:`FIGURES`); returns paths."""
    paths: list[Path] = []
    for name, (table, plot) in FIGURES.items():
        frame = tables.get(table)
        if frame is None or frame.empty:
            continue
        with gradflow_style("single"):
            ax = _axes(None)
            plot(frame, ax=ax)
            paths += save_figure(ax.figure, Path(out_dir) / name, formats)
            plt.close(ax.figure)
    return paths
