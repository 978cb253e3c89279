"""`gradflow atlas` resumes an interrupted model's steps (issue 28): a model SIGKILLed inside its record step, or
inside its diagnostics step, is continued by the next atlas run from the step's last checkpoint (a finished step is
kept), and the model's tables and atlas.csv are those of an uninterrupted atlas: every CSV byte-identical, the
per-sequence rows identical. An interrupted model started with other settings is redone from scratch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import gradflow.runs.atlas as atlas_job
from gradflow.cli.main import main
from gradflow.runs.checkpoint import has_checkpoint
from gradflow.schema import ATLAS_DONE_FILE, ATLAS_FILE, ATLAS_STARTED_FILE, ATLAS_STEP_DIRS, META_FILE

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
# 24 windows in batches of 4, a checkpoint every 8 sequences: record passes batches 1-6, diagnostics 7-12
COMMON = ["--limit", "24", "--max-length", "24", "--batch-size", "4", "--checkpoint-every", "8", "--no-probes",
          "--resamples", "50", "--format", "png", "--quiet"]


def atlas_args(model: Path, corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["atlas", str(model), "--out", str(out), "--texts", str(corpus), *COMMON, *extra]


def model_dir(out: Path) -> Path:
    """The atlas's one model directory."""
    (path,) = [p for p in out.iterdir() if (p / ATLAS_STARTED_FILE).is_file()]
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_mlm_dir, tiny_corpus) -> Path:
    """The atlas of the tiny model, run without a stop."""
    out = tmp_path_factory.mktemp("atlas_ref") / "atlas"
    assert main(atlas_args(tiny_mlm_dir, tiny_corpus, out)) == 0
    return out


def assert_same_model(reference: Path, run: Path) -> None:
    """``run``'s model steps and atlas.csv are ``reference``'s (CSV bytes, per-sequence rows), nothing left over."""
    ref, got = model_dir(reference), model_dir(run)
    csvs = sorted(p.relative_to(ref) for p in ref.rglob("*.csv"))
    assert csvs and csvs == sorted(p.relative_to(got) for p in got.rglob("*.csv"))
    for name in csvs:
        assert (got / name).read_bytes() == (ref / name).read_bytes(), name
    for name in ("sequences.parquet", "sublayer_sequences.parquet"):
        pd.testing.assert_frame_equal(pd.read_parquet(got / "record" / name), pd.read_parquet(ref / "record" / name),
                                      check_exact=True)
    assert (run / ATLAS_FILE).read_bytes() == (reference / ATLAS_FILE).read_bytes()
    assert not any(p.name == ".checkpoint" for p in got.rglob("*")), "checkpoints go once each step is complete"
    ref_done, done = (json.loads((d / ATLAS_DONE_FILE).read_text()) for d in (ref, got))
    assert {k: v for k, v in done.items() if k != "wall_s"} == {k: v for k, v in ref_done.items() if k != "wall_s"}


@pytest.mark.slow
@pytest.mark.parametrize("step, point", [("record", "kill_at_batch:5"), ("diagnostics", "kill_at_batch:11")])
def test_model_killed_in_a_step_resumes_it(step, point, tmp_path, reference, tiny_mlm_dir, tiny_corpus,
                                           monkeypatch):
    out = tmp_path / "atlas"
    proc = subprocess.run([sys.executable, "-m", "gradflow", *atlas_args(tiny_mlm_dir, tiny_corpus, out)],
                          env={**ENV, "GRADFLOW_FAULT": point}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr[-2000:]
    path = model_dir(out)
    stopped = path / ATLAS_STEP_DIRS[step]
    meta = json.loads((stopped / META_FILE).read_text())
    assert not (path / ATLAS_DONE_FILE).exists() and has_checkpoint(stopped)
    assert meta["complete"] is False and meta["progress"]["sequences"] == 16
    if step == "diagnostics":
        assert json.loads((path / ATLAS_STEP_DIRS["record"] / META_FILE).read_text())["complete"] is True

    calls = []
    record, diagnose = atlas_job.record_corpus, atlas_job.diagnose_corpus
    monkeypatch.setattr(atlas_job, "record_corpus",
                        lambda config, loaded=None: calls.append(("record", config.resume)) or record(config, loaded))
    monkeypatch.setattr(atlas_job, "diagnose_corpus",
                        lambda *a, **k: calls.append(("diagnostics", k["resume"])) or diagnose(*a, **k))
    assert main(atlas_args(tiny_mlm_dir, tiny_corpus, out)) == 0
    # the stopped step resumes; a step finished before is kept (not run again); a later one runs
    assert calls == ([("record", True), ("diagnostics", False)] if step == "record" else [("diagnostics", True)])
    assert_same_model(reference, out)


def test_interrupted_model_with_other_settings_starts_over(tmp_path):
    model = atlas_job.AtlasModel(0, "m", "m", "m", None, None)
    config = atlas_job.AtlasConfig(models=("m",), out=str(tmp_path))
    path = tmp_path / "m"
    for step in ("record", "diagnostics", "check"):
        (path / ATLAS_STEP_DIRS[step]).mkdir(parents=True)
    (path / META_FILE).write_text("{}")
    settings = atlas_job._settings(model, config)
    (path / ATLAS_STARTED_FILE).write_text(json.dumps({"settings": settings}))
    said = []
    assert atlas_job._prepare_model_dir(path, settings, said.append) is True  # same settings: steps kept
    assert sorted(p.name for p in path.iterdir()) == sorted([ATLAS_STARTED_FILE, ATLAS_STEP_DIRS["record"],
                                                             ATLAS_STEP_DIRS["diagnostics"]]) and said
    # the cadence of checkpoints or the figure formats do not change the steps; the seed or the limit do
    cadence = atlas_job._settings(model, atlas_job.AtlasConfig(("m",), str(tmp_path), checkpoint_every=3,
                                                               formats=("pdf",), quiet=True))
    assert cadence == settings
    other = atlas_job._settings(model, atlas_job.AtlasConfig(models=("m",), out=str(tmp_path), seed=1))
    assert other != settings and atlas_job._settings(model, atlas_job.AtlasConfig(("m",), str(tmp_path),
                                                                                   limit=5)) != settings
    assert atlas_job._prepare_model_dir(path, other, said.append) is False and not path.exists()
