"""Issue 52's fine-tuning parts (analyses/objectives/): the planned runs, the pilot's step-budget and seeds rules,
and the report's contrasts recomputed by hand from synthetic per-run files (no fine-tuning)."""

from __future__ import annotations

import argparse
import json
import math
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from analyses.last_block_finetuning import powered_experiment as pe
from analyses.objectives import budget, contrasts, design, finetune, report, stage
from scipy import optimize, stats

NEW = design.NEW_MODELS
FOUR = design.ALL_MODELS
TASKS = ("brown-pos", "brown-propn")
METRIC = {"brown-pos": "accuracy", "brown-propn": "entity_f1"}
FIRST_MEMBER = design.ROOT / "figures/objectives/diffusion-v1"  # the first diffusion member, history (issue 60)


# ------------------------------------------------------------------ the planned runs
def six_block_runs() -> dict[tuple[str, str, int], dict]:
    """The 6-block experiment's regime (a) configs of gradflow-mini-en, by (task, arm, seed)."""
    args = argparse.Namespace(regime="convergence", seeds=list(range(10)), exploratory=False, secondary=False,
                              train_sentences=250, autocast=None, data_root=str(design.ROOT / "data/tasks"),
                              device="cpu", pair="mini-en", models="mlm")
    return {(r.factors["task"], r.factors["arm"], r.factors["seed"]): r.config for r in pe.plan(args)}


def test_lr1e4_is_the_160_planned_runs_with_regime_a_configs() -> None:
    runs = design.plan("lr1e-4")
    assert len(runs) == len({r.run_id for r in runs}) == 160
    cells = Counter((r.factors["model"], r.factors["task"], r.factors["arm"]) for r in runs)
    assert cells == {(m, t, a): 10 for m in NEW for t in TASKS for a in ("full", "drop1", "reinit1", "repair1")}
    assert [r.factors["seed"] for r in runs[:16]] == [0] * 16  # seed by seed: a cut leaves every cell the same seeds
    reference = six_block_runs()
    for run in runs:
        model, task, arm, seed = (run.factors[k] for k in ("model", "task", "arm", "seed"))
        expected = {**reference[(task, arm, seed)], "model": model}
        if arm == "repair1":
            expected["model"] = str(design.ROOT / f"build/{model}-repaired/model")
        assert run.config == expected, run.run_id
        assert run.factors["regime"] == "convergence" and run.run_id == f"{model}__{task}__{arm}__s{seed}"
    config = runs[0].config
    assert (config["lr"], config["steps"], config["batch_size"], config["eval_every"], config["eval_limit"],
            config["test_limit"], config["train_limit"], config["warmup"], config["max_length"]) == \
        (1e-4, 120, 8, 15, 128, 250, 8000, 0.1, 128)
    assert {r.config.get("class_weights") for r in runs if r.factors["task"] == "brown-propn"} == {"balanced"}
    assert {r.config.get("class_weights") for r in runs if r.factors["task"] == "brown-pos"} == {None}


def test_pilot_is_four_full_runs_at_lr_1e5_to_the_cap() -> None:
    runs = design.plan("pilot")
    assert len(runs) == 4 and [r.factors["model"] for r in runs] == list(FOUR)
    reference = six_block_runs()[("brown-pos", "full", 0)]
    for run in runs:
        assert (run.factors["arm"], run.factors["task"], run.factors["seed"]) == ("full", "brown-pos", 0)
        assert run.config == {**reference, "model": run.factors["model"], "lr": 1e-5, "steps": 2400, "eval_every": 60}
    with pytest.raises(ValueError, match="seed 0 only"):
        design.plan("pilot", seeds=[1])
    with pytest.raises(ValueError, match="seed-regime only"):
        design.plan("pilot", steps=600)


@pytest.mark.parametrize("n", [6, 8, 10])
def test_seed_regime_is_twelve_cells_of_n_seeds_at_s_steps(n: int) -> None:
    runs = design.plan("seed-regime", seeds=range(n), steps=720)
    assert len(runs) == 12 * n
    assert Counter((r.factors["model"], r.factors["arm"]) for r in runs) == \
        {(m, a): n for m in FOUR for a in ("full", "drop1", "reinit1")}
    reference = six_block_runs()
    for run in runs:
        arm, seed = run.factors["arm"], run.factors["seed"]
        assert run.config == {**reference[("brown-pos", arm, seed)], "model": run.factors["model"], "lr": 1e-5,
                              "steps": 720, "eval_every": 60}


def test_seed_regime_needs_s_a_multiple_of_60_and_its_seeds() -> None:
    for steps in (None, 0, 90):
        with pytest.raises(ValueError, match="multiple of 60"):
            design.plan("seed-regime", seeds=[0], steps=steps)
    with pytest.raises(ValueError, match="needs --seeds"):
        design.plan("seed-regime", steps=600)
    with pytest.raises(ValueError, match="runs the models"):
        design.plan("lr1e-4", models=[design.MINI])
    with pytest.raises(SystemExit):
        finetune.parse(["--part", "seed-regime", "--seeds", "0"])


def test_models_filter_runs_part_of_the_plan_and_repairs_only_what_it_runs() -> None:
    args = finetune.parse(["--part", "lr1e-4", "--models", design.MASK40, "--seeds", "0", "1"])
    assert len(args.runs) == 16 and len(args.whole) == 160  # plan.json lists the whole part, seeds 0-9
    assert {r.factors["model"] for r in args.runs} == {design.MASK40}
    needed = design.repairs_needed(args.runs)
    assert {m for m, _ in needed} <= {design.MASK40}
    assert design.repairs_needed(design.plan("pilot")) == []
    assert design.repairs_needed(design.plan("seed-regime", seeds=[0], steps=600)) == []


def test_plan_json_keeps_the_seeds_an_earlier_command_listed(tmp_path: Path) -> None:
    """Part 4 run in slices of seeds: each command's plan.json lists every seed run so far, not its own only."""
    first = finetune.parse(["--part", "seed-regime", "--steps", "600", "--seeds", "0", "1", "--out", str(tmp_path)])
    assert len(first.runs) == len(first.whole) == 24
    (tmp_path / "plan.json").write_text(json.dumps({"runs": [{"factors": r.factors} for r in first.whole]}))
    second = finetune.parse(["--part", "seed-regime", "--steps", "600", "--seeds", "2", "--out", str(tmp_path)])
    assert len(second.runs) == 12 and len(second.whole) == 36
    assert {r.factors["seed"] for r in second.whole} == {0, 1, 2}
    assert len(finetune.parse(["--part", "pilot", "--out", str(tmp_path / "p")]).whole) == 4


def test_the_repair_record_carries_the_weights_sha256(tmp_path: Path, monkeypatch) -> None:
    import hashlib

    monkeypatch.setattr(finetune, "ROOT", tmp_path)
    folder = tmp_path / design.repaired_dir(design.MASK40)
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder.parent / "repair.json").write_text(json.dumps({"command": "gradflow repair", "objective": "all-positions"}))
    out = tmp_path / "lr1e-4"
    record = json.loads(finetune.write_repair_record(design.MASK40, out).read_text())
    assert record == {"command": "gradflow repair", "objective": "all-positions",
                      "model_safetensors_sha256": hashlib.sha256(b"weights").hexdigest()}
    assert finetune.write_repair_record(design.MASK40, out) is None  # written once
    assert finetune.write_repair_record(design.DIFFUSION, out) is None  # no repair on disk: no record


# ------------------------------------------------------------------ the pilot's rules
STEPS = np.arange(60, 2401, 60)


def test_converged_step_is_the_first_within_0005_of_the_best() -> None:
    values = 0.9 - 0.3 * np.exp(-STEPS / 200.0)  # flattens: best at the cap, but not a flat-lining failure
    values[-5:] = values[-6]  # flat at the end: the best first reached before the cap
    found = budget.convergence(STEPS, values)
    first = STEPS[np.flatnonzero(values >= values.max() - 0.005)[0]]
    assert (found.converged_step, found.did_not_converge) == (first, False)
    exact = np.array([0.5, 0.795, 0.8, 0.8])  # exactly 0.005 below the best counts as within
    assert budget.convergence(np.array([60, 120, 180, 240]), exact).converged_step == 120


def test_step_budget_rounds_up_and_takes_the_largest_model() -> None:
    steps = np.arange(50, 2401, 50)  # validation every 50: converged steps are not multiples of 60
    early = np.where(steps >= 150, 0.9, 0.5)
    late = np.where(steps >= 650, 0.9, 0.5)
    late[-1] = 0.899  # the best first reached before the cap's last validation
    s, found = budget.step_budget({"a": (steps, early), "b": (steps, late)}, cap=2400)
    assert (found["a"].converged_step, found["b"].converged_step) == (150, 650)
    assert s == 660  # 650 rounded up to a multiple of 60
    s, _ = budget.step_budget({"a": (STEPS, np.where(STEPS >= 120, 0.9, 0.5))}, cap=2400)
    assert s == 120  # already a multiple


def test_a_curve_still_rising_at_the_cap_did_not_converge_and_s_is_the_cap() -> None:
    rising = 0.5 + 1e-5 * STEPS  # best at the cap's last validation
    flat = np.where(STEPS >= 300, 0.9, 0.5)
    s, found = budget.step_budget({"flat": (STEPS, flat), "rising": (STEPS, rising)}, cap=2400)
    assert found["rising"].did_not_converge and not found["flat"].did_not_converge
    assert found["rising"].converged_step == 1920  # within 0.005 of the best from 1,920 on, yet not converged
    assert s == 2400
    with pytest.raises(ValueError, match="not at the cap"):
        budget.step_budget({"short": (STEPS[:-1], flat[:-1])}, cap=2400)


def test_seeds_rule() -> None:
    # 12 x n x S x s/step within 8 h = 28,800 s
    assert budget.seeds_for_budget(600, 0.3).n == 10  # 2,160 s a seed: 13 would fit, capped at 10
    fits = budget.seeds_for_budget(600, 0.5)  # 3,600 s a seed: exactly 8 fit (the boundary is within)
    assert (fits.n, fits.overrun_cpu_hours) == (8, 0.0) and math.isclose(fits.projected_cpu_hours, 8.0)
    assert budget.seeds_for_budget(600, 0.5 * 1.001).n == 7
    over = budget.seeds_for_budget(2400, 0.5)  # 14,400 s a seed: 2 fit, below 6: n = 6 and the overrun
    assert over.n == 6 and math.isclose(over.projected_cpu_hours, 24.0) and math.isclose(over.overrun_cpu_hours, 16.0)


def run_factors(model: str, arm: str, task: str, seed: int, regime: str) -> dict:
    return {"model": model, "arm": arm, "task": task, "seed": seed, "regime": regime}


def write_run(root: Path, factors: dict, steps: list[int], values: list[float], final: float,
              seconds: float = 1.0) -> None:
    """One finished run in the format ``grid.run_grid`` leaves (eval.csv, factors.json, result.json)."""
    run = root / "runs" / f"{factors['model']}__{factors['task']}__{factors['arm']}__s{factors['seed']}"
    run.mkdir(parents=True)
    metric = METRIC[factors["task"]]
    lines = ["step,split,metric,value"] + [f"{s},validation,{metric},{v!r}" for s, v in zip(steps, values)]
    (run / "eval.csv").write_text("\n".join(lines) + "\n")
    (run / "factors.json").write_text(json.dumps(factors))
    result = {"final": {"validation": {metric: final}, "test": {metric: final, "recall": 0.5}}, "seconds": seconds,
              "steps": steps[-1]}
    (run / "result.json").write_text(json.dumps(result))


def test_decision_from_the_pilots_files(tmp_path: Path) -> None:
    pilot = tmp_path / "pilot"
    for i, model in enumerate(FOUR):
        values = np.where(STEPS >= 300 + 120 * i, 0.9, 0.6)
        write_run(pilot, run_factors(model, "full", "brown-pos", 0, "lr1e-5"), STEPS.tolist(),
                  values.tolist(), 0.9, seconds=2400 * (0.2 + 0.1 * i))
    decision = budget.decide(pilot)
    assert decision == json.loads((pilot / "decision.json").read_text())
    assert decision["S"] == 660 and decision["did_not_converge"] == []
    assert math.isclose(decision["seconds_per_step_mean"], 0.35)
    assert decision["n"] == budget.seeds_for_budget(660, 0.35).n == 10  # 12 x 10 x 660 x 0.35 s = 7.7 h
    assert "S = 660 steps; n = 10 seeds" in budget.describe(decision)
    (pilot / "decision.json").unlink()
    assert finetune.main(["--part", "decision", "--out", str(pilot)]) == 0
    assert json.loads((pilot / "decision.json").read_text()) == decision
    (pilot / "runs" / f"{design.DIFFUSION}__brown-pos__full__s0" / "result.json").unlink()
    with pytest.raises(SystemExit, match=design.DIFFUSION):
        budget.decide(pilot)


# ------------------------------------------------------------------ the report, recomputed by hand
LR_STEPS = list(range(15, 121, 15))
S, N = 180, 6
LOW_STEPS = list(range(60, S + 1, 60))
EFFECTS = {(design.MASK40, "brown-pos", "drop1"): 0.02, (design.DIFFUSION, "brown-propn", "repair1"): -0.03,
           (design.MINI, "brown-pos", "drop1"): 0.01}


def curve(rng: np.random.Generator, steps: list[int], level: float) -> list[float]:
    return (level - 0.2 * np.exp(-np.array(steps) / 40.0) + 0.01 * rng.standard_normal(len(steps))).tolist()


@pytest.fixture(scope="module")
def experiment(tmp_path_factory) -> dict:
    """Synthetic per-run files of every cell the report reads, and the curves they hold (by cell and seed)."""
    root = tmp_path_factory.mktemp("objectives")
    out, convergence = root / "finetune", root / "convergence"
    rng = np.random.default_rng(52)
    lr, low = {}, {}
    committed = {design.MINI: ("full", "drop1", "reinit1", "repair1"), design.TWIN: ("full", "drop1")}
    for seed in range(10):
        for task in TASKS:
            base = 0.85 + 0.02 * rng.standard_normal()
            for model, arms in [*committed.items(), *((m, ("full", "drop1", "reinit1", "repair1")) for m in NEW)]:
                for arm in arms:
                    values = curve(rng, LR_STEPS, base + EFFECTS.get((model, task, arm), 0.0))
                    lr[(model, task, arm, seed)] = values
                    folder = convergence if model in committed else out / "lr1e-4"
                    write_run(folder, run_factors(model, arm, task, seed, "convergence"),
                              LR_STEPS, values, values[-1])
    for seed in range(N):
        base = 0.9 + 0.02 * rng.standard_normal()
        for model in FOUR:
            for arm in ("full", "drop1", "reinit1"):
                values = curve(rng, LOW_STEPS, base + EFFECTS.get((model, "brown-pos", arm), 0.0))
                low[(model, "brown-pos", arm, seed)] = values
                write_run(out / "seed-regime", run_factors(model, arm, "brown-pos", seed, "lr1e-5"), LOW_STEPS,
                          values, values[-1])
    (out / "pilot").mkdir(parents=True)
    (out / "pilot" / "decision.json").write_text(json.dumps({"S": S, "n": N}))
    notes = report.write_report(out, convergence, curves=FIRST_MEMBER / "pretraining_curves.csv")
    return {"out": out, "convergence": convergence, "lr": lr, "low": low, "notes": notes,
            "summaries": report.lr1e4_summaries(out, convergence)}


def auc(steps: list[int], values: list[float]) -> float:
    """Trapezoids by hand, divided by the step range: the curve's mean score."""
    area = sum((values[i] + values[i + 1]) / 2 * (steps[i + 1] - steps[i]) for i in range(len(steps) - 1))
    return area / (steps[-1] - steps[0])


def by_hand(diffs: np.ndarray) -> tuple[float, float, float]:
    """(mean, two-sided p, SD) of a paired t-test, from the formula."""
    n, mean, sd = len(diffs), float(np.mean(diffs)), float(np.std(diffs, ddof=1))
    t = mean / (sd / math.sqrt(n))
    return mean, 2 * stats.t.sf(abs(t), n - 1), sd


def holm_by_hand(p: np.ndarray) -> np.ndarray:
    order, m = np.argsort(p), len(p)
    adjusted = np.empty(m)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return adjusted


def mde_by_hand(sd: float, n: int, alpha: float) -> float:
    crit, df = stats.t.ppf(1 - alpha / 2, n - 1), n - 1

    def power(effect: float) -> float:
        delta = effect * math.sqrt(n) / sd
        lower = stats.nct.cdf(-crit, df, delta)  # about 0; scipy gives NaN that far in the tail
        return stats.nct.sf(crit, df, delta) + (0.0 if math.isnan(lower) else lower)

    upper = 2 * (stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(0.8) + 1) * sd / math.sqrt(n)
    return optimize.brentq(lambda e: power(e) - 0.8, 1e-6 * sd, upper, xtol=1e-15, rtol=1e-15)


def check_family(table, expected: dict, m: int) -> None:
    p = np.array([by_hand(expected[(r.model, r.task, r.arm)])[1] for r in table.itertuples()])
    assert np.allclose(table.p_holm.to_numpy(), holm_by_hand(p), rtol=1e-9, atol=0)
    for r, p_holm in zip(table.itertuples(), holm_by_hand(p)):
        mean, p_value, sd = by_hand(expected[(r.model, r.task, r.arm)])
        assert r.n_pairs == len(expected[(r.model, r.task, r.arm)])
        assert math.isclose(r.mean, mean, rel_tol=1e-9) and math.isclose(r.p, p_value, rel_tol=1e-9)
        if p_holm < 0.05:
            assert math.isnan(r.mde_alpha05) and math.isnan(r.mde_bonferroni)
        else:
            assert math.isclose(r.mde_alpha05, mde_by_hand(sd, r.n_pairs, 0.05), rel_tol=1e-9)
            assert math.isclose(r.mde_bonferroni, mde_by_hand(sd, r.n_pairs, 0.05 / m), rel_tol=1e-9)


def arm_minus_full(curves: dict, steps: list[int], model: str, task: str, arm: str, seeds: range) -> np.ndarray:
    return np.array([auc(steps, curves[(model, task, arm, s)]) - auc(steps, curves[(model, task, "full", s)])
                     for s in seeds])


def same_table(path: Path, table) -> None:
    """The written csv is ``table`` (its numbers at the 6 significant digits it is written with)."""
    import pandas as pd

    written = pd.read_csv(path)
    assert list(written.columns) == list(table.columns) and len(written) == len(table)
    for column in table.columns:
        if table[column].dtype.kind == "f":
            assert np.allclose(written[column], table[column], rtol=1e-5, atol=0, equal_nan=True), column
        else:
            assert written[column].fillna("").astype(str).tolist() == \
                table[column].fillna("").astype(str).tolist(), column


def test_family_a_is_twelve_paired_tests_with_holm_and_mdes(experiment) -> None:
    table = contrasts.family_a(experiment["summaries"])
    assert len(table) == 12 and set(table.n_pairs) == {10}
    expected = {(m, t, a): arm_minus_full(experiment["lr"], LR_STEPS, m, t, a, range(10))
                for m in NEW for t in TASKS for a in ("drop1", "reinit1", "repair1")}
    check_family(table, expected, 12)
    same_table(experiment["out"] / "family_a.csv", table)
    planted = table[(table.model == design.MASK40) & (table.task == "brown-pos") & (table.arm == "drop1")]
    assert planted.significant.all() and (planted["mean"] > 0.015).all()
    text = (experiment["out"] / "family_a.md").read_text()
    assert "p (Holm, m = 12)" in text
    # issue 59: the .md labels of a model that did not learn (by the curves given: the first diffusion member's) are
    # marked, with a footnote
    assert "| mini-en-diffusion† drop1 - full | brown-pos |" in text and "mini-en-mask40†" not in text
    first = stage.stages(FIRST_MEMBER / "pretraining_curves.csv")[design.DIFFUSION]
    assert stage.footnote(first) in text.splitlines() and "**" not in text


def test_secondary_model_contrasts_pair_each_model_with_mini_en(experiment) -> None:
    table = contrasts.secondary(experiment["summaries"])
    same_table(experiment["out"] / "secondary.csv", table)
    assert len(table) == 6 and table.computed.all()
    for r in table.itertuples():
        d = (arm_minus_full(experiment["lr"], LR_STEPS, r.model, r.task, "drop1", range(10))
             - arm_minus_full(experiment["lr"], LR_STEPS, design.MINI, r.task, "drop1", range(10)))
        mean, p, sd = by_hand(d)
        assert math.isclose(r.mean, mean, rel_tol=1e-9) and math.isclose(r.p, p, rel_tol=1e-9)
        assert math.isclose(r.sd, sd, rel_tol=1e-9)
    assert {r.model for r in table.itertuples()} == {design.MASK40, design.DIFFUSION, design.TWIN}


def test_family_b_is_eight_paired_tests_over_60_to_s_with_lr1e4_beside(experiment) -> None:
    import pandas as pd

    summaries, stray = report.seed_regime_summaries(experiment["out"], S)
    table = contrasts.family_b(summaries, tuple(range(N)))
    assert len(table) == 8 and set(table.n_pairs) == {N} and stray == []
    expected = {(m, "brown-pos", a): arm_minus_full(experiment["low"], LOW_STEPS, m, "brown-pos", a, range(N))
                for m in FOUR for a in ("drop1", "reinit1")}
    check_family(table, expected, 8)
    written = pd.read_csv(experiment["out"] / "family_b.csv")
    assert set(written.steps) == {S}
    same_table(experiment["out"] / "family_b.csv", table.assign(at_lr1e4=written.at_lr1e4, steps=S))
    beside = written.set_index(["model", "arm"])["at_lr1e4"]
    assert beside[(design.TWIN, "reinit1")] == "not run at lr 1e-4"
    d = arm_minus_full(experiment["lr"], LR_STEPS, design.MASK40, "brown-pos", "drop1", range(10))
    assert beside[(design.MASK40, "drop1")].startswith(f"{np.mean(d):+.4f} [")
    text = (experiment["out"] / "family_b.md").read_text()
    assert "The seed's claim" in text and experiment["notes"] == []


def test_curve_figures_hold_each_arms_mean_and_t_interval_over_seeds(experiment) -> None:
    import pandas as pd

    out = experiment["out"]
    low = pd.read_csv(out / "curves_seed-regime.csv")
    assert set(low.model) == set(FOUR) and set(low.arm) == {"full", "drop1", "reinit1"} and set(low.n) == {N}
    assert sorted(set(low.step)) == LOW_STEPS
    for (model, task, arm), i in [((design.MASK40, "brown-pos", "drop1"), 1), ((design.DIFFUSION, "brown-pos",
                                                                                  "full"), 2)]:
        values = np.array([experiment["low"][(model, task, arm, seed)][i] for seed in range(N)])
        half = stats.t.ppf(0.975, N - 1) * values.std(ddof=1) / math.sqrt(N)
        row = low[(low.model == model) & (low.arm == arm) & (low.step == LOW_STEPS[i])].iloc[0]
        assert np.allclose([row["mean"], row.ci_low, row.ci_high],
                           [values.mean(), values.mean() - half, values.mean() + half], rtol=1e-5)
    lr = pd.read_csv(out / "curves_lr1e-4.csv")
    assert set(lr.model) == set(NEW) and set(lr.n) == {10}
    values = [experiment["lr"][(design.DIFFUSION, "brown-propn", "repair1", seed)][0] for seed in range(10)]
    row = lr[(lr.model == design.DIFFUSION) & (lr.task == "brown-propn") & (lr.arm == "repair1") & (lr.step == 15)]
    assert math.isclose(row["mean"].iloc[0], float(np.mean(values)), rel_tol=1e-5)
    for name in ("curves_seed-regime", "curves_lr1e-4"):
        assert (out / f"{name}.pdf").stat().st_size > 1000 and (out / f"{name}.png").stat().st_size > 1000


def test_incomplete_cells_are_refused_in_one_sentence(experiment, tmp_path: Path) -> None:
    import pandas as pd

    summaries = experiment["summaries"]
    gone = summaries.drop(summaries[(summaries.model == design.DIFFUSION) & (summaries.arm == "reinit1")
                                    & (summaries.task == "brown-pos") & (summaries.seed == 7)].index)
    with pytest.raises(ValueError) as err:
        contrasts.family_a(gone)
    sentence = str(err.value)
    assert sentence == ("Family A is not computed yet: Holm ranks all 12 of its contrasts together and 1 of its cells "
                        "lack seeds (mini-en-diffusion brown-pos reinit1: 9 of 10 seeds (missing 7)).")
    mini_gone = summaries.drop(summaries[(summaries.model == design.MINI) & (summaries.arm == "drop1")
                                         & (summaries.task == "brown-propn") & (summaries.seed == 0)].index)
    table = contrasts.secondary(mini_gone)
    assert (~table.computed).sum() == 3 and table[table.task == "brown-pos"].computed.all()
    # a folder with one run missing: the family's .md is that sentence and no .csv is left
    out = tmp_path / "finetune"
    out.mkdir()
    for part in ("lr1e-4", "seed-regime", "pilot"):
        (out / part).symlink_to(experiment["out"] / part)
    partial = tmp_path / "partial"
    (partial / "runs").mkdir(parents=True)
    for run in (experiment["convergence"] / "runs").iterdir():
        if run.name != f"{design.MINI}__brown-pos__drop1__s3":
            (partial / "runs" / run.name).symlink_to(run)
    (out / "family_b.csv").write_text("stale\n")
    notes = report.write_report(out, partial)
    assert (out / "family_a.csv").is_file()  # the new models' family does not need mini-en's runs
    assert any("mini-en brown-pos drop1: 9 of 10 seeds (missing 3)" in n for n in notes)
    family_b = pd.read_csv(out / "family_b.csv").set_index(["model", "arm"])["at_lr1e4"]
    assert family_b[(design.MINI, "drop1")].startswith("not computed: mini-en brown-pos drop1: 9 of 10 seeds")
    (out / "pilot").unlink()
    (out / "pilot").mkdir()
    assert report.write_seed_regime(out, summaries)[0].startswith("Family B is not computed yet")
    assert not (out / "family_b.csv").exists()
    assert (out / "family_b.md").read_text().startswith("Family B is not computed yet")


def test_seed_regime_runs_off_the_s_schedule_are_left_out(tmp_path: Path) -> None:
    regime = tmp_path / "seed-regime"
    write_run(regime, run_factors(design.MINI, "full", "brown-pos", 0, "lr1e-5"), [60, 120, 180], [0.8] * 3, 0.8)
    write_run(regime, run_factors(design.MINI, "full", "brown-pos", 1, "lr1e-5"), [60, 120, 180, 240], [0.8] * 4, 0.8)
    assert report.off_schedule(regime, 180) == [f"{design.MINI}__brown-pos__full__s1"]
    summaries, stray = report.seed_regime_summaries(tmp_path, 180)
    assert summaries.seed.tolist() == [0] and stray == [f"{design.MINI}__brown-pos__full__s1"]


def family_a_by_hand(folder_of) -> dict:
    """Family A's paired AUC differences from the per-run eval.csv files alone (trapezoids by hand): the runs of
    model M under ``folder_of(M) / "lr1e-4" / "runs"``."""
    metric = {"brown-pos": "accuracy", "brown-propn": "entity_f1"}

    def run_auc(model: str, task: str, arm: str, seed: int) -> float:
        run = folder_of(model) / "lr1e-4" / "runs" / f"{model}__{task}__{arm}__s{seed}"
        curve = pd.read_csv(run / "eval.csv")
        val = curve[(curve.split == "validation") & (curve.metric == metric[task])].sort_values("step")
        assert val.step.tolist() == LR_STEPS
        return auc(LR_STEPS, val.value.tolist())

    return {(m, t, a): np.array([run_auc(m, t, a, s) - run_auc(m, t, "full", s) for s in range(10)])
            for m in NEW for t in TASKS for a in ("drop1", "reinit1", "repair1")}


@pytest.mark.slow
def test_the_committed_part_3_tables_are_recomputed_from_the_committed_runs() -> None:
    """figures/objectives/finetune's Family A, secondary contrasts and cells are what the committed runs give
    (mini-en's and the twin's from the powered experiment, the new models' 160 from Part 3)."""
    import pandas as pd
    from analyses.last_block_finetuning.powered_report import cells

    committed = design.OUT
    if not (committed / "family_a.csv").is_file():
        pytest.skip("Part 3's report is not committed")
    summaries = report.lr1e4_summaries(committed)
    assert len(summaries) == 160 + 80 + 40  # new models: 160; mini-en: 80 (4 arms); the twin: 40 (full, drop1)
    table = contrasts.family_a(summaries)
    same_table(committed / "family_a.csv", table)
    same_table(committed / "secondary.csv", contrasts.secondary(summaries))
    same_table(committed / "cells_lr1e-4.csv", cells(summaries))
    # Family A again from the per-run eval.csv files alone: trapezoid AUCs, paired t-tests, Holm, MDEs by hand
    check_family(table, family_a_by_hand(lambda model: committed), 12)


@pytest.mark.slow
def test_the_committed_part_4_tables_are_recomputed_from_the_committed_runs() -> None:
    """figures/objectives/finetune's seed-regime cells and curves are what the committed Part 4 runs give, and
    Family B (once every cell has its n seeds) is recomputed from the per-run eval.csv files by hand."""
    import pandas as pd
    from analyses.last_block_finetuning.powered_figures import curve_table
    from analyses.last_block_finetuning.powered_report import cells

    committed = design.OUT
    decision = report.read_decision(committed)
    if decision is None or not (committed / "cells_seed-regime.csv").is_file():
        pytest.skip("Part 4's report is not committed")
    steps, n = int(decision["S"]), int(decision["n"])
    summaries, stray = report.seed_regime_summaries(committed, steps)
    assert stray == [] and len(summaries) == len(list((committed / "seed-regime" / "runs").glob("*/result.json")))
    same_table(committed / "cells_seed-regime.csv", cells(summaries))
    curves = curve_table(committed / "seed-regime")
    same_table(committed / "curves_seed-regime.csv", curves)
    same_table(committed / "curves_lr1e-4.csv", curve_table(committed / "lr1e-4"))
    if not (committed / "family_b.csv").is_file():
        assert "Family B is not computed yet" in (committed / "family_b.md").read_text()
        return
    runs, low_steps = committed / "seed-regime" / "runs", list(range(60, steps + 1, 60))

    def committed_auc(model: str, arm: str, seed: int) -> float:
        curve = pd.read_csv(runs / f"{model}__brown-pos__{arm}__s{seed}" / "eval.csv")
        val = curve[(curve.split == "validation") & (curve.metric == "accuracy")].sort_values("step")
        assert val.step.tolist() == low_steps
        return auc(low_steps, val.value.tolist())

    table = contrasts.family_b(summaries, tuple(range(n)))
    expected = {(m, "brown-pos", a): np.array([committed_auc(m, a, s) - committed_auc(m, "full", s)
                                               for s in range(n)])
                for m in FOUR for a in ("drop1", "reinit1")}
    check_family(table, expected, contrasts.FAMILY_B)
    written = pd.read_csv(committed / "family_b.csv")
    same_table(committed / "family_b.csv", table.assign(at_lr1e4=written.at_lr1e4, steps=steps))


def test_a_staged_member_borrows_the_other_new_model_s_runs(experiment, tmp_path: Path) -> None:
    """A folder holding one member's lr 1e-4 runs only (the second diffusion member's while it was staged, the first's
    now, as history); ``also`` adds mask40's from the study, and never a run of a model the folder has (the diffusion
    runs come from that folder alone)."""
    staged = tmp_path / "staged"
    for run in (experiment["out"] / "lr1e-4" / "runs").iterdir():
        if run.name.startswith(design.DIFFUSION + "__"):
            shutil.copytree(run, staged / "lr1e-4" / "runs" / run.name)
    borrowed = report.lr1e4_summaries(staged, experiment["convergence"], also=experiment["out"] / "lr1e-4")
    keys = ["model", "task", "arm", "seed"]
    expected = experiment["summaries"].sort_values(keys).reset_index(drop=True)
    pd.testing.assert_frame_equal(borrowed.sort_values(keys).reset_index(drop=True), expected, check_like=True)
    assert not borrowed.duplicated(keys).any()  # the staged model's runs are never doubled by the borrowed folder's
    alone = report.lr1e4_summaries(staged, experiment["convergence"])
    assert set(alone.model) == {design.MINI, design.TWIN, design.DIFFUSION}  # without ``also``: no mask40


def test_the_first_diffusion_member_s_part_3_tables_are_kept_as_history() -> None:
    """figures/objectives/diffusion-v1/finetune: Family A, the secondary contrasts and the cells with the first
    diffusion member's 80 runs (moved there when the second member's replaced them) and mask40's 80 from the study
    (mini-en's and the twin's reused), by hand too; marked by the first member's curves, which say it did not learn."""
    from analyses.last_block_finetuning.powered_report import cells

    history = FIRST_MEMBER / "finetune"
    summaries = report.lr1e4_summaries(history, also=design.OUT / "lr1e-4")
    assert len(summaries) == 160 + 80 + 40 and (summaries.model == design.DIFFUSION).sum() == 80
    assert set(summaries[summaries.model == design.DIFFUSION].run_id) == {
        run.name for run in (history / "lr1e-4" / "runs").iterdir()}
    table = contrasts.family_a(summaries)
    same_table(history / "family_a.csv", table)
    same_table(history / "secondary.csv", contrasts.secondary(summaries))
    same_table(history / "cells_lr1e-4.csv", cells(summaries))
    check_family(table, family_a_by_hand(lambda model: history if model == design.DIFFUSION else design.OUT), 12)
    first = stage.stages(FIRST_MEMBER / "pretraining_curves.csv")[design.DIFFUSION]
    assert not first.learned and stage.footnote(first) in (history / "family_a.md").read_text().splitlines()
    assert "†" not in (design.OUT / "family_a.md").read_text()  # the second member learned: nothing is marked
