"""The fine-tuning parts of ``figures/objectives/plan.md`` as data: models, arms, tasks, configs and runs.

- ``lr1e-4`` (Part 3): the two new models, arms full/drop1/reinit1/repair1, brown-pos and brown-propn, seeds
  0-9, exactly the 6-block experiment's regime (a) (``powered_experiment.REGIMES["convergence"]``: lr 1e-4,
  120 steps of 8, validation every 15 steps on 128 sentences, test on 250, an 8,000-sentence training subset);
- ``pilot`` (Part 4's pilot): the four models, arm full, brown-pos, seed 0, lr 1e-5, 2,400 steps, validation
  every 60 steps;
- ``seed-regime`` (Part 4): the four models, arms full/drop1/reinit1, brown-pos, lr 1e-5, S steps (the pilot's
  decision), validation every 60 steps, the seeds given.

Everything not named here is regime (a)'s: the same subsets, data order and head initialisation per seed as the
committed runs of ``figures/finetune/last-block-finetuning/convergence/``. The run config format and run ids are
``powered_experiment``'s, so ``grid.run_grid`` resumes and ``grid.collect`` reads them alike.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

from analyses.last_block_finetuning.grid import GridRun
from analyses.last_block_finetuning.powered_experiment import REGIMES, TASKS

ROOT = Path(__file__).resolve().parents[2]
PLAN = "figures/objectives/plan.md"
OUT = ROOT / "figures/objectives/finetune"  # the experiment folder: one subfolder per part, the report's tables
CONVERGENCE = ROOT / "figures/finetune/last-block-finetuning/convergence"  # mini-en's and the twin's lr 1e-4 runs
MINI, TWIN = "gradflow-mini-en", "gradflow-mini-en-alltoken"
MASK40, DIFFUSION = "gradflow-mini-en-mask40", "gradflow-mini-en-diffusion"
NEW_MODELS = (MASK40, DIFFUSION)
ALL_MODELS = (MINI, TWIN, MASK40, DIFFUSION)
REPAIR_ARM = "repair1"
ARM_CHANGES: dict[str, dict] = {"full": {}, "drop1": {"drop_last": 1}, "reinit1": {"reinit_last": 1}}
LOW_LR = 1e-5  # Part 4: 1% of the pretraining peak
EVAL_EVERY_LOW = 60  # Part 4's validation interval, and the multiple S is rounded up to
PILOT_CAP = 2400  # the pilot's step cap
LR1E4_SEEDS = tuple(range(10))


@dataclass(frozen=True)
class Part:
    """One part of the plan: its models, arms and tasks, the ``regime`` factor its runs carry, the changes to
    regime (a)'s config, its default seeds (None: given on the command line), whether those are its only seeds,
    and whether ``--steps`` sets the steps."""

    name: str
    models: tuple[str, ...]
    arms: tuple[str, ...]
    tasks: tuple[str, ...]
    regime: str
    changes: dict = field(default_factory=dict)
    seeds: tuple[int, ...] | None = None
    seeds_fixed: bool = False
    steps_given: bool = False


PARTS: dict[str, Part] = {
    "lr1e-4": Part("lr1e-4", NEW_MODELS, ("full", "drop1", "reinit1", REPAIR_ARM), ("brown-pos", "brown-propn"),
                   "convergence", seeds=LR1E4_SEEDS),
    "pilot": Part("pilot", ALL_MODELS, ("full",), ("brown-pos",), "lr1e-5",
                  {"lr": LOW_LR, "steps": PILOT_CAP, "eval_every": EVAL_EVERY_LOW}, seeds=(0,), seeds_fixed=True),
    "seed-regime": Part("seed-regime", ALL_MODELS, ("full", "drop1", "reinit1"), ("brown-pos",), "lr1e-5",
                        {"lr": LOW_LR, "eval_every": EVAL_EVERY_LOW}, steps_given=True),
}


def repaired_dir(model: str) -> str:
    """Where ``gradflow repair`` (its defaults) writes ``model``'s repaired copy, relative to the repository root."""
    return f"build/{model}-repaired/model"


def arm_change(arm: str, model: str) -> dict:
    """The run config's changes for ``arm`` of ``model`` (repair1: fine-tune the repaired copy instead)."""
    if arm == REPAIR_ARM:
        return {"model": str(ROOT / repaired_dir(model))}
    return dict(ARM_CHANGES[arm])


def regime_config(part: Part, steps: int | None = None) -> dict:
    """Regime (a)'s schedule with ``part``'s changes (and ``steps`` where the part takes them)."""
    if part.steps_given:
        if steps is None or steps < EVAL_EVERY_LOW or steps % EVAL_EVERY_LOW:
            raise ValueError(f"part {part.name} needs --steps S, a positive multiple of {EVAL_EVERY_LOW} (the "
                             f"pilot's decision, {PLAN}); got {steps}")
        return {**REGIMES["convergence"], **part.changes, "steps": steps}
    if steps is not None:
        raise ValueError(f"part {part.name} has its steps fixed by the plan; --steps is for seed-regime only")
    return {**REGIMES["convergence"], **part.changes}


def plan(part_name: str, seeds: tuple[int, ...] | list[int] | None = None, models: tuple[str, ...] | None = None,
         steps: int | None = None, device: str = "cpu", autocast: str | None = None,
         data_root: str = str(ROOT / "data/tasks")) -> list[GridRun]:
    """The runs of one part for ``seeds`` and ``models`` (default: all the part's), seed by seed (seed 0's runs
    first, so that a cut leaves every cell with the same seeds). Raises ValueError on a model, seed or step
    count the part does not have."""
    part = PARTS[part_name]
    chosen = part.models if models is None else tuple(models)
    if not chosen or set(chosen) - set(part.models):
        raise ValueError(f"part {part.name} runs the models {', '.join(part.models)}; got {', '.join(chosen)}")
    if seeds is None:
        if part.seeds is None:
            raise ValueError(f"part {part.name} needs --seeds (the seeds rule's n: seeds 0..n-1, {PLAN})")
        seeds = part.seeds
    seeds = tuple(seeds)
    if part.seeds_fixed and seeds != part.seeds:
        raise ValueError(f"part {part.name} runs seed {', '.join(map(str, part.seeds))} only; got {seeds}")
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"seeds must be distinct non-negative integers; got {seeds}")
    regime = regime_config(part, steps)
    runs = []
    for seed, task, model, arm in itertools.product(seeds, part.tasks, [m for m in part.models if m in chosen],
                                                    part.arms):
        config = dict(model=model, task=task, seed=seed, warmup=0.1, max_length=128, autocast=autocast,
                      data_root=data_root, device=device, **regime, **TASKS[task])
        config.update(arm_change(arm, model))
        factors = {"model": model, "arm": arm, "task": task, "seed": seed, "regime": part.regime,
                   "train_sentences": config["train_limit"], "part": part.name, "lr": config["lr"],
                   "steps": config["steps"]}
        runs.append(GridRun(f"{model}__{task}__{arm}__s{seed}", factors, config))
    return runs


def repairs_needed(runs: list[GridRun]) -> list[tuple[str, Path]]:
    """(model, repaired model folder) for each model whose repair1 arm is among ``runs`` and whose repaired copy
    is not on disk yet (a command that runs no repair1 cell makes none)."""
    needed = {}
    for run in runs:
        if run.factors["arm"] == REPAIR_ARM:
            folder = ROOT / repaired_dir(run.factors["model"])
            if not folder.is_dir():
                needed[run.factors["model"]] = folder
    return list(needed.items())
