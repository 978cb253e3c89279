"""The powered experiment's report (analyses/last_block_finetuning/powered_report.py) on planted effects: AUC, contrasts, Holm, MDE."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from analyses.last_block_finetuning.powered_report import cells, contrasts, run_summaries

STEPS = (30, 60, 90)


def _write_run(root: Path, model: str, arm: str, task: str, seed: int, level: float) -> None:
    run = root / "runs" / f"{model}__{task}__{arm}__s{seed}"
    run.mkdir(parents=True)
    metric = "accuracy" if task == "brown-pos" else "entity_f1"
    rows = [{"step": s, "split": "validation", "metric": metric, "value": level} for s in STEPS]
    pd.DataFrame(rows).to_csv(run / "eval.csv", index=False)
    (run / "factors.json").write_text(json.dumps({"model": model, "arm": arm, "task": task, "seed": seed,
                                                  "regime": "convergence"}))
    (run / "result.json").write_text(json.dumps({"final": {"validation": {metric: level}, "test": {metric: level}},
                                                 "seconds": 1.0}))


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convergence")
    rng = np.random.default_rng(0)
    for seed in range(10):
        for task in ("brown-pos", "brown-propn"):
            base = 0.8 + 0.01 * rng.standard_normal()
            levels = {"full": base, "repair1": base + 0.05 + 0.002 * rng.standard_normal(),  # a planted effect
                      "drop1": base + 0.01 * rng.standard_normal(), "reinit1": base + 0.01 * rng.standard_normal()}
            for arm, level in levels.items():
                _write_run(root, "gradflow-mini-en", arm, task, seed, level)
            for arm in ("full", "drop1"):
                _write_run(root, "gradflow-mini-en-alltoken", arm, task, seed, base)
    return run_summaries(root)


def test_auc_of_a_flat_curve_is_its_level(planted):
    assert np.allclose(planted["auc"], planted["test"])
    assert (planted.loc[planted.arm == "full", "steps_to_90"] == STEPS[0]).all()


def test_planted_effect_is_found_and_nulls_get_an_mde(planted):
    table = contrasts(planted, pd.DataFrame())
    assert len(table) == 14
    repair = table[(table.contrast == "mini-en repair1 - full") & (table.regime == "convergence")]
    assert (repair["mean"].sub(0.05).abs() < 0.003).all() and repair["significant"].all()
    assert repair["mde_alpha05"].isna().all()
    nulls = table[(table.contrast == "mini-en drop1 - full") & (table.regime == "convergence")]
    assert (~nulls["significant"]).all() and (nulls["mde_bonferroni"] > nulls["mde_alpha05"]).all()
    assert (nulls["mde_alpha05"] > 0).all()
    few = table[table.regime == "few-sample-250"]
    assert few["n_pairs"].eq(0).all() and few["p_holm"].isna().all()  # no runs: nothing tested, Holm m counts only tests
    twin = table[table.contrast.str.startswith("(mini-en drop1")]
    assert (twin.n_pairs == 10).all() and not math.isnan(twin["mean"].iloc[0])


def test_cells_count_runs_collapsed_to_O(tmp_path):
    for seed, recall in enumerate((0.0, 0.5, 0.004)):
        _write_run(tmp_path, "gradflow-mini-en", "full", "brown-propn", seed, 0.3)
        result = tmp_path / "runs" / f"gradflow-mini-en__brown-propn__full__s{seed}" / "result.json"
        record = json.loads(result.read_text())
        record["final"]["test"]["recall"] = recall
        result.write_text(json.dumps(record))
    table = cells(run_summaries(tmp_path))
    row = table.iloc[0]
    assert (row.n, row.collapsed_to_O) == (3, 2)  # recall < 0.01: no proper noun found
    assert math.isclose(row.auc, 0.3) and math.isclose(row.seconds_total, 3.0)
