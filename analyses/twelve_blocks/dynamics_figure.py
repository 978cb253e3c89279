"""The deficit through pretraining (issue 31): ``dynamics.csv`` -> one multi-panel figure and its table.

Reads the committed measurements (:mod:`analyses.twelve_blocks.dynamics`; no model is loaded) and writes
``<out>/dynamics.{pdf,png}`` (each measure against pretraining tokens, log x, both models; 95% CIs as
bands) and ``<out>/dynamics.md`` (one row per model and snapshot). A table whose ``meta.json`` says
``partial`` gets a banner on the figure and a note above the table.

    python -m analyses.twelve_blocks.dynamics_figure [--table figures/twelve-blocks/dynamics/dynamics.csv]
        [--out figures/twelve-blocks/dynamics]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from gradflow.figures import add_banner, save_figure
from gradflow.figures.style import gradflow_style, series_color
from gradflow.figures.tables import TextTable, markdown_table
from gradflow.formatting import MISSING, format_estimate

TABLE = "figures/twelve-blocks/dynamics/dynamics.csv"
OUT = "figures/twelve-blocks/dynamics"
STEM = "dynamics"
SUBLAYERS = ("attn.q", "ffn.in")  # the last block's sublayers drawn (every one is in the CSV)
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D")
PROBE_METRICS = {"accuracy": "last-layer probe drop, accuracy",
                 "code_length_bits": "last-layer probe drop, code length (bits)"}
# What each drop is (gradflow.analysis.probes.last_layer_drop, code_length_drop): above 0 the last layer is the better
# feature in both, so the accuracy drop is last minus best earlier, the code-length drop best earlier minus last (bits)
PROBE_YLABELS = {"accuracy": "last - best earlier layer", "code_length_bits": "best earlier - last layer (bits)"}
SIGN_NOTE = ("drop: the last layer's advantage over the best earlier layer, above 0 when the last layer is the better "
             "feature (accuracy: last minus best earlier; code length: the best earlier layer's bits minus the last "
             "layer's, so below 0 the last layer needs more bits).")


def read_table(path: str | Path) -> pd.DataFrame:
    """``dynamics.csv`` with ``detail`` and ``sha256`` as text."""
    return pd.read_csv(path, keep_default_na=False, na_values=[""], dtype={"sha256": str, "detail": str})


def ratio_layers(table: pd.DataFrame) -> list[int]:
    """The depths drawn for the context/loss ratio: 1, L/2 and L-1 (L: the last block), distinct."""
    ratio = table[table["measure"] == "context_loss_ratio"]
    if ratio.empty:
        return []
    last = int(ratio["layer"].max())
    return sorted({k for k in (1, round(last / 2), last - 1) if 1 <= k < last})


def _lines(ax: Axes, table: pd.DataFrame, models: Sequence[str], keys: Sequence[tuple[str, object]],
           key_labels: Sequence[str]) -> list[Line2D]:
    """One line per (model, key) of value vs tokens with a CI band; colour: model, dash: key."""
    drawn: list[Line2D] = []
    for m, model in enumerate(models):
        for k, (column, key) in enumerate(keys):
            rows = table[(table["model"] == model) & (table[column] == key)].sort_values("tokens")
            if rows.empty:
                continue
            x = rows["tokens"].to_numpy(float)
            (line,) = ax.plot(x, rows["value"], color=series_color(m), linestyle=LINESTYLES[k % len(LINESTYLES)],
                              marker=MARKERS[m % len(MARKERS)], markersize=2.5, label=f"{model} {key_labels[k]}")
            y, low, high = (rows[c].to_numpy(float) for c in ("value", "ci_low", "ci_high"))
            ax.fill_between(x, low, high, color=series_color(m), alpha=0.15, linewidth=0)
            ax.errorbar(x, y, yerr=np.clip([y - low, high - y], 0, None), fmt="none", ecolor=series_color(m),
                        elinewidth=0.6)  # the CI of a lone snapshot too (a band needs two)
            drawn.append(line)
    ax.set_xscale("log")
    # ticks at 1 and 3 per decade, labelled 300k / 1M / 3M: matplotlib's own labels of a range under a
    # decade are mathtext minor labels (3 x 10^5 4 x 10^5) that run into each other at column width
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 3.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(compact_count))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("pretraining tokens")
    return drawn


def compact_count(value: float, _position: object = None) -> str:
    """A count as a short tick label: 300 -> "300", 300,000 -> "300k", 3,000,000 -> "3M"."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


def _dash_legend(ax: Axes, labels: Sequence[str]) -> None:
    handles = [Line2D([], [], color="#555555", linestyle=LINESTYLES[k % len(LINESTYLES)], label=label)
               for k, label in enumerate(labels)]
    if handles:
        ax.legend(handles=handles, fontsize=5.5, loc="best", frameon=False, handlelength=2.2)


def _empty(ax: Axes, title: str) -> None:
    ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title)


def draw(table: pd.DataFrame, partial: bool = False) -> tuple[Figure, dict[str, list[Line2D]]]:
    """The figure (2 x 3 panels at double width) and the lines drawn per panel."""
    models = list(dict.fromkeys(table["model"]))
    drawn: dict[str, list[Line2D]] = {}
    with gradflow_style("double"):
        fig, grid = plt.subplots(2, 3, figsize=(7.0, 4.6), layout="constrained")
        ax_ratio, ax_pressure, ax_vs, ax_acc, ax_bits, ax_key = grid.ravel()
        ratio = table[table["measure"] == "context_loss_ratio"]
        layers = ratio_layers(table)
        title = "context/loss gradient-norm ratio (MLM)"
        if layers:
            drawn["ratio"] = _lines(ax_ratio, ratio, models, [("layer", k) for k in layers],
                                    [f"layer {k}" for k in layers])
            ax_ratio.set_title(title)
            ax_ratio.set_ylabel("ratio")
            _dash_legend(ax_ratio, [f"layer {k}" for k in layers])
        else:
            _empty(ax_ratio, title)
        pressure = table[table["measure"] == "pressure"]
        subs = [s for s in SUBLAYERS if s in set(pressure["detail"])]
        for ax, metric, title, ylabel in ((ax_pressure, "pressure", "last block: context pressure", "pressure"),
                                          (ax_vs, "vs_earlier", "last block / earlier blocks",
                                           "pressure ratio")):
            rows = pressure[pressure["metric"] == metric]
            if rows.empty or not subs:
                _empty(ax, title)
                continue
            drawn[metric] = _lines(ax, rows, models, [("detail", s) for s in subs], subs)
            ax.set_title(title)
            ax.set_ylabel(ylabel)
            _dash_legend(ax, subs)
        ax_vs.axhline(1.0, color="#999999", linewidth=0.6, zorder=0)
        probes = table[table["measure"] == "probe_drop"]
        tasks = list(dict.fromkeys(probes["detail"]))
        for ax, (metric, title) in zip((ax_acc, ax_bits), PROBE_METRICS.items()):
            rows = probes[probes["metric"] == metric]
            if rows.empty:
                _empty(ax, title)
                continue
            drawn[metric] = _lines(ax, rows, models, [("detail", t) for t in tasks], tasks)
            ax.axhline(0.0, color="#999999", linewidth=0.6, zorder=0)
            ax.set_title(title)
            ax.set_ylabel(PROBE_YLABELS[metric])
            _dash_legend(ax, tasks)
        ax_key.set_axis_off()
        handles = [Line2D([], [], color=series_color(m), marker=MARKERS[m % len(MARKERS)], markersize=3, label=model)
                   for m, model in enumerate(models)]
        ax_key.legend(handles=handles, loc="center", frameon=False, title="model (bars, bands: 95% CI)")
        if partial:
            add_banner(fig, "partial: not every planned snapshot is measured (meta.json)")
    return fig, drawn


def table_rows(table: pd.DataFrame) -> TextTable:
    """One row per model and snapshot: the ratio at the drawn depths, the drawn sublayers' pressure, the drops."""
    layers = ratio_layers(table)
    columns: list[tuple[str, str, str, object]] = [("context_loss_ratio", "out", "ratio", k) for k in layers]
    header = [f"context/loss ratio, layer {k}" for k in layers]
    pressure = table[table["measure"] == "pressure"]
    for metric, name in (("pressure", "pressure"), ("vs_earlier", "pressure vs earlier")):
        for sub in [s for s in SUBLAYERS if s in set(pressure["detail"])]:
            columns.append(("pressure", sub, metric, None))
            header.append(f"last block {name}, {sub}")
    probes = table[table["measure"] == "probe_drop"]
    for task in dict.fromkeys(probes["detail"]):
        for metric in PROBE_METRICS:
            if ((probes["detail"] == task) & (probes["metric"] == metric)).any():
                columns.append(("probe_drop", task, metric, None))
                header.append(f"{task} drop, {'accuracy' if metric == 'accuracy' else 'bits'}")
    rows = []
    for (model, step), group in table.groupby(["model", "step"], sort=False):
        cells: list[str] = [str(model), str(step), f"{int(group['tokens'].iloc[0]):,}"]
        for measure, detail, metric, layer in columns:
            hit = group[(group["measure"] == measure) & (group["detail"] == detail) & (group["metric"] == metric)]
            if layer is not None:
                hit = hit[hit["layer"] == layer]
            cells.append(MISSING if hit.empty else format_estimate(*hit[["value", "ci_low", "ci_high"]].iloc[0]))
        rows.append(tuple(cells))
    return TextTable(("model", "step", "tokens", *header), tuple(rows))


def write(table: pd.DataFrame, out: Path, partial: bool = False) -> list[Path]:
    """Figure (PDF, PNG) and Markdown table of ``table`` into ``out``; returns the files."""
    out.mkdir(parents=True, exist_ok=True)
    table = table.sort_values(["model", "step"], kind="stable")
    fig, _ = draw(table, partial)
    try:
        paths = save_figure(fig, out / STEM)
    finally:
        plt.close(fig)
    note = ["*Partial: not every planned snapshot is measured (see meta.json).*", ""] if partial else []
    lines = [f"# The last block's deficit through pretraining ({', '.join(dict.fromkeys(table['model']))})", "",
             *note, *markdown_table(table_rows(table)), "",
             "Cells: value [95% CI]. Ratio: context / loss-position gradient norm at the block output (MLM loss); "
             "pressure: the last block's context pressure under the all-positions loss; " + SIGN_NOTE]
    md = out / f"{STEM}.md"
    md.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [*paths, md]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", type=Path, default=Path(TABLE), help="dynamics.csv to draw (default %(default)s)")
    p.add_argument("--out", type=Path, default=Path(OUT), help="folder for the figure and table (default %(default)s)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.table.is_file():
        print(f"error: {args.table} does not exist; measure first (make -C analyses twelve-blocks-measure)",
              file=sys.stderr)
        return 2
    meta_file = args.table.parent / "meta.json"
    partial = bool(json.loads(meta_file.read_text(encoding="utf-8")).get("partial", True)) if meta_file.is_file() \
        else True
    table = read_table(args.table)
    if table.empty or not np.isfinite(table["tokens"]).all():
        print(f"error: {args.table} has no measurements", file=sys.stderr)
        return 2
    for path in write(table, args.out, partial):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
