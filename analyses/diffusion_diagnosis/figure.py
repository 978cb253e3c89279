"""The figure of the gradient flow during training (``figures/diffusion-diagnosis/plan.md``, rule 6; issue 60).

One column per cell (seed 0 by default: ``base``, the recipe and ``bert15``), one row per measure against the
optimizer step, each row on one shared y range:

a. all-[MASK] top-1 at t = 0.15 (the runs' JSON checkpoints: 128 validation windows, 1,024 at the last step and a
   long run's budgets, drawn as open circles), with the unigram stage's reference (predicting the most frequent token scores 0.060);
b. the context / loss-position gradient-norm ratio per layer (0 = embeddings output, 1-6 = block outputs; probe
   ``t0.15``), log y: the last block's output is exactly 0 by construction (after the last block nothing mixes
   positions), drawn as triangles on the axis floor ("exactly 0");
c. representation collapse per layer (mean cosine similarity of different tokens' hidden states; probe ``t0.15``);
d. attention entropy over uniform attention's (``attention_entropy / attention_entropy_max``) per block 1-6
   (probe ``t0.15``);
e. the word-embedding matrix's gradient norm (Frobenius) by the role of the position that looked the row up, and the
   output layer's part (probe ``own``: the cell's own corruption and loss), log y. A role with no position in a
   cell (all zeros: ``kept`` without kept tokens) is left out of that panel; other exact zeros are floor triangles.

Layers are coloured on viridis (0 = the embeddings output, purple, to the last block's output, yellow-green), roles
in the repository's role colours (the output layer dashed black). The x axis is ``log(1 + step / 25)``
(:data:`STEP_OFFSET`), so steps 0-100 take half the width. What the figure shows is described on the results page;
it decides nothing.

    python -m analyses.diffusion_diagnosis.figure --cells base RECIPE bert15  # -> figures/.../training_flow.{pdf,png}
    python -m analyses.diffusion_diagnosis.figure --cells base RECIPE@figures/diffusion-diagnosis/full bert15
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from analyses.diffusion_diagnosis.cells import cell
from gradflow.figures.canvas import floor_marker_shifts, log_floor_markers, log_format, zero_proxy
from gradflow.figures.fitting import wrap_text
from gradflow.figures.mask_ratio import FLOOR_ROOM
from gradflow.figures.style import gradflow_style, role_color

DEFAULT_CELLS = ("base", "untied-zero", "bert15")
"""The columns until the recipe is chosen (plan rule 4): the CLI's caller passes the recipe instead."""
DEFAULT_OUT = Path("figures/diffusion-diagnosis/training_flow")
MOST_FREQUENT = 0.060
"""All-[MASK] top-1 at t = 0.15 of predicting the most frequent token (the plan: the unigram stage)."""
STEP_OFFSET = 25.0
"""The x axis is log(1 + step / STEP_OFFSET) (steps): linear below about 25 steps, logarithmic above."""
STEP_TICKS = (0, 25, 50, 100, 300, 600)
LONG_STEP_TICKS = (0, 100, 600)
"""The ticks when a column runs past 1,000 steps (25 and 50 would collide), beside the last step."""
INPUT_ROLES = ("masked", "random", "kept", "context")
"""Input-side roles of the embedding panel (a role is drawn where the cell has such positions)."""
OUTPUT_COLOR = "#000000"
ROW_LABELS = ("all-[MASK] top-1\n(t = 0.15)", "context / loss\ngradient norm", "collapse\n(mean cosine)",
              "attention entropy\n/ uniform", "embedding-matrix\ngradient norm")
FIGURE_WIDTH = 7.0
"""Inches: full page width."""
ROW_HEIGHT = 1.45
"""Inches per measure row (the first row also holds the column titles)."""
VIRIDIS_TOP = 0.88
"""Layers take viridis from 0 (layer 0, purple) to this point (the deepest), short of its pale yellow end."""
TRAIN_COMMAND = "python -m analyses.diffusion_diagnosis.train --cells {cell} --seeds {seed} --out {runs}"


@dataclass(frozen=True)
class Run:
    """One run's files read: ``checkpoints`` (one row per measured step: ``step``, ``mask15_top1``, ...) and
    ``rows`` (the snapshots' tidy rows with an integer ``layer``: 0 = embeddings, i + 1 = ``blocks.{i}``, -1 for
    groups that are not layers)."""

    cell: str
    seed: int
    checkpoints: pd.DataFrame
    rows: pd.DataFrame


def run_files(runs: Path, name: str, seed: int) -> tuple[Path, Path]:
    """(JSON, CSV) of cell ``name``'s run from ``seed`` under ``runs``."""
    return runs / f"{name}-s{seed}.json", runs / f"{name}-s{seed}.csv"


def layer_of(group: str) -> int:
    """The layer of a snapshot group: ``embeddings`` 0, ``blocks.{i}`` i + 1, anything else -1."""
    if group == "embeddings":
        return 0
    if group.startswith("blocks.") and group[7:].isdigit():
        return int(group[7:]) + 1
    return -1


def load_run(runs: Path, name: str, seed: int) -> Run:
    """Read cell ``name``'s run from ``seed``; a missing file is a :class:`FileNotFoundError` naming it and the
    command that makes it (a CSV without its JSON is a run still training or cut). ``CELL@DIR`` reads the run from
    ``DIR`` instead (rule 4's full-length runs), its partial JSON while it trains."""
    if "@" in name:
        name, runs = name.split("@", 1)
        runs = Path(runs)
        partial = runs / f"{name}-s{seed}.partial.json"
        if not run_files(runs, name, seed)[0].exists() and partial.exists():
            record = json.loads(partial.read_text(encoding="utf-8"))
            rows = pd.read_csv(run_files(runs, name, seed)[1])
            rows = rows[rows["step"] <= record["checkpoints"][-1]["step"]].copy()
            rows["layer"] = rows["group"].map(layer_of)
            checkpoints = pd.DataFrame(record["checkpoints"])
            if "own_loss" not in checkpoints:  # still training, no budget reached: every row on 128 windows
                checkpoints["own_loss"] = float("nan")
            return Run(name, seed, checkpoints, rows)
    cell(name)  # an unknown cell name fails here, naming the cells
    for path in run_files(runs, name, seed):
        if not path.exists():
            raise FileNotFoundError(
                f"missing run file {path} (cell {name}, seed {seed}): make it with "
                f"`{TRAIN_COMMAND.format(cell=name, seed=seed, runs=runs)}` (a CSV without its JSON is a run "
                "still training or cut; the command starts it again)")
    record = json.loads(run_files(runs, name, seed)[0].read_text(encoding="utf-8"))
    rows = pd.read_csv(run_files(runs, name, seed)[1])
    rows["layer"] = rows["group"].map(layer_of)
    return Run(name, seed, pd.DataFrame(record["checkpoints"]), rows)


def series(rows: pd.DataFrame, quantity: str, probe: str, role: str = "all") -> dict[int, pd.Series]:
    """layer -> ``quantity``'s value by step (a Series indexed by step) for ``probe`` and ``role``."""
    sel = rows[(rows["quantity"] == quantity) & (rows["probe"] == probe) & (rows["role"] == role)
               & (rows["layer"] >= 0)]
    return {int(k): g.set_index("step")["value"].sort_index() for k, g in sel.groupby("layer")}


def entropy_ratio(rows: pd.DataFrame, probe: str = "t0.15") -> dict[int, pd.Series]:
    """block (1..L) -> attention entropy over its uniform value (both nats; a ratio in [0, 1]) by step."""
    entropy, uniform = series(rows, "attention_entropy", probe), series(rows, "attention_entropy_max", probe)
    return {layer: entropy[layer] / uniform[layer] for layer in entropy}


def embedding_roles(rows: pd.DataFrame, probe: str = "own") -> dict[str, pd.Series]:
    """role -> the word-embedding matrix's gradient norm by step: the input roles of :data:`INPUT_ROLES` with a
    non-zero value at some step (a role without positions is all zeros), then ``output``."""
    sel = rows[(rows["group"] == "embeddings.word") & (rows["quantity"] == "embedding_grad_norm")
               & (rows["probe"] == probe)]
    out = {}
    for role in (*INPUT_ROLES, "output"):
        values = sel[sel["role"] == role].set_index("step")["value"].sort_index()
        if len(values) and (role == "output" or bool((values != 0).any())):
            out[role] = values
    return out


def layer_colors(layers: Sequence[int]) -> dict[int, tuple[float, float, float, float]]:
    """Layer -> its colour, evenly spaced on viridis (colour-blind safe, monotone in lightness) up to
    :data:`VIRIDIS_TOP`: seven layers stay apart where their lines cross."""
    import matplotlib

    ordered = sorted(set(layers))
    spots = np.linspace(0.0, VIRIDIS_TOP, len(ordered)) if len(ordered) > 1 else np.array([0.0])
    return {layer: matplotlib.colormaps["viridis"](float(s)) for layer, s in zip(ordered, spots)}


def step_scale(ax: Axes, last: int) -> None:
    """The x axis log(1 + step / :data:`STEP_OFFSET`) from 0 to ``last`` steps (3% margins), plain step ticks."""
    ax.set_xscale("function", functions=(lambda x: np.log1p(np.maximum(x, -0.99 * STEP_OFFSET) / STEP_OFFSET),
                                         lambda y: STEP_OFFSET * np.expm1(y)))
    span = np.log1p(last / STEP_OFFSET)
    ax.set_xlim(STEP_OFFSET * np.expm1(-0.03 * span), STEP_OFFSET * np.expm1(1.03 * span))
    ticks = [t for t in (STEP_TICKS if last <= 1000 else LONG_STEP_TICKS) if t < 0.8 * last] + [last]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()


def draw_lines(ax: Axes, lines: dict[int | str, pd.Series], colors: dict, gid: str, log: bool) -> list[Artist]:
    """One line (with markers) per key of ``lines``; on a log axis exact zeros are left out of the line and drawn
    as triangles on the axis floor (gid ``zeros:<gid>:<key>``). Line gids: ``<gid>:<key>``."""
    drawn: list[Artist] = []
    zero_x = {}
    for key, values in lines.items():
        x, y = values.index.to_numpy(float), values.to_numpy(float)
        dashed = key == "output"
        if log:
            zero_x[key] = x[y == 0.0]
            y = np.where(y <= 0.0, np.nan, y)
        (line,) = ax.plot(x, y, color=colors[key], marker="o", markersize=2.2, linewidth=1.0,
                          linestyle="--" if dashed else "-", gid=f"{gid}:{key}")
        drawn.append(line)
    shifts = floor_marker_shifts({k: v for k, v in zero_x.items() if v.size})
    for key, shift in shifts.items():
        for s in np.unique(shift):
            drawn.append(log_floor_markers(ax, zero_x[key][shift == s], colors[key], f"zeros:{gid}:{key}", float(s)))
    return drawn


def log_range(axes: Sequence[Axes], values: Sequence[pd.Series]) -> bool:
    """One log y range for ``axes`` over every positive value, the floor :data:`FLOOR_ROOM` below the smallest;
    returns whether any value is exactly 0 (then the floor holds triangles)."""
    every = np.concatenate([v.to_numpy(float) for v in values]) if values else np.empty(0)
    positive = every[np.isfinite(every) & (every > 0)]
    for ax in axes:
        ax.set_yscale("log")
        if positive.size:
            ax.set_ylim(float(positive.min()) / FLOOR_ROOM, float(positive.max()) * 1.5)
        log_format(ax)
    return bool((every == 0).any())


def column_title(name: str, width_pt: float) -> str:
    """``name`` and its changes from ``base`` (:meth:`Cell.changes`), wrapped to ``width_pt``."""
    changes = cell(name).changes()
    text = f"{name}: " + (", ".join(changes) if changes else "the first member's recipe")
    return wrap_text(text, width_pt, 8)


def full_steps(checkpoints: pd.DataFrame) -> list[int]:
    """The steps measured on 1,024 windows (the last, and a long run's budgets: the rows with the own loss)."""
    steps = checkpoints["step"].tolist()
    if "own_loss" not in checkpoints:
        return steps[-1:]
    return [int(s) for s, own in zip(steps, checkpoints["own_loss"]) if pd.notna(own)]


def draw_training_flow(runs: Sequence[Run]) -> Figure:
    """The figure (:data:`ROW_LABELS` rows x one column per run); data artists carry gids ``top1:<cell>``,
    ``ratio:<cell>:<layer>``, ``collapse:<cell>:<layer>``, ``entropy:<cell>:<block>``, ``embedding:<cell>:<role>``,
    ``zeros:<those>`` (floor triangles) and ``reference``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("no runs to draw")
    layers = sorted({int(k) for r in runs for k in r.rows["layer"].unique() if k >= 0})
    colors: dict = dict(layer_colors(layers))
    role_colors = {**{r: role_color(r) for r in INPUT_ROLES}, "output": OUTPUT_COLOR}
    last = int(max(r.checkpoints["step"].max() for r in runs))
    with gradflow_style(FIGURE_WIDTH):
        fig, grid = plt.subplots(len(ROW_LABELS), len(runs), figsize=(FIGURE_WIDTH, ROW_HEIGHT * len(ROW_LABELS)),
                                 layout="constrained", sharex=True, sharey="row", squeeze=False)
        panels: dict[str, list[pd.Series]] = {"ratio": [], "embedding": []}
        roles_seen: list[str] = []
        for j, run in enumerate(runs):
            axs = grid[:, j]
            top1 = run.checkpoints.set_index("step")["mask15_top1"].astype(float)
            full = full_steps(run.checkpoints)
            axs[0].plot(top1.index, top1.to_numpy(), color="#222222", marker="o", markersize=2.2, linewidth=1.0,
                        markevery=[k for k, step in enumerate(top1.index) if step not in full],
                        gid=f"top1:{run.cell}")
            axs[0].plot(full, top1.loc[full].to_numpy(), linestyle="none", marker="o", markersize=3.2,
                        markerfacecolor="white", markeredgecolor="#222222", markeredgewidth=0.8,
                        gid=f"top1-final:{run.cell}")
            axs[0].axhline(MOST_FREQUENT, color="#777777", linestyle="--", linewidth=0.7, zorder=1, gid="reference")
            ratio = series(run.rows, "context_loss_ratio", "t0.15")
            draw_lines(axs[1], ratio, colors, f"ratio:{run.cell}", log=True)
            draw_lines(axs[2], series(run.rows, "collapse", "t0.15"), colors, f"collapse:{run.cell}", log=False)
            draw_lines(axs[3], entropy_ratio(run.rows), colors, f"entropy:{run.cell}", log=False)
            roles = embedding_roles(run.rows)
            draw_lines(axs[4], roles, role_colors, f"embedding:{run.cell}", log=True)
            panels["ratio"] += list(ratio.values())
            panels["embedding"] += list(roles.values())
            roles_seen += [r for r in roles if r not in roles_seen]
            for ax in axs:
                step_scale(ax, last)
        any_zero = {row: log_range(grid[i], panels[row]) for i, row in ((1, "ratio"), (4, "embedding"))}
        best = max(float(r.checkpoints["mask15_top1"].max()) for r in runs)
        top = 1.15 * max(best, MOST_FREQUENT)  # the reference never on the top edge
        grid[0, 0].set_ylim(-0.03 * top, top)
        _label(grid, runs)
        _legends(grid, layers, colors, [r for r in (*INPUT_ROLES, "output") if r in roles_seen], role_colors,
                 any_zero)
    return fig


def _label(grid: np.ndarray, runs: Sequence[Run]) -> None:
    """Row labels, panel letters (a, b, ... by row), column titles, the x label and the y ranges of the linear rows."""
    width_pt = FIGURE_WIDTH * 72.0 / len(runs) - 30.0
    for i, label in enumerate(ROW_LABELS):
        grid[i, 0].set_ylabel(label)
        for j, run in enumerate(runs):
            letter = chr(ord("a") + i * len(runs) + j)
            title = f"({letter}) " + (column_title(run.cell, width_pt - 14.0) if i == 0 else "")
            grid[i, j].set_title(title, loc="left", fontsize=8 if i == 0 else 7)
    grid[3, 0].set_ylim(top=1.02)
    for ax in grid[-1]:
        ax.set_xlabel("optimizer step")


def _legends(grid: np.ndarray, layers: list[int], colors: dict, roles: list[str], role_colors: dict,
             any_zero: dict[str, bool]) -> None:
    """Legends right of the last column: the reference (row a), the layers of rows b-d (with "exactly 0" when row b
    has zeros) and the roles of row e (with "exactly 0" when it has zeros)."""
    def place(ax: Axes, handles: list[Artist], title: str | None = None) -> None:
        ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.03, 0.5), frameon=False, title=title,
                  handlelength=1.6, borderaxespad=0.0, alignment="left")

    place(grid[0, -1], [Line2D([], [], color="#777777", linestyle="--", linewidth=0.7,
                               label="most frequent\ntoken (0.060)"),
                        Line2D([], [], linestyle="none", marker="o", markersize=3.2, markerfacecolor="white",
                               markeredgecolor="#222222", markeredgewidth=0.8,
                               label="1,024 windows\n(else 128)")])
    layer_handles = [Line2D([], [], color=colors[k], marker="o", markersize=2.2, linewidth=1.0,
                            label="0 (embeddings)" if k == 0 else str(k)) for k in layers]
    place(grid[1, -1], layer_handles + ([zero_proxy()] if any_zero["ratio"] else []), "layer (rows 2-4)")
    role_handles = [Line2D([], [], color=role_colors[r], marker="o", markersize=2.2, linewidth=1.0,
                           linestyle="--" if r == "output" else "-", label="output layer" if r == "output" else r)
                    for r in roles]
    place(grid[4, -1], role_handles + ([zero_proxy()] if any_zero["embedding"] else []), "role")


def write_figure(runs_dir: Path, names: Sequence[str], seed: int, out: Path) -> list[Path]:
    """``<out>.pdf`` and ``<out>.png`` of cells ``names`` (seed ``seed``) from ``runs_dir``; returns the paths."""
    import matplotlib.pyplot as plt

    from gradflow.figures import save_figure

    fig = draw_training_flow([load_run(runs_dir, n, seed) for n in names])
    paths = save_figure(fig, out)
    plt.close(fig)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=Path, default=Path("figures/diffusion-diagnosis/runs"))
    p.add_argument("--cells", nargs="+", default=list(DEFAULT_CELLS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="path stem: <out>.pdf and <out>.png")
    args = p.parse_args(argv)
    try:
        paths = write_figure(args.runs, args.cells, args.seed, args.out)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None
    print("\n".join(str(x) for x in paths))


if __name__ == "__main__":
    main()
