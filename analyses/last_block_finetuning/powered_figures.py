"""Issue 15's figures from the committed runs: the convergence curves (regime a) and the few-sample
test scores (regime b), each arm's mean over seeds with its 95% t-interval.

    python -m analyses.last_block_finetuning.powered_figures  # {convergence_curves,few_sample}.{pdf,png} in --out
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from analyses.last_block_finetuning.grid import collect, mean_ci

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "figures/finetune/last-block-finetuning"
METRIC = {"brown-pos": ("accuracy", "word accuracy"), "brown-propn": ("entity_f1", "proper-noun entity F1")}
ARM_COLOURS = {"full": "#4477AA", "drop1": "#EE6677", "reinit1": "#228833", "repair1": "#AA3377",
               "repair1-mlm": "#BBBBBB"}
ARM_STYLES = {"full": "-", "drop1": "--", "reinit1": ":", "repair1": "-.", "repair1-mlm": (0, (1, 1))}
MODELS = {"gradflow-mini-en": "gradflow-mini-en", "gradflow-mini-en-alltoken": "all-token twin"}


def curve_table(regime_dir: Path, curves: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per model, task, arm and step: the validation score's mean and 95% t-interval over seeds.

    ``curves``: ``collect(regime_dir)[0]`` when the caller has read the runs already."""
    curves = curves if curves is not None else collect(regime_dir)[0]
    rows = []
    for (model, task, arm, step), sub in curves.groupby(["model", "task", "arm", "step"]):
        values = sub[(sub.split == "validation") & (sub.metric == METRIC[task][0])].value.to_numpy()
        if values.size:
            mean, low, high, n = mean_ci(values)
            rows.append({"model": model, "task": task, "arm": arm, "step": step, "mean": mean, "ci_low": low,
                         "ci_high": high, "n": n})
    return pd.DataFrame(rows)


def plot_arms(ax, table: pd.DataFrame, **style) -> None:
    """On ``ax``: each arm of ``table`` (one model and task of :func:`curve_table`) as its mean curve, in the arm's
    colour and line style (``style``: more line keywords), with its 95% band clipped to [0, 1]."""
    for arm, colour in ARM_COLOURS.items():
        sub = table[table.arm == arm].sort_values("step")
        if sub.empty:
            continue
        ax.plot(sub.step, sub["mean"], color=colour, ls=ARM_STYLES[arm], label=f"{arm} (n={int(sub.n.min())})",
                **style)
        ax.fill_between(sub.step, sub.ci_low.clip(0, 1), sub.ci_high.clip(0, 1), color=colour, alpha=0.15, lw=0)


def draw_curves(table: pd.DataFrame, out: Path, names: dict[str, str] = MODELS, *,
                tasks: tuple[str, ...] = tuple(METRIC), regime: str = "batch 8, lr 1e-4",
                name: str = "convergence_curves") -> None:
    """Draw ``out/<name>.{pdf,png}``: one row per model of ``names`` (model -> row title) in ``table``, one column
    per task of ``tasks``, each arm's mean validation curve with its 95% band; ``regime`` ends the x label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradflow.figures import save_figure
    from gradflow.figures.style import gradflow_style

    models = [m for m in names if m in set(table.model)]
    with gradflow_style("double"):
        fig, axes = plt.subplots(len(models), len(tasks), figsize=(3.5 * len(tasks), 2.3 * len(models)),
                                 squeeze=False, sharex=True)
        for i, model in enumerate(models):
            for j, task in enumerate(tasks):
                label = METRIC[task][1]
                ax = axes[i][j]
                plot_arms(ax, table[(table.model == model) & (table.task == task)], marker="o", ms=2.5)
                ax.set_title(f"{names[model]}: {task}")
                ax.set_ylabel(f"validation {label}")
                if i == len(models) - 1:
                    ax.set_xlabel(f"fine-tuning step ({regime})")
                ax.legend(frameon=False, fontsize="x-small", loc="lower right")
        save_figure(fig, out / name)
        plt.close(fig)


def draw_few_sample(regime_dir: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradflow.figures import save_figure
    from gradflow.figures.style import gradflow_style

    _, finals = collect(regime_dir)
    with gradflow_style("double"):
        fig, axes = plt.subplots(1, len(METRIC), figsize=(7.0, 2.4))
        for ax, (task, (metric, label)) in zip(axes, METRIC.items()):
            sub = finals[(finals.task == task) & (finals.split == "test") & (finals.metric == metric)]
            for x, (arm, colour) in enumerate(list(ARM_COLOURS.items())[:4]):
                values = sub[(sub.model == "gradflow-mini-en") & (sub.arm == arm)].sort_values("seed").value.to_numpy()
                if not values.size:
                    continue
                jitter = np.linspace(-0.15, 0.15, values.size)
                ax.scatter(x + jitter, values, s=8, color=colour, alpha=0.6, lw=0)
                mean, low, high, _ = mean_ci(values)
                ax.errorbar([x + 0.3], [mean], yerr=[[mean - low], [high - mean]], fmt="o", ms=4, capsize=2,
                            color=colour)
            ax.set_xticks(range(4), list(ARM_COLOURS)[:4])
            ax.set_ylabel(f"test {label}")
            ax.set_title(f"gradflow-mini-en, 250 sentences: {task}")
        save_figure(fig, out / "few_sample")
        plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="the experiment folder (default %(default)s)")
    return draw_all(parser.parse_args().out)


def draw_all(out: Path) -> int:
    """Read the regimes' runs under ``out`` and draw the curve and few-sample figures there."""
    table = curve_table(out / "convergence")
    if (out / "convergence-exploratory" / "runs").is_dir():  # deviation 3's control arm, drawn beside the others
        table = pd.concat([table, curve_table(out / "convergence-exploratory")], ignore_index=True)
    table.to_csv(out / "convergence_curves.csv", index=False, float_format="%.6g")
    draw_curves(table, out)
    if (out / "few-sample-250" / "runs").is_dir():
        draw_few_sample(out / "few-sample-250", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
