"""The fine-tuning experiments' shared statistics and bookkeeping (analyses/last_block_finetuning/grid.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from analyses.last_block_finetuning.grid import GridRun, collect, mean_ci, paired_differences, run_grid, summarise


def test_mean_ci_is_the_student_t_interval():
    values = np.array([0.90, 0.92, 0.97])
    mean, lo, hi, n = mean_ci(values)
    # t_{0.975, 2} = 4.302653, sd = 0.036055513, sqrt(3) = 1.7320508
    half = 4.302653 * 0.036055513 / 1.7320508
    assert n == 3
    assert mean == pytest.approx(0.93, abs=1e-12)
    assert lo == pytest.approx(0.93 - half, abs=1e-6)
    assert hi == pytest.approx(0.93 + half, abs=1e-6)


def test_mean_ci_single_value_and_nan():
    assert mean_ci(np.array([0.5]))[1:] == (pytest.approx(math.nan, nan_ok=True),) * 2 + (1,)
    mean, lo, hi, n = mean_ci(np.array([np.nan, 1.0, 3.0]))
    assert (mean, n) == (2.0, 2)


def test_paired_differences_pair_by_seed():
    frame = pd.DataFrame({
        "task": ["t"] * 6,
        "variant": ["full", "full", "full", "drop1", "drop1", "drop1"],
        "seed": [0, 1, 2, 2, 0, 1],  # shuffled: pairing must follow the seed, not the row order
        "value": [0.90, 0.80, 0.70, 0.72, 0.91, 0.83],
    })
    out = paired_differences(frame, ["task"], "variant", "full")
    assert len(out) == 1
    row = out.iloc[0]
    diffs = np.array([0.01, 0.03, 0.02])
    assert row.mean_difference == pytest.approx(diffs.mean(), abs=1e-12)
    assert row.n_pairs == 3
    assert row.ci_low == pytest.approx(mean_ci(diffs)[1], abs=1e-12)
    assert row.variant == "drop1" and row.baseline == "full"


def test_summarise_groups():
    frame = pd.DataFrame({"a": ["x", "x", "y"], "value": [1.0, 3.0, 5.0]})
    out = summarise(frame, ["a"]).set_index("a")
    assert out.loc["x", "mean"] == 2.0 and out.loc["x", "n"] == 2
    assert out.loc["y", "n"] == 1 and math.isnan(out.loc["y", "ci_low"])


def _finished(out: Path, run: GridRun, config: dict, accuracy: float) -> None:
    run_dir = out / "runs" / run.run_id
    run_dir.mkdir(parents=True)
    (run_dir / "result.json").write_text(json.dumps({"config": config, "seconds": 1.5,
                                                      "final": {"test": {"accuracy": accuracy}}}))
    (run_dir / "factors.json").write_text(json.dumps(run.factors))
    pd.DataFrame({"step": [10], "split": ["validation"], "metric": ["accuracy"], "value": [accuracy]}).to_csv(
        run_dir / "eval.csv", index=False)


def test_finished_runs_are_collected_and_skipped(tmp_path):
    run = GridRun("r0", {"model": "m", "seed": 0}, {"lr": 1e-3, "steps": 10})
    _finished(tmp_path, run, {"lr": 1e-3, "steps": 10, "device": "cpu"}, 0.75)
    assert run_grid([run], tmp_path) == []  # nothing to do: no worker is started
    curves, finals = collect(tmp_path)
    assert finals.value.tolist() == [0.75] and finals.seed.tolist() == [0]
    assert curves.run_id.tolist() == ["r0"]


def test_a_finished_run_with_another_config_is_refused(tmp_path):
    run = GridRun("r0", {"model": "m", "seed": 0}, {"lr": 1e-3, "steps": 150})
    _finished(tmp_path, run, {"lr": 1e-3, "steps": 250}, 0.75)
    with pytest.raises(SystemExit, match="another config"):
        run_grid([run], tmp_path)


def test_model_contrast_is_a_difference_of_paired_differences():
    from analyses.last_block_finetuning.drop_or_reinit import model_contrast

    rows = []
    scores = {  # (model, variant) -> score per seed 0, 1, 2
        ("gradflow-mini-en", "full"): [0.60, 0.70, 0.65], ("gradflow-mini-en", "drop1"): [0.62, 0.71, 0.69],
        ("gradflow-mini-en-alltoken", "full"): [0.50, 0.55, 0.52],
        ("gradflow-mini-en-alltoken", "drop1"): [0.49, 0.56, 0.50],
    }
    for (model, variant), values in scores.items():
        for seed, value in enumerate(values):
            rows.append({"model": model, "task": "t", "variant": variant, "seed": seed, "value": value})
    out = model_contrast(pd.DataFrame(rows))
    expected = np.array([0.02 - (-0.01), 0.01 - 0.01, 0.04 - (-0.02)])
    mean, lo, hi, n = mean_ci(expected)
    row = out.iloc[0]
    assert (row.task, row.variant, row.n_pairs) == ("t", "drop1", 3)
    assert row.difference_of_differences == pytest.approx(mean, abs=1e-12)
    assert (row.ci_low, row.ci_high) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))
