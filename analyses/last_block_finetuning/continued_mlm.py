"""Seed 001: does continued MLM pretraining on the task's own text help, head-only or fully fine-tuned?

For each embedded model (``gradflow-mini-en`` and its all-token twin ``gradflow-mini-en-alltoken``)
and one task (``--task``, default ``brown-pos``), four arms, three seeds each:

- ``head_only``: fine-tune only the new head (``FinetuneConfig(head_only=True)``, ``--lr-head``);
- ``full``: fine-tune everything (``--lr-full``);
- ``cmlm_head_only`` / ``cmlm_full``: first continue MLM pretraining on the task's training text
  (:func:`gradflow.interventions.finetune.continue_mlm`; a token task's sentences are their tokens joined by
  spaces, a sequence task's its texts; the whole training split, of which ``--mlm-steps`` x
  ``--mlm-batch-size`` sentences are drawn), then fine-tune as above. Seed ``s`` of a ``cmlm`` arm
  starts from the continued model of seed ``s`` (continued with seed ``s``), so every arm pairs by
  seed. For the Brown tasks the training text was part of the embedded models' pretraining
  corpus (only the test documents were held out): continued MLM re-weights it, it adds no text.

Outputs under ``--out`` (default ``figures/finetune/seed001``):
- ``runs/<run_id>/``: each fine-tuning run's ``eval.csv``, ``result.json``, ``factors.json``;
- ``mlm/<model>__s<seed>/``: each continued-MLM run's ``gradflow_callback.csv`` (per block and
  role: weight-gradient norm, mean hidden-state gradient, drift), ``mlm_log.csv`` (loss per step)
  and ``continued.json``; the continued models themselves go under ``--work`` (default
  ``build/finetune/seed001``, not committed: about 30 MB each);
- ``curves.csv`` (validation metric vs step), ``finals.csv`` (final validation and test metric
  per model and arm): mean and 95% t-interval over seeds;
- ``differences.csv``: every arm minus ``full``, paired by seed; ``cmlm_effect.csv``: ``cmlm_X``
  minus ``X`` for each training mode X (head_only, full), paired by seed;
- ``mlm_gradflow.csv``: per model, block and position group (``context``; ``loss`` = masked +
  random + kept) the weight-gradient norm and the mean hidden-state gradient at the block's output,
  averaged over the logged steps of a run, then mean and 95% t-interval over seeds;
  ``mlm_loss.csv``: the continued-MLM loss (means over windows of ``--mlm-log-every`` steps);
- ``arms.{pdf,png}``: test metric per arm and model (bars, 95% intervals) and the continued-MLM
  effect per mode; ``continued_mlm_gradflow.{pdf,png}``: context vs loss positions per block during
  continued MLM, and the MLM loss;
- ``plan.json`` (every run's config, the continued-MLM settings, the command), ``meta.json``.

Pooling the loss positions: the hidden-state gradient is pooled exactly (means weighted by the
logged ``n_positions``); the callback logs one weight-gradient norm per role, and the norm of the
summed loss-role contribution is not recoverable from them, so the loss rows of ``grad_norm`` are
the root-sum-square over masked, random and kept. In the last block the context channels' hidden
gradient is exactly zero for the MLM model (nothing mixes positions after its attention), while
its context weight-gradient is not: the loss positions' queries read the context keys and values,
so ``attn.k`` and ``attn.v`` get a context share (``attn.q``, ``attn.out``, the FFN and the norms
get exactly none).

CPU budget (the issue's: at most 30 minutes per model on 2 cores = 3600 core-seconds for the 3
continued-MLM runs and 12 fine-tuning runs of one model). Measured with one torch thread per run
and bfloat16 autocast on ``brown-pos``, on this project's 2-core AMD EPYC (AVX512-BF16) while it
was busy with two pretraining jobs (so probably upper bounds): a full fine-tuning step at batch
size 16 costs about 0.40 core-seconds, a head-only step (forward only through the frozen
encoder) 0.15, an evaluated sentence about 0.007 (estimated from the head-only step), a
continued-MLM step at batch size 32 about 1.26 (the MLM head scores all 8192 vocabulary entries
at every position), a logged one (per-role recorder) 0.2 more, loading a model and tokenizing
the 44k training sentences about 5. Defaults: fine-tuning exactly as seed 000 (150 steps of 16
sentences from a seeded ``--train-limit`` 8000-sentence subset, validation every 50 steps and
test on seeded ``--eval-limit`` 500-sentence subsets, the same for every run of a seed; so the
``full`` arm has the config of seed 000's ``full`` variant at lr 5e-4): about 60 core-seconds a
full run (measured in seed 000) and 30 a head-only run, 6 x 90 = 540 per model; continued MLM
250 steps of 32 sentences (8k sentences, about a fifth of the training split), logged every 50
steps: about 330 core-seconds a run, 3 x 330 = 990 per model; about 1530 core-seconds in all,
13 minutes with the default two one-thread workers, per model (the base-model arms run
alongside the continued-MLM runs, so an odd number of those leaves no worker idle). Usage::

    python -m analyses.last_block_finetuning.continued_mlm                  # run (resumes) and summarise
    python -m analyses.last_block_finetuning.continued_mlm --summarise-only
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np
import pandas as pd

from analyses.last_block_finetuning import grid
from analyses.last_block_finetuning.grid import GridRun, collect, paired_differences, summarise

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("gradflow-mini-en", "gradflow-mini-en-alltoken")
TASKS = ("brown-pos", "brown-propn", "movie-sentiment")
ARMS = {"head_only": ("base", "head_only"), "full": ("base", "full"),
        "cmlm_head_only": ("cmlm", "head_only"), "cmlm_full": ("cmlm", "full")}
SEEDS = (0, 1, 2)
LOSS_ROLES = ("masked", "random", "kept")
MLM_FILES = ("gradflow_callback.csv", "mlm_log.csv", "continued.json")
COLOURS = {"head_only": "#BBCCEE", "full": "#4477AA", "cmlm_head_only": "#FFCCCC", "cmlm_full": "#EE6677"}
GROUP_COLOURS = {"context": "#0077BB", "loss": "#000000"}  # gradflow.figures.style.ROLE_COLORS


# ---------------------------------------------------------------------------------------- continued MLM
def mlm_dir(work: Path, model: str, seed: int) -> Path:
    return work / "mlm" / f"{model}__s{seed}"


def task_texts(task_name: str, data_root: str) -> list[str]:
    """The training split as plain text: a token task's tokens joined by spaces, a sequence task's texts."""
    from gradflow.interventions.finetune import load_split, load_task

    task = load_task(task_name, data_root)
    rows = load_split(task, "train")
    return [" ".join(r["tokens"]) if task.kind == "token" else r["text"] for r in rows]


def _continue_one(model: str, seed: int, args: dict, out_dir: Path) -> tuple[str, float]:
    import torch

    torch.set_num_threads(1)
    from gradflow.interventions.finetune import continue_mlm

    start = time.perf_counter()
    continue_mlm(model, task_texts(args["task"], args["data_root"]), out_dir, steps=args["steps"],
                 batch_size=args["batch_size"], lr=args["lr"], seed=seed, log_every=args["log_every"],
                 max_length=args["max_length"], warmup=args["warmup"], weight_decay=args["weight_decay"],
                 mlm_probability=args["mlm_probability"], bf16=args["bf16"])
    return f"{model}__s{seed}", time.perf_counter() - start


def run_continued(models: list[str], seeds: list[int], mlm: dict, work: Path, out: Path, workers: int,
                  base_runs: list[GridRun] = ()) -> None:
    """Continue MLM for every (model, seed) not yet done; copy the logs (not the model) to ``out/mlm``.

    ``base_runs`` (fine-tuning runs that do not need a continued model) share the process pool,
    queued after the longer continued-MLM runs, so no worker idles while the last ones finish.
    """
    todo = [(m, s) for m, s in itertools.product(models, seeds)
            if not (mlm_dir(work, m, s) / "continued.json").exists()
            or not (mlm_dir(work, m, s) / "model" / "config.json").exists()]
    extra = grid.pending(list(base_runs), out)
    print(f"continued MLM: {len(models) * len(seeds) - len(todo)} done, {len(todo)} to run "
          f"(with {len(extra)} fine-tuning runs that do not need them)", flush=True)
    if todo or extra:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        start = time.perf_counter()
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(_continue_one, m, s, mlm, mlm_dir(work, m, s)) for m, s in todo]
            futures += [pool.submit(grid.run_one, r, out, 1) for r in extra]
            for i, fut in enumerate(as_completed(futures), 1):
                name, seconds = fut.result()
                print(f"[stage 1: {i}/{len(futures)}] {name}: {seconds:.0f} s "
                      f"(elapsed {time.perf_counter() - start:.0f} s)", flush=True)
    for m, s in itertools.product(models, seeds):
        dest = out / "mlm" / f"{m}__s{s}"
        dest.mkdir(parents=True, exist_ok=True)
        for name in MLM_FILES:
            shutil.copy2(mlm_dir(work, m, s) / name, dest / name)


# ---------------------------------------------------------------------------------------- plan
def plan(args: argparse.Namespace) -> list[GridRun]:
    runs = []  # seed outermost: an interrupted grid leaves whole seeds done
    for seed, model, (arm, (pretrain, mode)) in itertools.product(args.seeds, args.models, ARMS.items()):
        source = model if pretrain == "base" else str(mlm_dir(args.work, model, seed) / "model")
        lr = args.lr_head if mode == "head_only" else args.lr_full
        config = dict(model=source, task=args.task, lr=lr, steps=args.steps, batch_size=args.batch_size,
                      eval_every=args.eval_every, train_limit=args.train_limit, eval_limit=args.eval_limit, seed=seed,
                      warmup=0.1, max_length=128, autocast=args.autocast, data_root=args.data_root,
                      head_only=mode == "head_only")
        factors = dict(model=model, task=args.task, arm=arm, pretrain=pretrain, mode=mode, lr=lr, seed=seed)
        runs.append(GridRun(f"{model}__{args.task}__{arm}__lr{lr:g}__s{seed}", factors, config))
    return runs


# ---------------------------------------------------------------------------------------- summaries
def _mlm_frames(out: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(callback rows, loss rows) of every continued-MLM run copied under ``out/mlm``, tagged model and seed."""
    grads, losses = [], []
    for path in sorted((out / "mlm").glob("*__s*/gradflow_callback.csv")):
        model, seed = path.parent.name.rsplit("__s", 1)
        grads.append(pd.read_csv(path).assign(model=model, seed=int(seed)))
        every = json.loads((path.parent / "continued.json").read_text())["log_every"]
        losses.append(pd.read_csv(path.parent / "mlm_log.csv").assign(model=model, seed=int(seed), every=every))
    if not grads:
        return pd.DataFrame(), pd.DataFrame()
    return pd.concat(grads, ignore_index=True), pd.concat(losses, ignore_index=True)


def pool_positions(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (model, seed, step, group): ``context`` and pooled ``loss`` rows of grad_norm and hidden_grad_mean."""
    rows = []
    keys = ["model", "seed", "step", "group"]
    for key, sub in frame[frame.role.isin(("context",) + LOSS_ROLES)].groupby(keys, sort=True):
        values = {(r.quantity, r.role): r.value for r in sub.itertuples(index=False)}
        base = dict(zip(keys, key))
        for quantity in ("grad_norm", "hidden_grad_mean"):
            if (quantity, "context") in values:
                rows.append({**base, "quantity": quantity, "positions": "context",
                             "value": values[quantity, "context"]})
        loss_norms = [values[("grad_norm", r)] for r in LOSS_ROLES if ("grad_norm", r) in values]
        if loss_norms:
            rows.append({**base, "quantity": "grad_norm", "positions": "loss",
                         "value": math.sqrt(sum(v * v for v in loss_norms))})
        pairs = [(values[("hidden_grad_mean", r)], values.get(("n_positions", r), 0.0)) for r in LOSS_ROLES
                 if ("hidden_grad_mean", r) in values]
        n = sum(w for _, w in pairs)
        if n > 0:
            rows.append({**base, "quantity": "hidden_grad_mean", "positions": "loss",
                         "value": sum(v * w for v, w in pairs) / n})
    return pd.DataFrame(rows)


def _layer(group: str) -> int:
    """Block output index: 0 for the embeddings, i + 1 for ``blocks.i``."""
    return 0 if group == "embeddings" else int(group.split(".")[1]) + 1


def summarise_mlm(out: Path) -> dict[str, pd.DataFrame]:
    grads, losses = _mlm_frames(out)
    if grads.empty:
        return {}
    pooled = pool_positions(grads)
    per_seed = pooled.groupby(["model", "seed", "group", "quantity", "positions"], as_index=False)["value"].mean()
    gradflow = summarise(per_seed, ["model", "group", "quantity", "positions"])
    gradflow.insert(2, "layer", gradflow.group.map(_layer))
    gradflow["exact_zeros"] = [int((per_seed[(per_seed.model == r.model) & (per_seed.group == r.group)
                                              & (per_seed.quantity == r.quantity)
                                              & (per_seed.positions == r.positions)].value == 0).sum())
                               for r in gradflow.itertuples(index=False)]
    losses = losses.assign(window=(losses.step - 1) // losses.every)
    windows = losses.groupby(["model", "seed", "window"], as_index=False).agg(step=("step", "max"),
                                                                             value=("loss", "mean"))
    loss = summarise(windows, ["model", "step"])
    return {"mlm_gradflow": gradflow.sort_values(["model", "quantity", "positions", "layer"]), "mlm_loss": loss}


def summarise_experiment(out: Path, data_root: str) -> dict[str, pd.DataFrame]:
    from gradflow.interventions.finetune import load_task

    curves, finals = collect(out)
    metrics = {task: load_task(task, data_root).metric for task in finals.task.unique()}
    curves = curves[(curves.metric == curves.task.map(metrics)) & (curves.split == "validation")]
    seconds = finals.drop_duplicates("run_id")[["model", "arm", "seconds"]]
    finals = finals[finals.metric == finals.task.map(metrics)]
    keys = ["model", "task", "arm", "lr"]
    tables = {
        "curves": summarise(curves, keys + ["step"]),
        "finals": summarise(finals, keys + ["split"]),
        "differences": paired_differences(finals, ["model", "task", "split"], "arm", "full"),
        "cmlm_effect": paired_differences(finals, ["model", "task", "mode", "split"], "pretrain", "base"),
    }
    tables.update(summarise_mlm(out))
    for name, table in tables.items():
        table.to_csv(out / f"{name}.csv", index=False, float_format="%.6g")
    tables["metric"] = pd.DataFrame({"task": list(metrics), "metric": list(metrics.values())})
    mlm_seconds = {p.parent.name: round(json.loads(p.read_text())["seconds"], 1)
                   for p in sorted((out / "mlm").glob("*/continued.json"))}
    meta = {"finetune_runs_done": int(seconds.shape[0]),
            "finetune_seconds_by_model": seconds.groupby("model")["seconds"].sum().round(1).to_dict(),
            "finetune_seconds_mean_by_arm": seconds.groupby("arm")["seconds"].mean().round(1).to_dict(),
            "continued_mlm_seconds": mlm_seconds, "metrics": metrics,
            "note": "seconds are wall seconds of one-thread runs (about core-seconds when workers <= cores)"}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return tables


# ---------------------------------------------------------------------------------------- figures
def draw(tables: dict[str, pd.DataFrame], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradflow.figures import save_figure
    from gradflow.figures.style import gradflow_style

    finals, effect = tables["finals"], tables["cmlm_effect"]
    test = finals[finals.split == "test"]
    models = sorted(test.model.unique())
    task = test.task.iloc[0]
    metric = tables["metric"].set_index("task").metric[task]
    arms = [a for a in ARMS if a in set(test.arm)]
    with gradflow_style("double"):
        fig, axes = plt.subplots(1, 2, figsize=(7.0, 2.4), gridspec_kw={"width_ratios": [3, 2]})
        ax, width = axes[0], 0.8 / max(len(arms), 1)
        for i, arm in enumerate(arms):
            sub = test[test.arm == arm].set_index("model").reindex(models)
            x = np.arange(len(models)) + (i - (len(arms) - 1) / 2) * width
            err = np.array([sub["mean"] - sub.ci_low, sub.ci_high - sub["mean"]])
            ax.bar(x, sub["mean"], width, color=COLOURS[arm], label=arm.replace("_", " ").replace("cmlm", "MLM +"),
                   yerr=np.nan_to_num(err), capsize=2, edgecolor="#333333", lw=0.4)
        ax.set_xticks(range(len(models)), [m.replace("gradflow-", "") for m in models])
        ax.set_ylabel(f"test {metric}")
        ax.set_title(task)
        low = np.nanmin(np.r_[test.ci_low.to_numpy(), test["mean"].to_numpy()])
        high = np.nanmax(np.r_[test.ci_high.to_numpy(), test["mean"].to_numpy()])
        ax.set_ylim(max(0.0, low - 0.1 * (high - low) - 0.02), min(1.0, high + 0.25 * (high - low) + 0.01))
        ax.legend(loc="upper left", frameon=False, ncol=2)

        ax = axes[1]
        ax.axhline(0.0, color="#777777", lw=0.6)
        sub = effect[effect.split == "test"]
        modes = ["head_only", "full"]
        for i, model in enumerate(models):
            rows = sub[sub.model == model].set_index("mode").reindex(modes)
            x = np.arange(len(modes)) + (i - (len(models) - 1) / 2) * 0.2
            err = np.array([rows.mean_difference - rows.ci_low, rows.ci_high - rows.mean_difference])
            ax.errorbar(x, rows.mean_difference, yerr=np.nan_to_num(err), fmt="o", ms=3, capsize=2,
                        color=("#4477AA", "#EE6677")[i % 2], label=model.replace("gradflow-", ""))
        ax.set_xticks(range(len(modes)), ["head only", "full"])
        ax.set_xlim(-0.5, len(modes) - 0.5)
        ax.set_ylabel(f"continued MLM effect\n(test {metric}, paired by seed)")
        ax.legend(loc="best", frameon=False)
        save_figure(fig, out / "arms")
        plt.close(fig)

    if "mlm_gradflow" in tables:
        draw_gradflow(tables["mlm_gradflow"], tables["mlm_loss"], out)


def draw_gradflow(gradflow: pd.DataFrame, loss: pd.DataFrame, out: Path) -> None:
    import matplotlib.pyplot as plt

    from gradflow.figures import save_figure
    from gradflow.figures.style import gradflow_style

    models = sorted(gradflow.model.unique())
    panels = [("hidden_grad_mean", "hidden-state gradient at block output\n(mean per position)"),
              ("grad_norm", "block weight-gradient norm\n(loss: root-sum-square over roles)")]
    with gradflow_style("double"):
        fig, axes = plt.subplots(len(models), 3, figsize=(7.0, 2.0 * len(models) + 0.3), squeeze=False)
        for row, model in enumerate(models):
            for col, (quantity, title) in enumerate(panels):
                ax = axes[row, col]
                sub = gradflow[(gradflow.model == model) & (gradflow.quantity == quantity)]
                positive = sub["mean"][sub["mean"] > 0]
                floor = float(positive.min()) / 4 if len(positive) else 1e-12
                for positions, colour in GROUP_COLOURS.items():
                    part = sub[sub.positions == positions].sort_values("layer")
                    if part.empty:
                        continue
                    label = "loss (masked+random+kept)" if positions == "loss" else positions
                    y = part["mean"].where(part["mean"] > 0)
                    ax.plot(part.layer, y, marker="o", ms=3, color=colour, label=label)
                    ax.fill_between(part.layer, part.ci_low.clip(lower=floor), part.ci_high.where(part.ci_high > 0),
                                    color=colour, alpha=0.2, lw=0)
                    zero = part[part["mean"] == 0]
                    if len(zero):
                        ax.plot(zero.layer, [floor] * len(zero), marker="v", ms=5, ls="none", color=colour,
                                clip_on=False)
                        for layer in zero.layer:
                            ax.annotate("exactly 0", (layer, floor), textcoords="offset points", xytext=(-5, 2),
                                        ha="right", va="bottom", fontsize="small", color=colour)
                ax.set_yscale("log")
                ax.set_ylim(bottom=floor)
                layers = sorted(sub.layer.unique())
                ax.set_xticks(layers, ["emb" if x == 0 else str(x) for x in layers])
                if row == 0:
                    ax.set_title(title)
                if row == len(models) - 1:
                    ax.set_xlabel("block (0 = embeddings)")
                if col == 0:
                    ax.set_ylabel(model.replace("gradflow-", ""))
                if row == 0 and col == 1:
                    ax.legend(loc="lower left", frameon=False)
            ax = axes[row, 2]
            part = loss[loss.model == model].sort_values("step")
            ax.plot(part.step, part["mean"], color="#333333")
            ax.fill_between(part.step, part.ci_low, part.ci_high, color="#333333", alpha=0.2, lw=0)
            if row == 0:
                ax.set_title("continued-MLM training loss")
            if row == len(models) - 1:
                ax.set_xlabel("step")
        save_figure(fig, out / "continued_mlm_gradflow")
        plt.close(fig)


# ---------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "figures" / "finetune" / "seed001")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "finetune" / "seed001",
                        help="where the continued-MLM models go (large, not committed)")
    parser.add_argument("--data-root", default=str(ROOT / "data" / "tasks"))
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--task", default="brown-pos", choices=list(TASKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--lr-full", type=float, default=5e-4)
    parser.add_argument("--lr-head", type=float, default=3e-3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--train-limit", type=int, default=8000, help="seeded training subset")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-limit", type=int, default=500)
    parser.add_argument("--autocast", default="bfloat16", help="fine-tuning and continued MLM; 'none' for float32")
    parser.add_argument("--mlm-steps", type=int, default=250)
    parser.add_argument("--mlm-batch-size", type=int, default=32)
    parser.add_argument("--mlm-lr", type=float, default=3e-4)
    parser.add_argument("--mlm-log-every", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--summarise-only", action="store_true")
    args = parser.parse_args()
    if args.autocast in ("none", "None", ""):
        args.autocast = None
    args.work = args.work.resolve()
    runs = plan(args)
    mlm = dict(task=args.task, data_root=args.data_root, steps=args.mlm_steps, batch_size=args.mlm_batch_size,
               lr=args.mlm_lr, log_every=args.mlm_log_every, bf16=args.autocast == "bfloat16", warmup=0.1,
               weight_decay=0.01, mlm_probability=0.15, max_length=128)
    if not args.summarise_only:
        grid.write_plan(runs, args.out, {"continued_mlm": mlm, "work": str(args.work)})
        # stage 1: continued MLM, with the base-model arms filling idle workers; stage 2: the rest
        run_continued(args.models, args.seeds, mlm, args.work, args.out, args.workers,
                      [r for r in runs if r.factors["pretrain"] == "base"])
        grid.run_grid(runs, args.out, workers=args.workers)
    tables = summarise_experiment(args.out, args.data_root)
    draw(tables, args.out)
    print(json.dumps(tables["finals"][tables["finals"].split == "test"].to_dict(orient="records"), indent=1))


if __name__ == "__main__":
    main()
