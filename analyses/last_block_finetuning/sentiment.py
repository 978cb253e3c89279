"""Issue 15: seed 003 repeated where it adds information: k = L-1, L and the repaired L, 10 seeds.

Sentiment (movie-sentiment, accuracy), seed 003's schedule (150 steps of 32 snippets, a seeded
4,800-example training subset, validation at steps 75 and 150, 500 validation and test examples)
at lr 5e-4 (seed 003's best learning rate of gradflow-mini-en at every k), float32. Arms of
gradflow-mini-en: ``k5`` (last block dropped), ``k6`` (full) and ``repaired6`` (the repaired
checkpoint, ``build/mini-repaired/model``; its k = 5 is bit-identical to mini-en's, so not run).
Secondary in the plan: reported without a family correction, paired by seed, with the minimum
detectable effect at 80% power where the interval spans zero.

    python -m analyses.last_block_finetuning.sentiment                 # 30 runs, ~35 min on 2 cores
    python -m analyses.last_block_finetuning.sentiment --summarise-only
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pandas as pd

from analyses.last_block_finetuning.grid import GridRun, collect, run_grid, write_plan
from gradflow.analysis.experiment_stats import minimum_detectable_effect, paired_test

ROOT = Path(__file__).resolve().parents[2]
REPAIRED = "build/mini-repaired/model"
ARMS = {"k5": ("gradflow-mini-en", 1), "k6": ("gradflow-mini-en", 0), "repaired6": (str(ROOT / REPAIRED), 0)}


def plan(seeds: list[int], data_root: str) -> list[GridRun]:
    runs = []
    for seed in seeds:
        for arm, (model, drop) in ARMS.items():
            config = dict(model=model, task="movie-sentiment", lr=5e-4, steps=150, batch_size=32, eval_every=75,
                          train_limit=4800, eval_limit=500, seed=seed, warmup=0.1, max_length=128, autocast=None,
                          data_root=data_root, drop_last=drop)
            runs.append(GridRun(f"{arm}__s{seed}", {"arm": arm, "seed": seed, "task": "movie-sentiment"}, config))
    return runs


def summarise(out: Path) -> pd.DataFrame:
    _, finals = collect(out)
    test = finals[(finals.split == "test") & (finals.metric == "accuracy")].pivot(index="seed", columns="arm",
                                                                                   values="value")
    rows = []
    for arm in ("k5", "repaired6"):
        if {arm, "k6"} <= set(test.columns):
            d = (test[arm] - test["k6"]).dropna().to_numpy()
            if d.size >= 2:
                t = paired_test(d)
                mde = minimum_detectable_effect(t.sd, t.n) if t.ci_low <= 0 <= t.ci_high else math.nan
                rows.append({"contrast": f"{arm} - k6", "mean": t.mean, "ci_low": t.ci_low, "ci_high": t.ci_high,
                             "p": t.p_value, "n_pairs": t.n, "mde_alpha05": mde})
    for arm in test.columns:
        v = test[arm].dropna()
        rows.append({"contrast": f"{arm} (test accuracy)", "mean": v.mean(), "n_pairs": v.size,
                     "collapsed": int((v < 0.55).sum())})
    table = pd.DataFrame(rows)
    table.to_csv(out / "summary.csv", index=False, float_format="%.6g")
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--data-root", default=str(ROOT / "data/tasks"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--summarise-only", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "figures/finetune/last-block-finetuning/sentiment")
    args = parser.parse_args()
    if not args.summarise_only:
        runs = plan(args.seeds, args.data_root)
        args.out.mkdir(parents=True, exist_ok=True)
        write_plan(runs, args.out, {"plan": "figures/finetune/last-block-finetuning/plan.md"})
        run_grid(runs, args.out, workers=args.workers)
    print(summarise(args.out).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
