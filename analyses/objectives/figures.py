"""Issue 52's fine-tuning curves from the committed per-run files: each arm's mean validation curve over seeds
with its 95% t-interval.

- ``curves_lr1e-4.{pdf,png}`` (Part 3): the two new models, both Brown tasks, lr 1e-4 (mini-en's and the twin's
  curves at the same regime are ``figures/finetune/last-block-finetuning/convergence_curves.png``);
- ``curves_seed-regime.{pdf,png}`` (Part 4): the four models, brown-pos, lr 1e-5, one panel per model.

Each figure's numbers are written beside it as ``curves_<part>.csv``. Called by ``analyses.objectives.report``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analyses.last_block_finetuning.powered_figures import METRIC, curve_table, draw_curves, plot_arms
from analyses.objectives.design import ALL_MODELS, DIFFUSION, LOW_LR, MASK40, MINI, TWIN

NAMES = {MINI: "mini-en (BERT 15%)", TWIN: "all-token twin", MASK40: "mask40 (BERT 40%)",
         DIFFUSION: "diffusion member"}
SEED_REGIME_TASK = "brown-pos"


def write_curves_lr1e4(regime_dir: Path, out: Path, curves: pd.DataFrame | None = None) -> pd.DataFrame | None:
    """``out/curves_lr1e-4.{csv,pdf,png}`` from the new models' runs under ``regime_dir`` (None without runs);
    ``curves``: their ``collect`` curves when the caller has read them already."""
    if curves is None and not any((regime_dir / "runs").glob("*/result.json")):
        return None
    table = curve_table(regime_dir, curves)
    table.to_csv(out / "curves_lr1e-4.csv", index=False, float_format="%.6g")
    draw_curves(table, out, {m: NAMES[m] for m in (MASK40, DIFFUSION)}, name="curves_lr1e-4")
    return table


def write_curves_seed_regime(regime_dir: Path, out: Path, steps: int,
                             curves: pd.DataFrame | None = None) -> pd.DataFrame | None:
    """``out/curves_seed-regime.{csv,pdf,png}``: the four models' brown-pos curves at lr 1e-5 (2 x 2 panels, shared
    axes; each legend gives the seeds in); None without runs. ``curves``: the runs' ``collect`` curves when the
    caller has read them already."""
    if curves is None and not any((regime_dir / "runs").glob("*/result.json")):
        return None
    table = curve_table(regime_dir, curves)
    table.to_csv(out / "curves_seed-regime.csv", index=False, float_format="%.6g")
    draw_panels(table, out / "curves_seed-regime", steps)
    return table


def draw_panels(table: pd.DataFrame, stem: Path, steps: int) -> None:
    """One panel per model of ``ALL_MODELS`` in ``table`` (2 x 2), each arm's mean curve and 95% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradflow.figures import save_figure
    from gradflow.figures.style import gradflow_style

    label = METRIC[SEED_REGIME_TASK][1]
    with gradflow_style("double"):
        fig, axes = plt.subplots(2, 2, figsize=(7.0, 4.6), sharex=True, sharey=True)
        for ax, model in zip(axes.flat, ALL_MODELS):
            plot_arms(ax, table[table.model == model], lw=1.2)
            ax.set_title(NAMES[model])
            ax.set_xlim(0, steps)
            ax.legend(frameon=False, fontsize="x-small", loc="lower right")
        for ax in axes[1]:
            ax.set_xlabel(f"fine-tuning step (batch 8, lr {LOW_LR:.0e})".replace("e-0", "e-"))
        for ax in axes[:, 0]:
            ax.set_ylabel(f"validation {label}")
        save_figure(fig, stem)
        plt.close(fig)
