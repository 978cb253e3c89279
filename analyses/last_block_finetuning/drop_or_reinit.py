"""Seed 000: does dropping or re-initialising the last block help fine-tuning?

For each embedded model (``gradflow-mini-en`` and its all-token twin ``gradflow-mini-en-alltoken``),
each token task (``brown-pos``: accuracy; ``brown-propn``: entity F1), each of three encoder
variants (``full``; ``drop1``: last block removed; ``reinit1``: last block re-initialised with the
architecture's own init), three learning rates spanning 30x and three seeds, fine-tune and
evaluate on the validation split every ``--eval-every`` steps, then on validation and test.

Outputs under ``--out`` (default ``figures/finetune/seed000``):
- ``runs/<run_id>/``: each run's ``eval.csv``, ``result.json``, ``factors.json`` (resumable);
- ``curves.csv``: validation metric vs step, mean and 95% t-interval over seeds;
- ``finals.csv``: final validation and test metric per (model, task, variant, lr), mean and CI;
- ``differences.csv``: variant minus ``full``, paired by seed, mean and 95% t-interval;
- ``model_contrast.csv``: the controlled comparison: the variant's effect (minus ``full``, each at
  its best learning rate) on ``gradflow-mini-en`` minus its effect on the all-token twin, paired
  by seed; the claim predicts a positive value;
- ``best_lr.csv``: per (model, task, variant) the learning rate with the best mean validation
  score, and its test score (the fair comparison: each variant at its own best learning rate);
- ``differences_best_lr.csv``: each variant at its own best learning rate minus ``full`` at its
  own, test split, paired by seed (the seeds share data order, subsets and head initialisation);
- ``curves.{pdf,png}``: validation metric vs step per model, task and learning rate (mean, 95%
  band); ``finals.{pdf,png}``: test metric at each variant's best learning rate (top) and the
  paired difference to ``full`` at every learning rate and at the best ones (bottom);
  ``plan.json`` (every run's config, the command).

CPU budget (the issue's: at most 30 minutes per model on 2 cores): 54 runs per model, so each run
is short: 150 steps of 16 sentences (2,400 of a seeded 8,000-sentence training subset), evaluation
every 50 steps on a seeded 500-sentence validation subset, final scores on 500 validation and 500
test sentences (seeded subsets, the same for every run of a seed), bfloat16 autocast, two
one-thread workers. (A first slice at 250 steps took about 100 s a run, 45 minutes per model: over
budget, so the grid runs 150: measured 62 s a run on average, 28 minutes per model.) Usage::

    python -m analyses.last_block_finetuning.drop_or_reinit                  # run (resumes) and summarise
    python -m analyses.last_block_finetuning.drop_or_reinit --summarise-only
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import pandas as pd

from analyses.last_block_finetuning.grid import (
    GridRun,
    collect,
    mean_ci,
    paired_differences,
    run_grid,
    summarise,
    write_plan,
)

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("gradflow-mini-en", "gradflow-mini-en-alltoken")
TASKS = {"brown-pos": "accuracy", "brown-propn": "entity_f1"}
VARIANTS = {"full": {}, "drop1": {"drop_last": 1}, "reinit1": {"reinit_last": 1}}
LRS = (1e-4, 5e-4, 3e-3)
SEEDS = (0, 1, 2)


def plan(args: argparse.Namespace) -> list[GridRun]:
    runs = []  # task outermost, then seed: an interrupted grid leaves whole (task, seed) slices done
    for task, seed, model, (variant, surgery), lr in itertools.product(
            args.tasks, args.seeds, args.models, VARIANTS.items(), args.lrs):
        config = dict(model=model, task=task, lr=lr, steps=args.steps, batch_size=args.batch_size,
                      eval_every=args.eval_every, eval_limit=args.eval_limit, train_limit=args.train_limit,
                      seed=seed, warmup=0.1,
                      max_length=128, autocast=args.autocast, data_root=args.data_root, **surgery)
        factors = dict(model=model, task=task, variant=variant, lr=lr, seed=seed)
        runs.append(GridRun(f"{model}__{task}__{variant}__lr{lr:g}__s{seed}", factors, config))
    return runs


def summarise_experiment(out: Path) -> dict[str, pd.DataFrame]:
    curves, finals = collect(out)
    curves = curves[(curves.metric == curves.task.map(TASKS)) & (curves.split == "validation")]
    finals = finals[finals.metric == finals.task.map(TASKS)]
    keys = ["model", "task", "variant", "lr"]
    tables = {
        "curves": summarise(curves, keys + ["step"]),
        "finals": summarise(finals, keys + ["split"]),
        "differences": paired_differences(finals, ["model", "task", "lr", "split"], "variant", "full"),
    }
    valid = tables["finals"][tables["finals"].split == "validation"]
    best = valid.loc[valid.groupby(["model", "task", "variant"])["mean"].idxmax(), ["model", "task", "variant", "lr"]]
    test = tables["finals"][tables["finals"].split == "test"]
    tables["best_lr"] = best.merge(test, on=keys).drop(columns="split")
    at_best = finals[finals.split == "test"].merge(best, on=keys)
    tables["differences_best_lr"] = paired_differences(at_best, ["model", "task", "split"], "variant", "full").merge(
        best.rename(columns={"lr": "lr_variant"}), on=["model", "task", "variant"], how="left")
    tables["model_contrast"] = model_contrast(at_best)
    for name, table in tables.items():
        table.to_csv(out / f"{name}.csv", index=False, float_format="%.6g")
    return tables


def model_contrast(at_best: pd.DataFrame, treated: str = MODELS[0], control: str = MODELS[1]) -> pd.DataFrame:
    """The controlled comparison: (variant - full) on ``treated`` minus (variant - full) on ``control``,
    each variant at its own best learning rate, paired by seed (the two models' runs of one seed
    share data order and subsets), per task: mean and 95% t-interval."""
    rows = []
    if not {treated, control} <= set(at_best.model):
        return pd.DataFrame(rows)
    for task, sub in at_best.groupby("task", sort=True):
        score = sub.set_index(["model", "variant", "seed"])["value"].sort_index()
        for variant in sorted(set(sub.variant) - {"full"}):
            effect = {m: (score.loc[m, variant] - score.loc[m, "full"]) for m in (treated, control)}
            diff = (effect[treated] - effect[control]).dropna()
            mean, lo, hi, n = mean_ci(diff.to_numpy())
            rows.append({"task": task, "variant": variant, "treated": treated, "control": control,
                         "difference_of_differences": mean, "ci_low": lo, "ci_high": hi, "n_pairs": n})
    return pd.DataFrame(rows)


def draw(tables: dict[str, pd.DataFrame], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradflow.figures import save_figure
    from gradflow.figures.style import gradflow_style

    colours = {"full": "#4477AA", "drop1": "#EE6677", "reinit1": "#228833"}
    curves = tables["curves"]
    models, tasks = sorted(curves.model.unique()), [t for t in TASKS if t in set(curves.task)]
    lrs = sorted(curves.lr.unique())
    with gradflow_style("double"):
        fig, axes = plt.subplots(len(models) * len(tasks), len(lrs), figsize=(7.0, 1.5 * len(models) * len(tasks)),
                                 sharex=True, squeeze=False)
        for row, (model, task) in enumerate(itertools.product(models, tasks)):
            for col, lr in enumerate(lrs):
                ax = axes[row, col]
                for variant, colour in colours.items():
                    sub = curves[(curves.model == model) & (curves.task == task) & (curves.lr == lr)
                                 & (curves.variant == variant)].sort_values("step")
                    if sub.empty:
                        continue
                    ax.plot(sub.step, sub["mean"], color=colour, label=variant, marker="o", ms=2.5)
                    # scores live in [0, 1]: a 3-seed t-interval can overshoot, so clip the band
                    ax.fill_between(sub.step, sub.ci_low.clip(0, 1), sub.ci_high.clip(0, 1), color=colour,
                                    alpha=0.2, lw=0)
                panel = curves[(curves.model == model) & (curves.task == task) & (curves.lr == lr)]
                if len(panel) and (panel["mean"] == 0).all():
                    ax.text(0.5, 0.75, "score 0 at every step\nin every run", transform=ax.transAxes,
                            ha="center", va="center", fontsize="small", color="#555555")
                if row == 0:
                    ax.set_title(f"lr {lr:g}")
                if col == 0:
                    ax.set_ylabel(f"{model.replace('gradflow-', '')}\n{task} {TASKS[task].replace('_', ' ')}")
                if row == len(models) * len(tasks) - 1:
                    ax.set_xlabel("step")
        axes[0, -1].legend(loc="lower right", frameon=False)
        save_figure(fig, out / "curves")
        plt.close(fig)

        best, diff, diff_best = tables["best_lr"], tables["differences"], tables["differences_best_lr"]
        fig, axes = plt.subplots(2, len(tasks), figsize=(7.0, 4.2), squeeze=False)
        offsets = {"full": -0.2, "drop1": 0.0, "reinit1": 0.2}
        for col, task in enumerate(tasks):
            ax = axes[0, col]
            for variant, colour in colours.items():
                sub = best[(best.task == task) & (best.variant == variant)].set_index("model").reindex(models)
                x = [m + offsets[variant] for m in range(len(models))]
                err = [sub["mean"] - sub.ci_low, sub.ci_high - sub["mean"]]
                ax.errorbar(x, sub["mean"], yerr=err, fmt="o", ms=4, capsize=2, color=colour, label=variant)
            ax.set_xticks(range(len(models)), [m.replace("gradflow-", "") for m in models])
            ax.set_xlim(-0.5, len(models) - 0.5)
            ax.set_ylabel(f"test {TASKS[task].replace('_', ' ')}\n(each at its best lr)")
            ax.set_title(task)

            ax = axes[1, col]
            ax.axhline(0.0, color="#777777", lw=0.6)
            labels = [f"lr {lr:g}" for lr in lrs] + ["best lr"]
            for i, model in enumerate(models):
                for variant in ("drop1", "reinit1"):
                    rows = diff[(diff.task == task) & (diff.model == model) & (diff.variant == variant)
                                & (diff.split == "test")].set_index("lr").reindex(lrs)
                    rows_best = diff_best[(diff_best.task == task) & (diff_best.model == model)
                                          & (diff_best.variant == variant)]
                    y = list(rows.mean_difference) + list(rows_best.mean_difference[:1])
                    lo = list(rows.ci_low) + list(rows_best.ci_low[:1])
                    hi = list(rows.ci_high) + list(rows_best.ci_high[:1])
                    x = [j + (i - 0.5) * 0.36 + (offsets[variant] - 0.1) * 0.6 for j in range(len(y))]
                    err = [[a - b for a, b in zip(y, lo)], [b - a for a, b in zip(y, hi)]]
                    ax.errorbar(x, y, yerr=err, fmt="o" if i == 0 else "s", ms=3.5, capsize=2,
                                color=colours[variant], mfc=colours[variant] if i == 0 else "white",
                                label=f"{variant}, {model.replace('gradflow-', '')}")
            ax.set_xticks(range(len(labels)), labels)
            ax.set_ylabel(f"minus full (test {TASKS[task].replace('_', ' ')},\npaired by seed)")
        handles, names = axes[0, 0].get_legend_handles_labels()
        fig.legend(handles, names, loc="outside upper center", ncol=3, frameon=False)
        handles, names = axes[1, 0].get_legend_handles_labels()
        axes[1, -1].legend(handles, names, loc="lower left", frameon=False, fontsize="small", ncol=2)
        save_figure(fig, out / "finals")
        plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "figures" / "finetune" / "seed000")
    parser.add_argument("--data-root", default=str(ROOT / "data" / "tasks"))
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--lrs", nargs="+", type=float, default=list(LRS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-limit", type=int, default=500)
    parser.add_argument("--train-limit", type=int, default=8000)
    parser.add_argument("--autocast", default="bfloat16")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--summarise-only", action="store_true")
    args = parser.parse_args()
    runs = plan(args)
    if not args.summarise_only:
        write_plan(runs, args.out)
        run_grid(runs, args.out, workers=args.workers)
    tables = summarise_experiment(args.out)
    draw(tables, args.out)
    print(json.dumps(tables["best_lr"].to_dict(orient="records"), indent=1))


if __name__ == "__main__":
    main()
