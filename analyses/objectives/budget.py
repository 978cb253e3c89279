"""Part 4's step-budget and seeds rules (``figures/objectives/plan.md``) applied to the pilot's runs.

- Step budget: a model's converged step is the first validation step whose accuracy is within 0.005 of the best
  accuracy it reaches by the cap (2,400 steps); S is the largest converged step of the four models, rounded up to
  a multiple of 60. A model whose best accuracy is first reached at the cap's last validation has not flattened
  within the cap: it is flagged "did not converge", and S is then the cap (its converged step lies at or beyond
  the cap, so the largest of the four is the cap).
- Seeds: n is the largest n <= 10 with 12 cells x n runs x S steps x (the pilot's seconds per step) within
  8 CPU-hours; below 6, n is 6 and the overrun is reported. The seconds per step are the four pilot runs'
  mean of ``result.json`` seconds / steps (one thread each, evaluation every 60 steps included, as in the
  experiment); with four models x three arms the projected CPU time is 12 x n x S x that mean.

``decide(pilot_dir)`` writes ``decision.json`` beside the pilot's runs and returns it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from analyses.last_block_finetuning.grid import collect
from analyses.objectives.design import ALL_MODELS, EVAL_EVERY_LOW, PILOT_CAP, PLAN

TOLERANCE = 0.005  # "within 0.005 of the best accuracy"
BUDGET_CPU_HOURS = 8.0
CELLS = 12  # four models x three arms
MOST_SEEDS, LEAST_SEEDS = 10, 6
WITHIN = 1e-12  # "within" is inclusive: a float rounding of an exact boundary counts as within


@dataclass(frozen=True)
class Convergence:
    """One pilot curve under the rule: its first step within ``TOLERANCE`` of its best, the best and where it is
    first reached, the last validation step, and whether the best is first reached there (did not converge)."""

    converged_step: int
    best: float
    best_step: int
    last_step: int
    did_not_converge: bool


@dataclass(frozen=True)
class SeedsDecision:
    """The seeds rule's n, the projected CPU-hours of 12 x n runs of S steps, and the hours over the budget."""

    n: int
    projected_cpu_hours: float
    overrun_cpu_hours: float


def convergence(steps: np.ndarray, values: np.ndarray, tolerance: float = TOLERANCE) -> Convergence:
    """The converged step of one validation curve (``values`` at increasing ``steps``), by the plan's rule."""
    steps, values = np.asarray(steps), np.asarray(values, dtype=float)
    if steps.ndim != 1 or steps.shape != values.shape or steps.size == 0 or np.any(np.diff(steps) <= 0):
        raise ValueError("a curve needs at least one (step, value) point, steps strictly increasing")
    best_index = int(np.argmax(values))  # the first step reaching the best
    best = float(values[best_index])
    first = int(np.flatnonzero(values >= best - tolerance - WITHIN)[0])
    return Convergence(int(steps[first]), best, int(steps[best_index]), int(steps[-1]),
                       best_index == steps.size - 1)


def step_budget(curves: Mapping[str, tuple[np.ndarray, np.ndarray]], cap: int = PILOT_CAP,
                every: int = EVAL_EVERY_LOW, tolerance: float = TOLERANCE) -> tuple[int, dict[str, Convergence]]:
    """S for the given pilot curves (model -> (steps, accuracies), each ending at ``cap``) and each model's
    :class:`Convergence`: the cap when any model did not converge, else the largest converged step rounded up to
    a multiple of ``every``."""
    if not curves:
        raise ValueError("the step budget needs the pilot's curves")
    found = {}
    for model, (steps, values) in curves.items():
        found[model] = convergence(steps, values, tolerance)
        if found[model].last_step != cap:
            raise ValueError(f"{model}'s pilot curve ends at step {found[model].last_step}, not at the cap {cap}")
    if any(c.did_not_converge for c in found.values()):
        return cap, found
    largest = max(c.converged_step for c in found.values())
    return min(cap, math.ceil(largest / every) * every), found


def seeds_for_budget(steps: int, seconds_per_step: float, cells: int = CELLS,
                     budget_hours: float = BUDGET_CPU_HOURS, most: int = MOST_SEEDS,
                     least: int = LEAST_SEEDS) -> SeedsDecision:
    """The largest n <= ``most`` with ``cells`` x n runs x ``steps`` x ``seconds_per_step`` within
    ``budget_hours`` CPU-hours; ``least`` (and the overrun) when that is below ``least``."""
    if steps < 1 or not seconds_per_step > 0:
        raise ValueError(f"the seeds rule needs steps >= 1 and seconds per step > 0; got {steps}, {seconds_per_step}")

    def hours(n: int) -> float:
        return cells * n * steps * seconds_per_step / 3600.0

    fitting = [n for n in range(most, 0, -1) if hours(n) <= budget_hours * (1 + WITHIN)]
    n = fitting[0] if fitting and fitting[0] >= least else least
    return SeedsDecision(n, hours(n), max(0.0, hours(n) - budget_hours))


def pilot_curves(pilot_dir: Path, models: tuple[str, ...] = ALL_MODELS
                 ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, float]]:
    """(model -> validation accuracy curve, model -> seconds per step) of the pilot's finished runs; SystemExit
    naming the models whose pilot run is not finished."""
    runs = pilot_dir / "runs"
    done = {json.loads(p.read_text())["model"]: p.parent for p in sorted(runs.glob("*/factors.json"))
            if (p.parent / "result.json").is_file()} if runs.is_dir() else {}
    missing = [m for m in models if m not in done]
    if missing:
        raise SystemExit(f"the pilot's decision needs all {len(models)} pilot runs; not finished under {runs}: "
                         f"{', '.join(missing)}")
    curves, _ = collect(pilot_dir)
    val = curves[(curves.split == "validation") & (curves.metric == "accuracy") & curves.model.isin(models)]
    out = {m: (g.sort_values("step").step.to_numpy(), g.sort_values("step").value.to_numpy())
           for m, g in val.groupby("model")}
    seconds = {}
    for model in models:
        result = json.loads((done[model] / "result.json").read_text())
        seconds[model] = float(result["seconds"]) / int(result["steps"])
    return {m: out[m] for m in models}, seconds


def decide(pilot_dir: Path, models: tuple[str, ...] = ALL_MODELS, cap: int = PILOT_CAP) -> dict:
    """Apply both rules to the pilot under ``pilot_dir``; write ``pilot_dir/decision.json`` and return it."""
    curves, seconds = pilot_curves(pilot_dir, models)
    steps, found = step_budget(curves, cap)
    per_step = float(np.mean(list(seconds.values())))
    seeds = seeds_for_budget(steps, per_step)
    decision = {
        "plan": PLAN, "rule": "step budget and seeds (Part 4)", "cap": cap, "every": EVAL_EVERY_LOW,
        "tolerance": TOLERANCE, "S": steps, "n": seeds.n, "seeds": list(range(seeds.n)),
        "did_not_converge": [m for m, c in found.items() if c.did_not_converge],
        "seconds_per_step_mean": per_step, "budget_cpu_hours": BUDGET_CPU_HOURS, "cells": CELLS,
        "projected_cpu_hours": seeds.projected_cpu_hours, "overrun_cpu_hours": seeds.overrun_cpu_hours,
        "models": {m: {**asdict(found[m]), "seconds_per_step": seconds[m]} for m in models},
    }
    (pilot_dir / "decision.json").write_text(json.dumps(decision, indent=2) + "\n", encoding="utf-8")
    return decision


def describe(decision: dict) -> str:
    """The decision as lines to print (and to copy into the plan's decision entry)."""
    lines = [f"{m}: converged at step {c['converged_step']} (best {c['best']:.4f} first at step {c['best_step']}"
             f"{'; did not converge within the cap' if c['did_not_converge'] else ''}; "
             f"{c['seconds_per_step']:.3f} s a step)" for m, c in decision["models"].items()]
    if decision["did_not_converge"]:
        lines.append(f"the full arm did not converge within {decision['cap']} steps for "
                     f"{', '.join(decision['did_not_converge'])}: S is the cap")
    lines.append(f"S = {decision['S']} steps; n = {decision['n']} seeds (0-{decision['n'] - 1}): "
                 f"{decision['cells']} cells x {decision['n']} x {decision['S']} steps x "
                 f"{decision['seconds_per_step_mean']:.3f} s = {decision['projected_cpu_hours']:.2f} CPU-hours "
                 f"(budget {decision['budget_cpu_hours']:g}"
                 + (f"; overrun {decision['overrun_cpu_hours']:.2f} h" if decision["overrun_cpu_hours"] > 0 else "")
                 + ")")
    return "\n".join(lines)
