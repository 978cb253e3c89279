"""Issue 15: fine-tuning with the last block full, dropped, re-initialised or repaired, in two regimes.

Pre-registered in ``figures/finetune/last-block-finetuning/plan.md`` (committed before any run). Per model
(gradflow-mini-en: ``full``, ``drop1``, ``reinit1``, ``repair1``; the all-token twin: ``full``,
``drop1``, ``reinit1``), task (brown-pos accuracy, brown-propn entity F1 with balanced class weights)
and seed:

- ``--regime convergence`` (a): lr 1e-4, 120 steps of 8 sentences from a seeded 8,000-sentence
  training subset, validation every 15 steps on a seeded 128-sentence subset, final scores (test:
  250 sentences);
- ``--regime few-sample`` (b): 250 training sentences (``--train-sentences``), lr 5e-4, at most
  120 steps of 8, validation every 10 steps (128 sentences), early stopping with patience 3,
  the best checkpoint scored on 250 test sentences (mini-en's four arms; ``--secondary`` adds the twin).

(The schedules are the plan's deviation 1, see plan.md.)

``repair1`` is ``build/mini-repaired/model`` (made by ``gradflow repair`` with its defaults when
missing). Runs are resumable (``grid.run_grid``); ``--seeds 0`` is the budget-measuring first slice; ``--models mlm`` (or ``twin``) runs one model's cells.
Outputs under ``figures/finetune/last-block-finetuning/<regime>/``. ``--pair mini12-en`` runs the same design on the
12-block pair (issue 31, ``figures/twelve-blocks/plan.md``: regime (a), its repair in ``build/mini12-repaired``)
into ``figures/twelve-blocks/finetune/<regime>/``.

    python -m analyses.last_block_finetuning.powered_experiment --regime convergence --seeds 0   # first slice: 12 runs
    python -m analyses.last_block_finetuning.powered_experiment --regime few-sample              # all 10 seeds
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from analyses.last_block_finetuning.grid import GridRun, run_grid, write_plan

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Pair:
    """An MLM model and its all-token twin, with where the MLM model's repaired copies go, the plan and the
    default output folder of its experiment."""

    mlm: str
    twin: str
    repaired: str  # ``gradflow repair`` with its defaults (all-positions objective): the repair1 arm
    repaired_mlm: str  # the same repair with the MLM objective (deviation 3's exploratory control)
    plan: str
    out: str

    def arms(self) -> dict[str, dict[str, dict]]:
        """model -> arm -> the run config's changes."""
        return {self.mlm: {"full": {}, "drop1": {"drop_last": 1}, "reinit1": {"reinit_last": 1},
                           "repair1": {"model": self.repaired}, "repair1-mlm": {"model": self.repaired_mlm}},
                self.twin: {"full": {}, "drop1": {"drop_last": 1}, "reinit1": {"reinit_last": 1}}}


PAIRS = {
    "mini-en": Pair("gradflow-mini-en", "gradflow-mini-en-alltoken", "build/mini-repaired/model",
                    "build/mini-repaired-mlm/model", "figures/finetune/last-block-finetuning/plan.md",
                    "figures/finetune/last-block-finetuning"),
    # issue 31: the same experiment at twelve blocks, regime (a) only (figures/twelve-blocks/plan.md)
    "mini12-en": Pair("gradflow-mini12-en", "gradflow-mini12-en-alltoken", "build/mini12-repaired/model",
                      "build/mini12-repaired-mlm/model", "figures/twelve-blocks/plan.md",
                      "figures/twelve-blocks/finetune"),
}
TASKS = {"brown-pos": {}, "brown-propn": {"class_weights": "balanced"}}
# Deviation 1 of the plan (measured on the first slice, recorded in plan.md before any other seed ran): batch 8,
# shorter schedules, 128 validation and 250 test sentences, the twin's reinit1 and the 1,000-sentence cell left out
REGIMES = {
    "convergence": dict(lr=1e-4, steps=120, batch_size=8, eval_every=15, eval_limit=128, test_limit=250,
                        train_limit=8000),
    "few-sample": dict(lr=5e-4, steps=120, batch_size=8, eval_every=10, eval_limit=128, test_limit=250,
                       train_limit=250, patience=3),
}
SECONDARY = "reinit1"  # the twin's reinit1: run only with --secondary
EXPLORATORY = "repair1-mlm"  # the MLM model's repair1-mlm: run only with --exploratory (and only it)
TWIN_REGIMES = ("convergence",)  # the twin enters a primary contrast only in regime (a)


def plan(args: argparse.Namespace) -> list[GridRun]:
    pair = PAIRS[args.pair]
    runs = []
    chosen = {"mlm": {pair.mlm}, "twin": {pair.twin}, "both": {pair.mlm, pair.twin}}[args.models]
    for seed, task, (model, arms) in itertools.product(args.seeds, TASKS, pair.arms().items()):
        if model not in chosen:
            continue
        for arm, change in arms.items():
            if ((model, arm) == (pair.mlm, EXPLORATORY)) != args.exploratory:
                continue
            if not args.secondary and ((model, arm) == (pair.twin, SECONDARY) or
                                       (model != pair.mlm and args.regime not in TWIN_REGIMES)):
                continue
            regime = {**REGIMES[args.regime], **({"train_limit": args.train_sentences}
                                                 if args.regime == "few-sample" else {})}
            config = dict(model=model, task=task, seed=seed, warmup=0.1, max_length=128, autocast=args.autocast,
                          data_root=args.data_root, device=args.device, **regime, **TASKS[task])
            config.update({k: (str(ROOT / v) if k == "model" else v) for k, v in change.items()})
            factors = dict(model=model, arm=arm, task=task, seed=seed, regime=args.regime,
                           train_sentences=config["train_limit"])
            runs.append(GridRun(f"{model}__{task}__{arm}__s{seed}", factors, config))
    return runs


def repairs_needed(pair: Pair, runs: list[GridRun]) -> list[tuple[str, str]]:
    """(model folder, ``gradflow repair`` objective) of the repaired models that ``runs`` fine-tune and that are
    not on disk yet: a command that runs only the twin's cells makes none."""
    used = {run.config["model"] for run in runs}
    return [(folder, objective) for folder, objective in ((pair.repaired, "all-positions"), (pair.repaired_mlm, "mlm"))
            if str(ROOT / folder) in used and not (ROOT / folder).is_dir()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regime", choices=REGIMES, required=True)
    parser.add_argument("--pair", choices=PAIRS, default="mini-en", help="mini-en: the 6-block pair (issue 15); "
                        "mini12-en: the 12-block pair (issue 31, regime convergence)")
    parser.add_argument("--train-sentences", type=int, default=250, help="few-sample regime only (250 or 1000)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default figures/finetune/last-block-finetuning/<regime>[-<n>]")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--models", choices=("both", "mlm", "twin"), default="both",
                        help="which of the pair's models to run now (default both); the 12-block plan's deviation 4 "
                             "runs the MLM model's cells while the twin still trains, then the twin's")
    parser.add_argument("--secondary", action="store_true", help="also the secondary cells (the twin's reinit1; the "
                        "twin in the few-sample regime)")
    parser.add_argument("--exploratory", action="store_true", help="run only the exploratory arms (deviation 3: "
                        "repair1-mlm, the last block retrained with the MLM objective), into <regime>-exploratory")
    parser.add_argument("--device", default="cpu")
    # float32 by default: on this project's 2-core AMD EPYC machine (no AVX512-BF16) a bfloat16 CPU matmul
    # measured 1.1 GFLOP/s against 36.6 for float32 (torch 2.13, one thread), so autocast is opt-in
    parser.add_argument("--autocast", default=None, choices=["bfloat16"])
    parser.add_argument("--data-root", default=str(ROOT / "data/tasks"))
    args = parser.parse_args()
    pair = PAIRS[args.pair]
    runs = plan(args)
    for model_dir, objective in repairs_needed(pair, runs):
        subprocess.run([sys.executable, "-m", "gradflow", "repair", "--model", pair.mlm, "--objective",
                        objective, "--out", str(Path(model_dir).parent)], cwd=ROOT, check=True)
    if args.out is None:
        suffix = f"-{args.train_sentences}" if args.regime == "few-sample" else ""
        suffix += "-exploratory" if args.exploratory else ""
        args.out = ROOT / pair.out / f"{args.regime}{suffix}"
    args.out.mkdir(parents=True, exist_ok=True)
    # plan.json lists the experiment's runs for these seeds with both models, whichever --models runs now
    whole = plan(argparse.Namespace(**{**vars(args), "models": "both"}))
    write_plan(whole, args.out, {"regime": args.regime, "pair": args.pair, "plan": pair.plan,
                                 "models_run_by_this_command": args.models})
    run_grid(runs, args.out, workers=args.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
