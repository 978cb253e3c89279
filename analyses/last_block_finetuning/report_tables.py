"""Markdown tables of the seed experiments' results, as quoted in README.md.

Reads the tables the experiment scripts wrote under ``figures/finetune/seed00*/`` (run them, or
their ``--summarise-only``, first) and prints one markdown table per experiment found: mean and
95% t-interval over seeds, and paired differences. Usage::

    python -m analyses.last_block_finetuning.report_tables [--root figures/finetune]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]


def interval(mean: float, low: float, high: float, signed: bool = False) -> str:
    """``0.962 [0.957, 0.967]``; ``+0.004 [-0.001, 0.009]`` with ``signed``."""
    fmt = "{:+.3f}" if signed else "{:.3f}"
    if math.isnan(low):
        return fmt.format(mean)
    return f"{fmt.format(mean)} [{fmt.format(low)}, {fmt.format(high)}]"


def short(model: str) -> str:
    return model.replace("gradflow-", "")


def seed000(path: Path) -> str:
    best = pd.read_csv(path / "best_lr.csv")
    diff = pd.read_csv(path / "differences_best_lr.csv")
    lines = ["| model | task (metric) | full | drop1 | reinit1 | drop1 - full | reinit1 - full |",
             "|---|---|---|---|---|---|---|"]
    metric = {"brown-pos": "accuracy", "brown-propn": "entity F1"}
    for (model, task), rows in best.groupby(["model", "task"], sort=True):
        rows = rows.set_index("variant")
        cells = [f"{interval(r['mean'], r.ci_low, r.ci_high)} @ {r.lr:g}"
                 for r in (rows.loc[v] for v in ("full", "drop1", "reinit1"))]
        d = diff[(diff.model == model) & (diff.task == task)].set_index("variant")
        cells += [interval(d.loc[v].mean_difference, d.loc[v].ci_low, d.loc[v].ci_high, signed=True)
                  for v in ("drop1", "reinit1")]
        lines.append(f"| {short(model)} | {task} ({metric.get(task, '')}) | " + " | ".join(cells) + " |")
    contrast = path / "model_contrast.csv"
    if contrast.exists() and contrast.stat().st_size > 1:  # empty when the two embedded models were not both run
        table = pd.read_csv(contrast)
        lines += ["", "| task | (variant - full) on mini-en minus the same on the twin |", "|---|---|"]
        for r in table.itertuples(index=False):
            lines.append(f"| {r.task}, {r.variant} | "
                         f"{interval(r.difference_of_differences, r.ci_low, r.ci_high, signed=True)} |")
    n = int(diff.n_pairs.min())
    lines.append("")
    lines.append(f"Test score at each variant's best validation learning rate (`@ lr`); differences paired by "
                 f"seed ({n} seeds), 95% t-intervals.")
    return "\n".join(lines)


def seed000_by_lr(path: Path) -> str:
    diff = pd.read_csv(path / "differences.csv")
    diff = diff[diff.split == "test"]
    lrs = sorted(diff.lr.unique())
    lines = ["| model | task | variant | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
             "|---|---|---|" + "---|" * len(lrs)]
    for (model, task, variant), rows in diff.groupby(["model", "task", "variant"], sort=True):
        rows = rows.set_index("lr")
        cells = [interval(rows.loc[lr].mean_difference, rows.loc[lr].ci_low, rows.loc[lr].ci_high, signed=True)
                 for lr in lrs]
        lines.append(f"| {short(model)} | {task} | {variant} - full | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seed003(path: Path) -> str:
    best = pd.read_csv(path / "best_lr.csv")
    diff = pd.read_csv(path / "differences_best_lr.csv")
    ks = sorted(best.blocks_kept.unique())
    lines = ["| model | " + " | ".join(f"k={k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
    for model, rows in best.groupby("model", sort=True):
        rows = rows.set_index("blocks_kept")
        lines.append(f"| {short(model)} test accuracy | "
                     + " | ".join(interval(rows.loc[k]["mean"], rows.loc[k].ci_low, rows.loc[k].ci_high)
                                  for k in ks) + " |")
        d = diff[diff.model == model].set_index("blocks_kept")
        cells = [interval(d.loc[k].mean_difference, d.loc[k].ci_low, d.loc[k].ci_high, signed=True)
                 if k in d.index else "0 (baseline)" for k in ks]
        lines.append(f"| {short(model)} minus k=L | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Each k at its own best validation learning rate; differences paired by seed, 95% t-intervals.")
    return "\n".join(lines)


def seed001(path: Path) -> str:
    finals = pd.read_csv(path / "finals.csv")
    finals = finals[finals.split == "test"]
    effect = pd.read_csv(path / "cmlm_effect.csv")
    effect = effect[effect.split == "test"]
    arms = ["head_only", "full", "cmlm_head_only", "cmlm_full"]
    lines = ["| model | " + " | ".join(arms) + " | MLM effect, head only | MLM effect, full |",
             "|---|" + "---|" * (len(arms) + 2)]
    for model, rows in finals.groupby("model", sort=True):
        rows = rows.set_index("arm")
        cells = [interval(rows.loc[a]["mean"], rows.loc[a].ci_low, rows.loc[a].ci_high) for a in arms]
        e = effect[effect.model == model].set_index("mode")
        cells += [interval(e.loc[m].mean_difference, e.loc[m].ci_low, e.loc[m].ci_high, signed=True)
                  for m in ("head_only", "full")]
        lines.append(f"| {short(model)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT / "figures" / "finetune")
    args = parser.parse_args()
    sections = [("seed000", "seed 000: last block dropped / re-initialised", seed000),
                ("seed000", "seed 000: paired differences at every learning rate (test)", seed000_by_lr),
                ("seed003", "seed 003: blocks kept (movie-sentiment)", seed003),
                ("seed001", "seed 001: continued MLM (test)", seed001)]
    for folder, title, make in sections:
        path = args.root / folder
        if not path.exists():
            continue
        try:
            table = make(path)
        except FileNotFoundError as err:
            table = f"(missing table: {err.filename}; run the experiment or its --summarise-only)"
        print(f"### {title}\n\n{table}\n")


if __name__ == "__main__":
    main()
