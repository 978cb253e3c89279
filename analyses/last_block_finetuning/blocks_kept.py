"""Seed 003: sentiment accuracy vs the number of encoder blocks kept (bottom-up).

For each embedded model (``gradflow-mini-en`` and its all-token twin ``gradflow-mini-en-alltoken``)
keep the bottom ``k`` encoder blocks, ``k = 1..L`` (``drop_last = L - k``; ``k = L`` is the full
model), put a fresh pooler and classification head on top and fine-tune everything on
``movie-sentiment`` (sequence classification, accuracy), at three learning rates spanning 30x and
three seeds; evaluate on the validation split every ``--eval-every`` steps, then on validation
and test. If the last block is the badly trained one (its context channels get no MLM gradient),
the accuracy curve over ``k`` should flatten or dip at ``k = L`` for the MLM model but not for
its all-token twin.

Outputs under ``--out`` (default ``figures/finetune/seed003``):
- ``runs/<run_id>/``: each run's ``eval.csv``, ``result.json``, ``factors.json`` (resumable);
- ``curves.csv``: validation accuracy vs step, mean and 95% t-interval over seeds;
- ``finals.csv``: final validation and test accuracy per (model, blocks_kept, lr), mean and CI;
- ``best_lr.csv``: per (model, blocks_kept) the learning rate with the best mean validation
  accuracy, and its test accuracy (mean, 95% t-interval over seeds);
- ``differences.csv``: each ``k`` minus ``k = L`` at the same learning rate, paired by seed, per
  split; ``differences_best_lr.csv``: each ``k`` at its own best learning rate minus ``k = L`` at
  its own, test split, paired by seed (the seeds share data order and head initialisation);
- ``blocks_kept.{pdf,png}``: test accuracy at the best learning rate vs blocks kept, one line per
  model with its 95% band (left), and the paired difference to ``k = L`` (right);
- ``plan.json`` (every run's config, the command), ``meta.json`` (run counts, CPU seconds).

CPU budget (the issue's: at most 30 minutes per model on 2 cores, i.e. 3600 core-seconds for the
6 x 3 x 3 = 54 runs of one model, about 60 core-seconds a run). Measured with one torch thread
per run and bfloat16 autocast on this project's 2-core AMD EPYC (AVX512-BF16) while it was busy
with two pretraining jobs (so probably upper bounds): a training step at batch size 32 costs
about 0.12 + 0.09 (k - 1) core-seconds (0.58 for all 6 blocks; float32 is 1.6x slower), an
evaluated example about a third of a trained one, setting up a run (model, tokenizing the
subsets) about 1.4 in a running worker (4 more for a worker's first run). With the defaults (150
steps of 32 examples from a seeded ``--train-limit`` 4800-example subset, i.e. one pass;
validation at steps 75 and 150 and test on ``--eval-limit`` 500 examples each) a run costs about
22 core-seconds for k = 1 to 100 for k = 6, 60 on average over k: about 3300 core-seconds, 27-28
minutes with the default two one-thread workers, per model (measured: 3283 and 3198
core-seconds, 20.7 a run at k = 1 to 99.0 at k = 6; 27 minutes per model). The validation and test subsets are
seeded by the run's seed: the runs of one seed share them (so paired differences compare like
with like), different seeds draw different halves of the 1007-example splits. Usage::

    python -m analyses.last_block_finetuning.blocks_kept                  # run (resumes) and summarise
    python -m analyses.last_block_finetuning.blocks_kept --summarise-only
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import pandas as pd

from analyses.last_block_finetuning.grid import GridRun, collect, paired_differences, run_grid, summarise, write_plan

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("gradflow-mini-en", "gradflow-mini-en-alltoken")
TASK, METRIC = "movie-sentiment", "accuracy"
LRS = (1e-4, 5e-4, 3e-3)
SEEDS = (0, 1, 2)
COLOURS = {"gradflow-mini-en": "#4477AA", "gradflow-mini-en-alltoken": "#EE6677"}


def num_blocks(model: str) -> int:
    """Encoder depth of a model spec (embedded name, ``zoo:NAME``, directory or hub name), from its config."""
    from transformers import AutoConfig

    from gradflow.models import resolve_model_path

    path, _ = resolve_model_path(model)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise SystemExit(f"{model}: cannot read its config ({str(err).splitlines()[0]}); "
                         "pass an embedded model, zoo:NAME, a saved directory or a reachable hub name") from None
    depth = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layers", None)
    if not depth:
        raise SystemExit(f"{model}: its config names no depth (num_hidden_layers or n_layers)")
    return int(depth)


def plan(args: argparse.Namespace) -> list[GridRun]:
    runs = []  # seed outermost: an interrupted grid leaves whole seeds done
    depths = {model: num_blocks(model) for model in args.models}
    for seed, model in itertools.product(args.seeds, args.models):
        depth = depths[model]
        kept = args.blocks_kept or list(range(1, depth + 1))
        for k, lr in itertools.product(kept, args.lrs):
            if not 1 <= k <= depth:
                raise SystemExit(f"{model} has {depth} blocks: --blocks-kept must lie in 1..{depth}")
            config = dict(model=model, task=TASK, lr=lr, steps=args.steps, batch_size=args.batch_size,
                          eval_every=args.eval_every, train_limit=args.train_limit, eval_limit=args.eval_limit,
                          seed=seed, warmup=0.1, max_length=128, autocast=args.autocast, data_root=args.data_root,
                          drop_last=depth - k)
            factors = dict(model=model, task=TASK, blocks_kept=k, num_blocks=depth, lr=lr, seed=seed)
            runs.append(GridRun(f"{model}__k{k}__lr{lr:g}__s{seed}", factors, config))
    return runs


def summarise_experiment(out: Path) -> dict[str, pd.DataFrame]:
    curves, finals = collect(out)
    curves = curves[(curves.metric == METRIC) & (curves.split == "validation")]
    seconds = finals.drop_duplicates("run_id")[["model", "blocks_kept", "seconds"]]
    finals = finals[finals.metric == METRIC]
    keys = ["model", "blocks_kept", "lr"]
    tables = {
        "curves": summarise(curves, keys + ["step"]),
        "finals": summarise(finals, keys + ["split"]),
    }
    # k = L of each model is its baseline (models could differ in depth)
    full = finals.groupby("model")["num_blocks"].transform("max")
    tables["differences"] = pd.concat(
        [paired_differences(sub, ["model", "lr", "split"], "blocks_kept", int(depth))
         for depth, sub in finals.groupby(full)], ignore_index=True)
    valid = tables["finals"][tables["finals"].split == "validation"]
    best = valid.loc[valid.groupby(["model", "blocks_kept"])["mean"].idxmax(), keys]
    test = tables["finals"][tables["finals"].split == "test"]
    tables["best_lr"] = best.merge(test, on=keys).drop(columns="split")
    at_best = finals[finals.split == "test"].merge(best, on=keys)
    full = at_best.groupby("model")["num_blocks"].transform("max")
    tables["differences_best_lr"] = pd.concat(
        [paired_differences(sub, ["model", "split"], "blocks_kept", int(depth))
         for depth, sub in at_best.groupby(full)],
        ignore_index=True).merge(best.rename(columns={"lr": "lr_k"}), on=["model", "blocks_kept"], how="left")
    for name, table in tables.items():
        table.to_csv(out / f"{name}.csv", index=False, float_format="%.6g")
    meta = {"runs_done": int(seconds.shape[0]), "run_seconds_total": float(seconds.seconds.sum()),
            "run_seconds_by_model": seconds.groupby("model")["seconds"].sum().round(1).to_dict(),
            "run_seconds_mean_by_blocks_kept": seconds.groupby("blocks_kept")["seconds"].mean().round(1)
            .rename(index=str).to_dict(),
            "note": "run seconds are wall seconds of one-thread runs (about core-seconds when workers <= cores)"}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return tables


def draw(tables: dict[str, pd.DataFrame], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradflow.figures import save_figure
    from gradflow.figures.style import gradflow_style

    best, diff = tables["best_lr"], tables["differences_best_lr"]
    models = sorted(best.model.unique())
    with gradflow_style("double"):
        fig, axes = plt.subplots(1, 2, figsize=(7.0, 2.4))
        ax = axes[0]
        for i, model in enumerate(models):
            colour = COLOURS.get(model, f"C{i}")
            sub = best[best.model == model].sort_values("blocks_kept")
            label = model.replace("gradflow-", "")
            ax.plot(sub.blocks_kept, sub["mean"], marker="o", ms=3, color=colour, label=label)
            ax.fill_between(sub.blocks_kept, sub.ci_low.clip(0, 1), sub.ci_high.clip(0, 1), color=colour,
                            alpha=0.2, lw=0)
        ax.set_xlabel("encoder blocks kept (bottom-up)")
        ax.set_ylabel(f"test {METRIC} (best lr)")
        ax.set_title(TASK)
        ax.set_xticks(sorted(best.blocks_kept.unique()))
        ax.legend(loc="best", frameon=False)

        ax = axes[1]
        ax.axhline(0.0, color="#777777", lw=0.6)
        offsets = {m: (i - (len(models) - 1) / 2) * 0.12 for i, m in enumerate(models)}
        for i, model in enumerate(models):
            colour = COLOURS.get(model, f"C{i}")
            sub = diff[diff.model == model].sort_values("blocks_kept")
            if sub.empty:
                continue
            x = sub.blocks_kept + offsets[model]
            err = [sub.mean_difference - sub.ci_low, sub.ci_high - sub.mean_difference]
            ax.errorbar(x, sub.mean_difference, yerr=err, fmt="o", ms=3, capsize=2, color=colour,
                        label=model.replace("gradflow-", ""))
        depth = int(best.blocks_kept.max())
        ax.plot([depth], [0.0], marker="o", ms=4, mfc="white", color="#777777", ls="none")
        ax.annotate("baseline", (depth, 0.0), textcoords="offset points", xytext=(0, 5), ha="center",
                    fontsize="small", color="#555555")
        ax.set_xlabel("encoder blocks kept (bottom-up)")
        ax.set_ylabel("test accuracy minus all blocks\n(each at its best lr, paired by seed)")
        ax.set_title("difference to all blocks kept")
        ax.set_xticks(sorted(best.blocks_kept.unique()))
        save_figure(fig, out / "blocks_kept")
        plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "figures" / "finetune" / "seed003")
    parser.add_argument("--data-root", default=str(ROOT / "data" / "tasks"))
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--blocks-kept", nargs="+", type=int, default=None,
                        help="values of k to run (default: 1..L of each model)")
    parser.add_argument("--lrs", nargs="+", type=float, default=list(LRS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--train-limit", type=int, default=4800, help="seeded training subset (steps x batch size)")
    parser.add_argument("--eval-every", type=int, default=75)
    parser.add_argument("--eval-limit", type=int, default=500)
    parser.add_argument("--autocast", default="bfloat16")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--summarise-only", action="store_true")
    args = parser.parse_args()
    if args.autocast in ("none", "None", ""):
        args.autocast = None
    runs = plan(args)
    if not args.summarise_only:
        write_plan(runs, args.out)
        run_grid(runs, args.out, workers=args.workers)
    tables = summarise_experiment(args.out)
    draw(tables, args.out)
    print(json.dumps(tables["best_lr"].to_dict(orient="records"), indent=1))


if __name__ == "__main__":
    main()
