"""Issue 52, plan Part 1 (``analyses/objectives/measures.py``): ``figures/objectives/measures/summary.md`` is what the
committed run, report, check and pressure tables give, and the committed exact-zero sets agree with the theory.

No model is run: everything is read from the committed files (about a second).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from analyses.objectives import measures

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / measures.DEFAULT_OUT
PRESSURE = ROOT / measures.DEFAULT_PRESSURE
AFTER_MIXING = ["attn.q", "attn.out", "attn.norm", "ffn.in", "ffn.out", "ffn.norm"]
V1 = ROOT / "figures/objectives/diffusion-v1"  # the first diffusion member's Part 1, kept as history (issue 60)
STUDIES = {"first diffusion member": (V1 / "measures", V1 / "pressure", V1 / "pretraining_curves.csv"),
           "second diffusion member": (OUT, PRESSURE, ROOT / "figures/objectives/pretraining_curves.csv")}
committed = pytest.mark.skipif(not (OUT / "summary.md").is_file(), reason="the Part 1 measures are not committed")
each_study = pytest.mark.parametrize("study", sorted(STUDIES))


@each_study
def test_the_summary_is_recomputed_from_the_committed_tables(study):
    out, pressure, curves = STUDIES[study]
    text = (out / "summary.md").read_text(encoding="utf-8")
    assert measures.summary_text(out, pressure, curves) == text
    # the unigram-stage note follows the curves: on the first member's tables, never on the second's
    assert (measures.UNIGRAM in text) == (study == "first diffusion member")


@each_study
def test_the_exact_zero_sets_agree_with_the_theory(study):
    out = STUDIES[study][0]
    assert measures.defects(out) == []
    for run in measures.RUNS:
        expected = [] if run.name == "twin_all-positions" else AFTER_MIXING
        assert sorted(measures.last_block_zero(out, run)) == sorted(expected), run.name
    for label in measures.MODELS:
        assert measures.check_zero(measures.check_result(out, label)) == AFTER_MIXING, label


@each_study
def test_every_run_is_complete_on_the_committed_sample_with_its_objective(study):
    for run in measures.RUNS:
        meta = measures.run_meta(STUDIES[study][0], run)
        assert meta["complete"] and meta["seed"] == 0 and meta["texts"] == "gradflow:data/sotu_sample.txt"
        assert meta["model"] == measures.MODELS[run.label] and meta["limit"] is None
        assert meta["loss"] == ("all-positions" if run.name == "twin_all-positions" else "mlm")
        policy = meta["masking"]["policy"]
        assert policy == ("diffusion" if run.name.startswith("diffusion_diff") or run.name == measures.GRID_RUN
                          else "bert"), run.name
        if policy == "bert":
            assert meta["masking"]["rate"] == (0.4 if run.name == "mask40_bert40" else 0.15)


@each_study
def test_the_pressure_table_has_the_four_models(study):
    import pandas as pd

    frame = pd.read_csv(STUDIES[study][1] / "pressure.csv")
    assert sorted(frame["model"].unique()) == sorted(measures.MODELS)
    assert (frame["loss"] == "all-positions").all()


def test_scratch_runs_stay_out_of_the_committed_folder(tmp_path):
    run = measures.RUNS[0]
    assert measures.scratch(run, ROOT / measures.DEFAULT_OUT) == ROOT / "runs" / f"objectives-{run.name}"
    assert measures.scratch(run, tmp_path) == tmp_path / "scratch" / run.name


def test_the_runs_cover_the_plan():
    own = {r.label: r for r in measures.RUNS if r.own}
    yardstick = {r.label for r in measures.RUNS if r.yardstick}
    assert set(own) == yardstick == set(measures.MODELS)
    assert own["twin"].args == ("--loss", "all-positions") and own["mask40"].args == ("--mask-rate", "0.4")
    assert own["diffusion"].args == ("--objective", "diffusion") and own["mini-en"].yardstick
    grid = next(r for r in measures.RUNS if r.name == measures.GRID_RUN)
    assert [float(t) for t in grid.args[-1].split(",")] == [k / 10 for k in range(1, 11)]
