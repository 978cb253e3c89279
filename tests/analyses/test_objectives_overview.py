"""analyses.objectives.overview: issue 52's per-objective table is rewritten from the committed tables of Parts 1-4,
and each of its numbers is the one its own table gives (exact-zero sets, probe verdicts, the families' contrasts)."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pandas as pd
import pytest

from analyses.objectives import measures, overview
from analyses.objectives.overview import Row, cell

COMMITTED = overview.OUT
MODEL = {label: model for model, label in overview.LABELS.items()}


def close(row: Row, family_row: pd.Series) -> bool:
    """The overview's contrast (from the run summaries, AUCs written to 6 significant digits) is the family table's
    (from the runs): mean and CI within 2e-6, the Holm p within 1e-4 relative."""
    return (all(math.isclose(getattr(row, c), family_row[c], rel_tol=0, abs_tol=2e-6)
                for c in ("mean", "ci_low", "ci_high"))
            and math.isclose(row.p_holm, family_row.p_holm, rel_tol=1e-4))


def test_the_committed_overview_is_rewritten_from_the_committed_tables(tmp_path):
    if not (COMMITTED / "overview.md").is_file():
        pytest.skip("figures/objectives/overview.md is not committed yet")
    overview.write_overview(tmp_path)
    assert (tmp_path / "overview.md").read_text() == (COMMITTED / "overview.md").read_text()
    fresh, kept = pd.read_csv(tmp_path / "overview.csv"), pd.read_csv(COMMITTED / "overview.csv")
    assert list(fresh.columns) == list(kept.columns) and len(fresh) == len(kept)
    for column in ("mean", "ci_low", "ci_high", "p_holm"):
        assert np.allclose(fresh[column], kept[column], rtol=1e-9, atol=0, equal_nan=True), column
    for column in ("part", "measure", "model", "text"):
        assert fresh[column].fillna("").tolist() == kept[column].fillna("").tolist(), column


def test_the_exact_zero_sets_are_the_theory_s():
    rows = {r.model: r for r in overview.zero_rows() if r.measure.startswith("last block:")}
    assert set(rows) == set(overview.LABELS.values())
    for run in measures.COMPARES["own"]:
        meta = measures.run_meta(overview.MEASURES, run)
        theory = [] if meta["loss"] == "all-positions" else list(meta["after_mixing_sublayers"])
        assert rows[run.label].text == (", ".join(theory) or "none") and rows[run.label].mean == len(theory)
    assert [rows[m].mean for m in ("mini-en", "twin", "mask40", "diffusion")] == [6, 0, 6, 6]


def test_each_probe_verdict_is_the_one_its_robustness_table_states():
    for r in overview.probe_rows():
        if r.measure.endswith("verdict"):
            task = r.measure.split()[1].rstrip(":")
            text = (overview.PROBES[r.model] / "last_layer_drops.md").read_text()
            assert f"| {r.model} | {task} | {r.text} |" in text, (r.model, task, r.text)


def test_each_fine_tuning_contrast_is_its_family_s_number():
    rows = overview.finetune_rows()
    family_a = pd.read_csv(overview.FINETUNE / "family_a.csv")
    powered = pd.read_csv(overview.POWERED)
    tables = {"mini-en": powered[powered.regime == "convergence"], "mask40": family_a, "diffusion": family_a}
    checked = 0
    for r in rows:
        if r.part != "3" or r.model not in tables:
            continue
        task, arm = r.measure.split(", ")[1].split(":")[0], r.measure.split(": ")[1].split()[0]
        hit = tables[r.model][tables[r.model].contrast.str.endswith(f"{r.model} {arm} - full")
                              & (tables[r.model].task == task)].iloc[0]
        assert close(r, hit), (r, hit)
        checked += 1
    assert checked == 18  # 3 arms x 2 tasks x (mini-en, mask40, diffusion)
    family_b = overview.FINETUNE / "family_b.csv"
    if family_b.is_file():
        table = pd.read_csv(family_b)
        low = [r for r in rows if r.part == "4"]
        assert len(low) == 8
        for r in low:
            arm = r.measure.split(": ")[1].split()[0]
            hit = table[(table.model == MODEL[r.model]) & (table.arm == arm)].iloc[0]
            assert close(r, hit)


def test_the_seed_regime_rows_wait_for_family_b(tmp_path):
    for name in ("run_summaries_lr1e-4.csv", "family_a.csv"):
        shutil.copy(overview.FINETUNE / name, tmp_path / name)
    low = [r for r in overview.finetune_rows(tmp_path) if r.part == "4"]
    assert len(low) == 8 and {r.text for r in low} == {"not yet (Family B incomplete)"}
    assert all(math.isnan(r.mean) for r in low)


def test_a_contrast_is_bold_only_when_its_family_rejects_it():
    row = dict(part="3", measure="lr 1e-4, brown-pos: drop1 - full (AUC)", model="mini-en", mean=-0.02,
               ci_low=-0.03, ci_high=-0.01, digits=4)
    assert cell(Row(**row, p_holm=0.01)) == "**-0.0200** [-0.0300, -0.0100]"
    assert cell(Row(**row, p_holm=0.2)) == cell(Row(**row)) == "-0.0200 [-0.0300, -0.0100]"
    assert cell(Row("1", "context / loss ratio, layer 6", "mask40", 0.0, 0.0, 0.0)) == "0 (exact)"
    assert cell(Row("1", "context / loss ratio, layer 6", "twin", 0.02, 0.019, 0.021)) == "0.020 [0.019, 0.021]"
    assert cell(Row("4", "lr 1e-5, brown-pos: drop1 - full (AUC)", "twin", text="not run")) == "not run"


def test_the_results_page_carries_the_committed_overview_verbatim():
    if not (COMMITTED / "overview.md").is_file():
        pytest.skip("figures/objectives/overview.md is not committed yet")
    page = (overview.ROOT / "docs/results/objectives.md").read_text()
    assert (COMMITTED / "overview.md").read_text().rstrip("\n") in page


def test_a_missing_source_table_is_named_with_the_target_that_writes_it(tmp_path):
    with pytest.raises(SystemExit, match=r"not there: .*pressure\.csv \(make -C analyses objectives-pressure\)"):
        overview.overview(pressure_dir=tmp_path)
