"""The counterfactual context pressure of the last block: its figure and its ``summary.md`` section.

Draws the tables of :func:`gradflow.analysis.context_pressure` (one per run; several runs share
one axis, e.g. an MLM-trained model next to its all-token twin). Reports include both only for
runs recorded under a loss other than ``mlm`` (``--loss all-positions``): under the MLM loss the
numbers are the actual context signal, not the counterfactual pressure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from gradflow.analysis.pressure import context_pressure
from gradflow.analysis.run_data import Run
from gradflow.figures.canvas import (
    finish_log_panel,
    log_floor_markers,
    new_axes,
    sublayer_ticklabel,
)
from gradflow.figures.style import RUN_HATCHES, RUN_MARKERS, role_color, shade, styled
from gradflow.formatting import fixed_column
from gradflow.schema import SUBLAYER_SEQUENCES_FILE, sorted_sublayers

PRESSURE_FIGURE = "context_pressure"
"""Stem of the figure and of the table (``tables/context_pressure.csv``) in a report."""


def pressure_tables(runs: Sequence[Run], labels: Sequence[str], n_resamples: int = 2000,
                    seed: int | None = 0) -> dict[str, pd.DataFrame]:
    """Label -> :func:`context_pressure` table of each run; empty unless every run was recorded under a
    loss other than ``mlm`` and has ``sublayer_sequences.parquet``."""
    if not runs or any(run.meta.get("loss") in (None, "mlm") or not (run.path / SUBLAYER_SEQUENCES_FILE).is_file()
                       for run in runs):
        return {}
    return {label: context_pressure(run, n_resamples, seed) for label, run in zip(labels, runs)}


def pressure_csv(tables: Mapping[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """``{"context_pressure": every run's rows with a leading label column}`` (empty without tables)."""
    if not tables:
        return {}
    return {PRESSURE_FIGURE: pd.concat([t.assign(label=lab)[["label", *t.columns]] for lab, t in tables.items()],
                                       ignore_index=True)}


@styled
def pressure_bars(tables: Mapping[str, pd.DataFrame], ax: Axes | None = None, legend: bool = True,
                  width: str | float = "single", title: str | None = None) -> list[Artist]:
    """Per sublayer of the last block: each run's context pressure (bar, 95% CI) and its earlier blocks' (dots).

    ``tables``: label -> :func:`gradflow.analysis.context_pressure` table. Bars (gid
    ``pressure:<label>``) carry bootstrap CIs; the dots (gid ``earlier:<label>``) are the same
    sublayer's pressure in each earlier block and the short line their mean. Log y axis (exact
    zeros as triangles on the floor); the dashed line at 1 is "a context position sends as much
    as a loss position". Returns the bars, error bars, dots, mean lines, reference line and legend.
    """
    ax = new_axes(ax, width, 0.62)
    lasts = {lab: t[t["last_block"]] for lab, t in tables.items()}
    subs = sorted_sublayers([s for t in lasts.values() for s in t["sublayer"]])
    x = np.arange(len(subs))
    n = max(len(tables), 1)
    w = 0.8 / n
    drawn: list[Artist] = []
    handles: list[Artist] = []
    any_zero = False
    for k, (label, table) in enumerate(tables.items()):
        color = shade(role_color("context"), k, n)
        last = lasts[label].set_index("sublayer").reindex(subs)
        xs = x - 0.4 + w * (k + 0.5)
        value = last["pressure"].to_numpy(float)
        err = np.vstack([value - last["ci_low"].to_numpy(float), last["ci_high"].to_numpy(float) - value])
        bars = ax.bar(xs, np.where(value > 0, value, np.nan), w * 0.92, color=color, hatch=RUN_HATCHES[k % 6],
                      edgecolor="white", linewidth=0.4, label=label, gid=f"pressure:{label}")
        ci = ax.errorbar(xs, value, yerr=np.clip(np.nan_to_num(err), 0, None), fmt="none", ecolor="#333333",
                         elinewidth=0.7, capsize=1.5)
        for artist in (*ci.lines[1], *ci.lines[2]):
            artist.set_gid(f"ci:{label}")
        drawn += [*bars.patches, *ci.lines[1], *ci.lines[2]]
        zero = value == 0
        if zero.any():
            any_zero = True
            drawn.append(log_floor_markers(ax, xs[zero], color, f"pressure:{label}:zero"))
        earlier = table[~table["last_block"] & table["sublayer"].isin(subs)]
        ex = xs[[subs.index(s) for s in earlier["sublayer"]]]
        positive = earlier["pressure"].to_numpy(float) > 0
        (dots,) = ax.plot(ex[positive], earlier["pressure"].to_numpy(float)[positive], linestyle="none",
                          marker=RUN_MARKERS[k % 6], markersize=2.6, markerfacecolor="white",
                          markeredgecolor="#333333", markeredgewidth=0.6, gid=f"earlier:{label}")
        mean = last["earlier_mean"].to_numpy(float)
        lines = ax.hlines(mean, xs - w * 0.42, xs + w * 0.42, colors="#222222", linewidth=1.0, gid=f"mean:{label}")
        drawn += [dots, lines]
        handles.append(Patch(facecolor=color, hatch=RUN_HATCHES[k % 6], edgecolor="white", label=label))
    handles += [Line2D([], [], linestyle="none", marker="o", markersize=2.6, markerfacecolor="white",
                       markeredgecolor="#333333", markeredgewidth=0.6, label="earlier blocks"),
                Line2D([], [], color="#222222", linewidth=1.0, label="their mean")]
    drawn.append(ax.axhline(1.0, color="#777777", linestyle="--", linewidth=0.6, zorder=0, gid="reference"))
    ax.set_yscale("log")
    ax.set_xticks(x, [sublayer_ticklabel(s) for s in subs])
    ax.tick_params(axis="x", length=0)
    ax.set_xlim(-0.6, len(x) - 0.4)
    return finish_log_panel(ax, drawn, "context pressure\n(context / loss, per position)", title,
                            handles if legend else [], any_zero)


def pressure_section(tables: Mapping[str, pd.DataFrame], n_resamples: int, seed: int | None) -> list[str]:
    """Lines of the ``summary.md`` section on the last block's context pressure (none without tables)."""
    if not tables:
        return []
    layers = sorted({int(t.loc[t["last_block"], "layer"].iloc[0]) for t in tables.values() if t["last_block"].any()})
    where = f" (layer {layers[0]})" if len(layers) == 1 else ""
    lines = [f"## Counterfactual context pressure: last block{where}", "",
             "Recorded under a loss at every position: the per-position weight-gradient signal of context positions "
             "over that of the loss positions (masked + random + kept, pooled by position count), i.e. how much each "
             "sublayer would learn from context channels if trained on them. \"Earlier\" is the mean of the same "
             "sublayer's pressure over the earlier blocks; \"× earlier\" is the last block's pressure over it. 95% "
             f"percentile bootstrap CIs over sequences ({n_resamples} resamples, seed {seed}).", ""]
    prefix = (lambda lab: f"{lab}: ") if len(tables) > 1 else (lambda lab: "")
    header = ["sublayer"] + [f"{prefix(lab)}{h}" for lab in tables
                             for h in ("pressure [95% CI]", "earlier", "× earlier [95% CI]")]
    lasts = {lab: t[t["last_block"]].set_index("sublayer") for lab, t in tables.items()}
    subs = sorted_sublayers([s for t in lasts.values() for s in t.index])
    columns: list[list[str]] = []
    for last in lasts.values():  # fixed decimals per column (gradflow.formatting.fixed_column)
        r = last[~last.index.duplicated()].reindex(subs)
        columns += [fixed_column(r["pressure"], r["ci_low"], r["ci_high"]), fixed_column(r["earlier_mean"]),
                    fixed_column(r["vs_earlier"], r["vs_earlier_ci_low"], r["vs_earlier_ci_high"])]
    rows = [[sub, *(column[k] for column in columns)] for k, sub in enumerate(subs)]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


__all__ = ["PRESSURE_FIGURE", "pressure_bars", "pressure_csv", "pressure_section", "pressure_tables"]
