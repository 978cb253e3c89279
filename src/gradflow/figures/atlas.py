"""Atlas figures: every model of an ``atlas.csv`` on one normalised depth axis (column width, PDF + PNG).

- ``atlas_context_ratio``: context / loss gradient-norm ratio against depth (0 = embeddings, 1 = last
  block), one line per model with its 95% band; the last block's exact zero sits on the axis.
- ``atlas_last_block_shares``: the last block's context share per sublayer, one bar per model (an
  exact zero is marked with an open circle on the axis), the earlier blocks' mean as a tick; for a
  weight-shared model (ALBERT) the bar is the last *application* and an open diamond gives the shared
  weight's context share over all its applications (``shared_context_share:<sublayer>``).
- ``atlas_probes_<task>`` (models probed on the task): test accuracy against depth with 95% bands.
- ``atlas_pressure`` (models recorded under the all-positions loss): the last block's pressure per sublayer.
- ``atlas_skippable``: the share of a batch's matmul FLOPs the last block spends where it gets no gradient.

Colours are models (Paul Tol's bright palette, colour-blind safe), each with its own marker too.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from gradflow.figures.canvas import save_figure
from gradflow.figures.style import RUN_MARKERS, figure_width, gradflow_style, series_color

DEPTH_LABEL = "depth (0 = embeddings, 1 = last block)"


def _models(frame: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(frame["model"]))


def _legend(fig, models: Sequence[str], all_models: Sequence[str], extra: Sequence[Line2D] = ()) -> None:
    handles = [Line2D([], [], color=series_color(all_models.index(m)), linestyle="-", markersize=3.5,
                      marker=RUN_MARKERS[all_models.index(m) % len(RUN_MARKERS)], label=m) for m in models]
    handles += extra
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 2),
               frameon=False, fontsize="small")


def _figure(width: str | float, n_models: int, aspect: float = 0.62):
    w = figure_width(width)
    legend_rows = (n_models + 1) // 2
    return plt.subplots(figsize=(w, w * aspect + 0.16 * legend_rows), layout="constrained")


def depth_lines(frame: pd.DataFrame, metric: str, ylabel: str, title: str, all_models: Sequence[str],
                width: str | float = "single"):
    """One line per model of ``metric`` against depth (with its CI band where it has one)."""
    rows = frame[frame["metric"] == metric]
    models = _models(rows)
    fig, ax = _figure(width, len(models))
    for model in models:
        d = rows[rows["model"] == model].sort_values("depth_fraction")
        k = all_models.index(model)
        x = d["depth_fraction"].to_numpy(float)
        ax.plot(x, d["value"].to_numpy(float), color=series_color(k), marker=RUN_MARKERS[k % len(RUN_MARKERS)],
                markersize=3, linewidth=1.2, gid=f"atlas:{model}:{metric}")
        if d["ci_low"].notna().any():
            ax.fill_between(x, d["ci_low"].to_numpy(float), d["ci_high"].to_numpy(float), color=series_color(k),
                            alpha=0.18, linewidth=0)
    ax.set_xlabel(DEPTH_LABEL)
    ax.set_ylabel(ylabel)
    ax.set_xticks(np.linspace(0, 1, 5))
    ax.set_xlim(-0.02, 1.02)
    ax.set_title(title, loc="left", fontsize="medium")
    _legend(fig, models, all_models)
    return fig


def last_block_bars(frame: pd.DataFrame, kind: str, ylabel: str, title: str, all_models: Sequence[str],
                    width: str | float = "single"):
    """Per sublayer, the last block's ``kind:<sublayer>`` value, one bar per model; earlier blocks' mean as a tick."""
    def of_kind(name: str) -> pd.DataFrame:
        picked = frame[frame["metric"].str.startswith(name + ":")]
        return picked.assign(sublayer=picked["metric"].str.split(":").str[1])

    rows, shared = of_kind(kind), of_kind("shared_" + kind)  # shared: weight-shared models, over all applications
    models = _models(rows)
    sublayers = list(dict.fromkeys(rows["sublayer"]))
    fig, ax = _figure(width, len(models) + (not shared.empty))
    step = 0.8 / max(len(models), 1)
    for j, model in enumerate(models):
        k = all_models.index(model)
        d = rows[rows["model"] == model]
        last = d[np.isclose(d["depth_fraction"], 1.0)].set_index("sublayer")["value"]
        earlier = d[d["depth_fraction"] < 1.0].groupby("sublayer")["value"].mean()
        x = np.arange(len(sublayers)) - 0.4 + step * (j + 0.5)
        values = np.array([last.get(s, np.nan) for s in sublayers], dtype=float)
        ax.bar(x, values, width=step, color=series_color(k), gid=f"atlas:{model}:{kind}")
        zero = values == 0.0
        if zero.any():  # an empty unclipped line sits at the figure's origin and squeezes the constrained layout
            ax.plot(x[zero], values[zero], linestyle="none", marker="o", markersize=2.6, markerfacecolor="white",
                    markeredgecolor=series_color(k), markeredgewidth=0.8, clip_on=False)
        total = shared[shared["model"] == model].set_index("sublayer")["value"]
        total = np.array([total.get(s, np.nan) for s in sublayers], dtype=float)
        if np.isfinite(total).any():
            ok = np.isfinite(total)
            ax.plot(x[ok], total[ok], linestyle="none", marker="D", markersize=3, markerfacecolor="white",
                    markeredgecolor=series_color(k), markeredgewidth=0.8, clip_on=False, gid=f"atlas:{model}:shared")
        ticks = np.array([earlier.get(s, np.nan) for s in sublayers], dtype=float)
        ax.plot(x, ticks, linestyle="none", marker="_", markersize=max(16 * step, 3), color="black",
                markeredgewidth=1.0)
    ax.set_xticks(np.arange(len(sublayers)), sublayers, rotation=45, ha="right", fontsize="small")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title, loc="left", fontsize="medium")
    note = [Line2D([], [], linestyle="none", marker="D", markersize=3, markerfacecolor="white", markeredgecolor="black",
                   label=f"{', '.join(_models(shared))}: shared weights, all applications (bar: the last)")]
    _legend(fig, models, all_models, note if not shared.empty else ())
    return fig


def skippable_bars(frame: pd.DataFrame, all_models: Sequence[str], width: str | float = "single"):
    """The check's skippable share of a batch's matmul FLOPs (percent), one bar per model."""
    rows = frame[frame["metric"] == "skippable_flop_share"]
    models = _models(rows)
    w = figure_width(width)
    fig, ax = plt.subplots(figsize=(w, 0.5 + 0.22 * len(models)), layout="constrained")
    values = [100 * float(rows.loc[rows["model"] == m, "value"].iloc[0]) for m in models]
    y = np.arange(len(models))
    ax.barh(y, values, color=[series_color(all_models.index(m)) for m in models])
    for yi, v in zip(y, values):
        ax.text(v, yi, f" {v:.1f}%", va="center", fontsize="small")
    ax.set_yticks(y, models, fontsize="small")
    ax.invert_yaxis()
    ax.set_xlim(0, max(values + [1.0]) * 1.25)
    ax.set_xlabel("skippable share of matmul FLOPs (%)")
    ax.set_title("last block, unselected positions", loc="left", fontsize="medium")
    return fig


def write_atlas_figures(frame: pd.DataFrame, out_dir: str | Path, formats: Sequence[str] = ("pdf", "png"),
                        width: str | float = "single") -> list[Path]:
    """Every atlas figure the table has data for, into ``out_dir``; returns the paths written."""
    out = Path(out_dir)
    all_models = _models(frame)
    metrics = set(frame["metric"])
    plans = [("atlas_context_ratio", lambda: depth_lines(
        frame, "context_loss_ratio", "context / loss gradient norm", "context vs loss positions", all_models, width))]
    if any(m.startswith("context_share:") for m in metrics):
        plans.append(("atlas_last_block_shares", lambda: last_block_bars(
            frame, "context_share", "context share (last block)", "last block's context share; tick: earlier blocks",
            all_models, width)))
    for metric in sorted(m for m in metrics if m.startswith("probe_accuracy:")):
        task = metric.split(":", 1)[1]
        plans.append((f"atlas_probes_{task}", lambda metric=metric, task=task: depth_lines(
            frame, metric, "probe test accuracy", f"linear probes: {task}", all_models, width)))
    if any(m.startswith("pressure:") for m in metrics):
        plans.append(("atlas_pressure", lambda: last_block_bars(
            frame, "pressure", "context pressure (last block)", "all-positions loss; tick: earlier blocks",
            all_models, width)))
    if "skippable_flop_share" in metrics:
        plans.append(("atlas_skippable", lambda: skippable_bars(frame, all_models, width)))
    paths: list[Path] = []
    for stem, draw in plans:
        with gradflow_style(width):
            fig = draw()
            paths += save_figure(fig, out / stem, formats)
            plt.close(fig)
    return paths


__all__ = ["depth_lines", "last_block_bars", "skippable_bars", "write_atlas_figures"]
