"""The powered fine-tuning experiment's run plan (analyses/last_block_finetuning/powered_experiment.py) per pair."""

from __future__ import annotations

import argparse
from collections import Counter

from analyses.last_block_finetuning import powered_experiment as pe


def plan(pair: str, regime: str = "convergence", seeds: tuple[int, ...] = tuple(range(10)), **flags):
    args = argparse.Namespace(regime=regime, seeds=list(seeds), exploratory=flags.get("exploratory", False),
                              secondary=flags.get("secondary", False), train_sentences=250, autocast=None,
                              data_root="data/tasks", device="cpu", pair=pair, models=flags.get("models", "both"))
    return pe.plan(args)


def test_twelve_block_convergence_plan_is_the_pre_registered_120_runs() -> None:
    runs = plan("mini12-en")
    cells = Counter((r.factors["model"], r.factors["arm"]) for r in runs)
    assert cells == {("gradflow-mini12-en", arm): 20 for arm in ("full", "drop1", "reinit1", "repair1")} | {
        ("gradflow-mini12-en-alltoken", arm): 20 for arm in ("full", "drop1")}
    assert len({r.run_id for r in runs}) == len(runs) == 120
    repaired = {r.config["model"] for r in runs if r.factors["arm"] == "repair1"}
    assert repaired == {str(pe.ROOT / "build/mini12-repaired/model")}
    assert all(r.config["model"] == r.factors["model"] for r in runs if r.factors["arm"] != "repair1")
    assert {r.config["lr"] for r in runs} == {1e-4} and {r.config["steps"] for r in runs} == {120}


def test_six_block_plan_keeps_its_cells() -> None:
    """12 runs a seed in regime (a) (mini-en 4 arms, twin 2, 2 tasks; 14 with the twin's secondary reinit1), 8 in
    regime (b); the exploratory arm runs alone."""
    assert len(plan("mini-en", seeds=(0,))) == 12
    assert len(plan("mini-en", seeds=(0,), secondary=True)) == 14
    assert len(plan("mini-en", "few-sample", seeds=(0,))) == 8
    exploratory = plan("mini-en", seeds=(0,), exploratory=True)
    assert {(r.factors["model"], r.factors["arm"]) for r in exploratory} == {("gradflow-mini-en", "repair1-mlm")}


def test_models_filter_splits_the_plan_into_the_mlm_models_and_the_twins_runs() -> None:
    """Deviation 4 of the 12-block plan: the MLM model's 80 runs, then the twin's 40, are the same 120 runs."""
    whole, mlm, twin = plan("mini12-en"), plan("mini12-en", models="mlm"), plan("mini12-en", models="twin")
    assert len(mlm) == 80 and len(twin) == 40
    assert {r.factors["model"] for r in mlm} == {"gradflow-mini12-en"}
    assert {r.factors["model"] for r in twin} == {"gradflow-mini12-en-alltoken"}
    assert sorted(r.run_id for r in mlm + twin) == sorted(r.run_id for r in whole)
    assert {r.run_id: r.config for r in mlm + twin} == {r.run_id: r.config for r in whole}


def test_only_runs_that_fine_tune_a_repaired_model_make_one() -> None:
    """The twin's cells need no repair (a fresh machine must not spend ~5 CPU-minutes on one); the MLM model's
    repair1 cells need the all-positions repair, the exploratory cells the MLM-objective one, where missing."""
    pair = pe.PAIRS["mini12-en"]
    assert pe.repairs_needed(pair, plan("mini12-en", models="twin")) == []
    needed = [] if (pe.ROOT / pair.repaired).is_dir() else [(pair.repaired, "all-positions")]
    assert pe.repairs_needed(pair, plan("mini12-en", models="mlm")) == needed
    needed_mlm = [] if (pe.ROOT / pair.repaired_mlm).is_dir() else [(pair.repaired_mlm, "mlm")]
    assert pe.repairs_needed(pair, plan("mini12-en", models="mlm", exploratory=True)) == needed_mlm
