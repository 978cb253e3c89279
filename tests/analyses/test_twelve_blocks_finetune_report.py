"""The twelve-block fine-tuning report (analyses/twelve_blocks/finetune_report.py): the plan's 8 contrasts, Holm
over 8, and the plan's verdict rule, on synthetic per-run AUCs with known effects."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from analyses.twelve_blocks import finetune_report as report
from scipy import stats

TASKS = ("brown-pos", "brown-propn")


def summaries(effects: dict[tuple[str, str, str], float], seeds: int = 10) -> pd.DataFrame:
    """AUC per (model, task, arm, seed): a seed effect shared by every arm, plus the arm's effect and small noise."""
    rng = np.random.default_rng(0)
    rows = []
    for model, arms in ((report.MLM, ("full", "drop1", "reinit1", "repair1")), (report.TWIN, ("full", "drop1"))):
        for task in TASKS:
            base = 0.8 + 0.01 * rng.standard_normal(seeds)
            for arm in arms:
                auc = base + effects.get((model, task, arm), 0.0) + 0.001 * rng.standard_normal(seeds)
                rows += [{"model": model, "task": task, "arm": arm, "seed": s, "auc": a} for s, a in enumerate(auc)]
    return pd.DataFrame(rows)


def test_contrasts_are_paired_t_tests_with_holm_over_eight() -> None:
    frame = summaries({(report.MLM, "brown-pos", "drop1"): 0.01})
    table = report.contrasts(frame)
    assert len(table) == report.FAMILY == 8 and set(table.n_pairs) == {10}
    wide = frame.pivot_table(index="seed", columns=["model", "task", "arm"], values="auc")
    drop = wide[(report.MLM, "brown-pos", "drop1")] - wide[(report.MLM, "brown-pos", "full")]
    row = table[(table.contrast == "mini12-en drop1 - full") & (table.task == "brown-pos")].iloc[0]
    assert row["mean"] == pytest.approx(drop.mean(), abs=1e-12)
    assert row["p"] == pytest.approx(stats.ttest_rel(wide[(report.MLM, "brown-pos", "drop1")],
                                                     wide[(report.MLM, "brown-pos", "full")]).pvalue, rel=1e-9)
    twin = wide[(report.TWIN, "brown-pos", "drop1")] - wide[(report.TWIN, "brown-pos", "full")]
    model = table[(table.contrast == report.MODEL_CONTRAST) & (table.task == "brown-pos")].iloc[0]
    assert model["mean"] == pytest.approx((drop - twin).mean(), abs=1e-12)
    order = np.argsort(table.p.to_numpy())  # Holm by hand: the k-th smallest p times (8 - k), running maximum
    adjusted = np.maximum.accumulate(np.minimum(1, table.p.to_numpy()[order] * (8 - np.arange(8))))
    assert np.allclose(table.p_holm.to_numpy()[order], adjusted)
    assert row["significant"] and np.isnan(row["mde_alpha05"])
    nulls = table[~table.significant]
    assert len(nulls) and (nulls.mde_bonferroni > nulls.mde_alpha05).all()


def test_verdict_follows_the_plans_rule() -> None:
    gain = {(report.MLM, "brown-pos", "drop1"): 0.01}
    holds, text = report.verdict(report.contrasts(summaries(gain)))
    assert holds and "holds at twelve blocks" in text
    twin_gains_more = {**gain, (report.TWIN, "brown-pos", "drop1"): 0.02}
    assert not report.verdict(report.contrasts(summaries(twin_gains_more)))[0]
    other_task_hurts = {**gain, (report.MLM, "brown-propn", "drop1"): -0.01}
    holds, text = report.verdict(report.contrasts(summaries(other_task_hurts)))
    assert not holds and "significantly negative" in text
    assert not report.verdict(report.contrasts(summaries({})))[0]


def test_no_contrast_before_every_cell_has_its_ten_seeds() -> None:
    """Holm ranks all 8 contrasts, so the report names what is missing instead of computing a partial family."""
    frame = summaries({})
    assert report.missing_runs(frame) == []
    mlm_only = frame[frame.model == report.MLM]
    missing = report.missing_runs(mlm_only)
    assert len(missing) == 4 and all(line.startswith(report.TWIN) for line in missing)
    assert "0 of 10 seeds" in missing[0]
    one_gone = frame.drop(frame[(frame.model == report.MLM) & (frame.arm == "repair1") & (frame.seed == 7)
                                & (frame.task == "brown-pos")].index)
    assert report.missing_runs(one_gone) == [f"{report.MLM} brown-pos repair1: 9 of 10 seeds (missing 7)"]
    assert len(report.missing_runs(frame.iloc[0:0])) == 12


@pytest.mark.slow
def test_the_committed_tables_are_what_the_committed_runs_give(tmp_path) -> None:
    """Recompute the report from the 120 committed runs (linked, not copied) and compare with the committed tables."""
    committed = report.OUT
    if not (committed / "contrasts.csv").exists():
        pytest.skip("the twelve-block report is not committed")
    (tmp_path / "convergence").symlink_to(committed / "convergence", target_is_directory=True)
    assert report.write_tables(tmp_path) == 0
    for name in ("contrasts.csv", "cells.csv", "convergence_curves.csv"):
        fresh, kept = pd.read_csv(tmp_path / name), pd.read_csv(committed / name)
        assert list(fresh.columns) == list(kept.columns) and len(fresh) == len(kept), name
        numeric = fresh.select_dtypes("number").columns
        assert np.allclose(fresh[numeric].to_numpy(float), kept[numeric].to_numpy(float), rtol=1e-5, atol=1e-9,
                           equal_nan=True), name
        text = fresh.columns.difference(numeric)
        assert fresh[text].astype(str).equals(kept[text].astype(str)), name
    assert (tmp_path / "verdict.md").read_text() == (committed / "verdict.md").read_text()
    assert (tmp_path / "convergence_curves.png").stat().st_size > 0
