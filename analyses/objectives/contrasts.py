"""Issue 52's fine-tuning contrasts (``figures/objectives/plan.md``) from per-run summaries; pure functions.

Input: one row per run as ``powered_report.run_summaries`` gives it (model, arm, task, seed, auc, test, ...):
the AUC is the validation curve's mean score, ``experiment_stats.area_under_curve`` (steps 15..120 at lr 1e-4,
60..S at lr 1e-5), as in the 6-block and 12-block experiments whose runs are reused.

- Family A (Holm, m = 12): each new model, ``arm - full`` for drop1, reinit1, repair1, AUC, both tasks;
- secondary (no correction): ``(model drop1 - full) - (mini-en drop1 - full)`` for mask40, diffusion and the twin,
  both tasks;
- Family B (Holm, m = 8): each of the four models, ``drop1 - full`` and ``reinit1 - full``, brown-pos, lr 1e-5,
  with the lr 1e-4 value of the same contrast beside it.

Every contrast is a two-sided paired t-test by seed (``experiment_stats.paired_test``); Holm and the minimum
detectable effects (80% power, exact non-central t, at 0.05 and 0.05/m for each contrast with Holm p >= 0.05)
are ``powered_report.tested``'s. A family is tested only when each of its cells has every expected seed (Holm
ranks a family's contrasts together); a secondary contrast only when its four cells have.
"""

from __future__ import annotations

import math

import pandas as pd

from analyses.last_block_finetuning.powered_report import METRIC, interval, paired_differences, tested
from analyses.objectives.design import ALL_MODELS, DIFFUSION, LR1E4_SEEDS, MASK40, MINI, NEW_MODELS, TWIN
from gradflow.analysis.experiment_stats import minimum_detectable_effect, paired_test

TASKS = tuple(METRIC)
FAMILY_A_ARMS = ("drop1", "reinit1", "repair1")
FAMILY_B_ARMS = ("drop1", "reinit1")
FAMILY_A, FAMILY_B = 12, 8
FAMILY_B_TASK = "brown-pos"
SECONDARY_MODELS = (MASK40, DIFFUSION, TWIN)
Cell = tuple[str, str, str]  # (model, task, arm)


def short(model: str) -> str:
    """``gradflow-mini-en-mask40`` -> ``mini-en-mask40``."""
    return model.replace("gradflow-", "")


def family_a_cells() -> list[Cell]:
    """The (model, task, arm) cells Family A pairs: the new models' four arms on both tasks."""
    return [(m, t, a) for m in NEW_MODELS for t in TASKS for a in ("full", *FAMILY_A_ARMS)]


def family_b_cells() -> list[Cell]:
    """The cells Family B pairs: the four models' three arms on brown-pos."""
    return [(m, FAMILY_B_TASK, a) for m in ALL_MODELS for a in ("full", *FAMILY_B_ARMS)]


def secondary_cells(model: str, task: str) -> list[Cell]:
    """The four cells of one model contrast: ``model`` and mini-en, full and drop1."""
    return [(m, task, a) for m in (model, MINI) for a in ("full", "drop1")]


def missing_cells(summaries: pd.DataFrame, cells: list[Cell], seeds: tuple[int, ...]) -> list[str]:
    """The cells lacking one of ``seeds``, as ``model task arm: k of n seeds (missing ...)`` (empty: complete)."""
    have = set() if summaries.empty else set(zip(summaries.model, summaries.task, summaries.arm, summaries.seed))
    lines = []
    for model, task, arm in cells:
        absent = [s for s in seeds if (model, task, arm, s) not in have]
        if absent:
            which = "" if len(absent) == len(seeds) else f" (missing {', '.join(map(str, absent))})"
            lines.append(f"{short(model)} {task} {arm}: {len(seeds) - len(absent)} of {len(seeds)} seeds{which}")
    return lines


def refusal(family: str, m: int, missing: list[str]) -> str:
    """The one sentence saying why ``family`` is not computed."""
    return (f"{family} is not computed yet: Holm ranks all {m} of its contrasts together and {len(missing)} of its "
            f"cells lack seeds ({'; '.join(missing)}).")


def _on(summaries: pd.DataFrame, seeds: tuple[int, ...]) -> pd.DataFrame:
    return summaries[summaries.seed.isin(seeds)]


def family_a(summaries: pd.DataFrame, seeds: tuple[int, ...] = LR1E4_SEEDS) -> pd.DataFrame:
    """Family A's 12 contrasts (Holm over 12, MDEs at 0.05 and 0.05/12); ValueError when a cell lacks a seed."""
    missing = missing_cells(summaries, family_a_cells(), seeds)
    if missing:
        raise ValueError(refusal("Family A", FAMILY_A, missing))
    frame = _on(summaries, seeds)
    rows = [{"family": "A", "model": m, "arm": a, "contrast": f"{short(m)} {a} - full", "task": t, "value": "auc",
             "diffs": paired_differences(frame, m, t, a, "auc")}
            for m in NEW_MODELS for a in FAMILY_A_ARMS for t in TASKS]
    return tested(rows, FAMILY_A)


def family_b(summaries: pd.DataFrame, seeds: tuple[int, ...]) -> pd.DataFrame:
    """Family B's 8 contrasts (Holm over 8, MDEs at 0.05 and 0.05/8); ValueError when a cell lacks a seed."""
    missing = missing_cells(summaries, family_b_cells(), seeds)
    if missing:
        raise ValueError(refusal("Family B", FAMILY_B, missing))
    frame = _on(summaries, seeds)
    rows = [{"family": "B", "model": m, "arm": a, "contrast": f"{short(m)} {a} - full", "task": FAMILY_B_TASK,
             "value": "auc", "diffs": paired_differences(frame, m, FAMILY_B_TASK, a, "auc")}
            for m in ALL_MODELS for a in FAMILY_B_ARMS]
    return tested(rows, FAMILY_B)


def _untested(row: dict, d: pd.Series) -> dict:
    """``row`` with the uncorrected paired t-test of ``d`` and, for p >= 0.05, the MDE at 80% power, alpha 0.05."""
    t = paired_test(d.to_numpy())
    return {**row, "computed": True, "note": "", "mean": t.mean, "ci_low": t.ci_low, "ci_high": t.ci_high,
            "p": t.p_value, "sd": t.sd, "n_pairs": t.n,
            "mde_alpha05": minimum_detectable_effect(t.sd, t.n) if t.p_value >= 0.05 else math.nan}


def secondary(summaries: pd.DataFrame, seeds: tuple[int, ...] = LR1E4_SEEDS) -> pd.DataFrame:
    """The model contrasts ``(model drop1 - full) - (mini-en drop1 - full)``, AUC at lr 1e-4, paired by seed, no
    correction; a contrast whose four cells lack a seed is a row with ``computed`` False and the reason."""
    frame = _on(summaries, seeds)
    rows = []
    for model in SECONDARY_MODELS:
        for task in TASKS:
            row = {"model": model, "contrast": f"({short(model)} drop1 - full) - (mini-en drop1 - full)",
                   "task": task, "value": "auc"}
            missing = missing_cells(summaries, secondary_cells(model, task), seeds)
            if missing:
                rows.append({**row, "computed": False, "n_pairs": 0,
                             "note": f"not computed: {'; '.join(missing)}"})
                continue
            d = (paired_differences(frame, model, task, "drop1", "auc")
                 - paired_differences(frame, MINI, task, "drop1", "auc")).dropna()
            rows.append(_untested(row, d))
    return pd.DataFrame(rows)


def at_lr1e4(summaries: pd.DataFrame, model: str, arm: str, seeds: tuple[int, ...] = LR1E4_SEEDS) -> str:
    """The lr 1e-4 value of Family B's contrast ``model arm - full`` on brown-pos (AUC, paired by seed), as
    ``+mean [+low, +high] (p, n)``, or why there is none."""
    cells = [(model, FAMILY_B_TASK, a) for a in ("full", arm)]
    if summaries.empty or not ((summaries.model == model) & (summaries.arm == arm)).any():
        return "not run at lr 1e-4"
    missing = missing_cells(summaries, cells, seeds)
    if missing:
        return f"not computed: {'; '.join(missing)}"
    t = paired_test(paired_differences(_on(summaries, seeds), model, FAMILY_B_TASK, arm, "auc").to_numpy())
    return f"{t.mean:+.4f} [{t.ci_low:+.4f}, {t.ci_high:+.4f}] (p {t.p_value:.3g}, n {t.n})"


def seeds_claim(table: pd.DataFrame) -> str:
    """The plan's reading of Family B: the seed's claim holds in its regime iff mini-en ``drop1 - full`` is
    positive with Holm p < 0.05."""
    row = next(table[(table.model == MINI) & (table.arm == "drop1")].itertuples())
    holds = row.mean > 0 and row.p_holm < 0.05
    return (f"The seed's claim {'holds' if holds else 'does not hold'} in its regime (lr 1e-5): mini-en drop1 - full "
            f"{interval(row)} in AUC on brown-pos, Holm p {row.p_holm:.3g} (the plan asks for a positive "
            "difference with Holm p < 0.05).")
