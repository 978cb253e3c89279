"""`gradflow diagnose --resume` (issue 28) on a tiny BERT and the committed sample's first 24 windows: a run
killed with SIGKILL at any point (inside a checkpoint write, after one, between batches), or interrupted, then
resumed, finishes with the tables of an uninterrupted run: every CSV byte-identical, meta.json identical but for
``command`` and ``wall_s`` (and the source revision). Settings that differ from the checkpoint's are refused."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gradflow.cli import main
from gradflow.runs.checkpoint import Checkpoint, latest_checkpoint, rank_dir
from gradflow.runs.representations import Reservoir, RunningMoments
from gradflow.runs.resume import split_state

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
CSVS = ("logit_lens.csv", "input_shift.csv", "anisotropy.csv", "transformation.csv")
# 24 windows in batches of 4, a checkpoint every 8 sequences: 3 checkpoints in a run
KILL_POINTS = ("kill_in_checkpoint:2", "kill_at_batch:5", "kill_after_checkpoint:2")


def args(model: Path | str, out: Path, *extra: str) -> list[str]:
    """The diagnose command line every run of these tests shares (on the committed sample; the tiny BERT, since the
    embedded model's input-shift probes take a minute on a loaded machine)."""
    return ["diagnose", "--model", str(model), "--out", str(out), "--max-length", "24",
            "--batch-size", "4", "--limit", "24", "--checkpoint-every", "8", "--format", "png", *extra]


def same_meta(meta: dict) -> dict:
    """meta.json less what may differ between an uninterrupted and a resumed run."""
    meta = {k: v for k, v in meta.items() if k not in ("command", "wall_s")}
    meta["versions"] = {k: v for k, v in meta["versions"].items() if k != "gradflow_revision"}
    return meta


def assert_same_run(reference: Path, run: Path) -> None:
    """``run`` finished with ``reference``'s tables (CSV bytes, meta.json but timing and command), no checkpoint."""
    for name in CSVS:
        assert (run / name).read_bytes() == (reference / name).read_bytes(), name
    ref_meta, meta = (json.loads((d / "meta.json").read_text()) for d in (reference, run))
    assert meta["complete"] is True and "progress" not in meta and meta["counts"]["sequences"] == 24
    assert same_meta(meta) == same_meta(ref_meta)
    assert not (run / ".checkpoint").exists(), "checkpoints are removed once the run is complete"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_mlm_dir) -> Path:
    """The first 24 windows of the committed sample, diagnosed without a stop."""
    out = tmp_path_factory.mktemp("diag_ref") / "run"
    assert main(args(tiny_mlm_dir, out)) == 0
    return out


@pytest.fixture(scope="module")
def killed(tmp_path_factory, tiny_mlm_dir) -> dict[str, Path]:
    """One real `gradflow diagnose` per kill point, all started at once, each SIGKILLed by the test hook."""
    root = tmp_path_factory.mktemp("diag_killed")
    procs = {}
    for point in KILL_POINTS:
        out = root / point.replace(":", "_")
        procs[point] = (out, subprocess.Popen([sys.executable, "-m", "gradflow", *args(tiny_mlm_dir, out)],
                                              env={**ENV, "GRADFLOW_FAULT": point}, stderr=subprocess.PIPE, text=True))
    for point, (_, proc) in procs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == -9, f"{point}: {proc.returncode}\n{err[-2000:]}"
    return {point: out for point, (out, _) in procs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("point", KILL_POINTS)
def test_sigkill_then_resume_is_identical(point, killed, reference, tiny_mlm_dir):
    out = killed[point]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["complete"] is False and meta["progress"]["sequences"] >= 8  # a killed run says how far it got
    held = latest_checkpoint(rank_dir(out, 0)).state["progress"]["sequences"]
    # a torn second checkpoint leaves the first; a kill after the second, before its meta.json, the second
    assert (held, meta["progress"]["sequences"]) == {"kill_in_checkpoint:2": (8, 8), "kill_at_batch:5": (16, 16),
                                                     "kill_after_checkpoint:2": (16, 8)}[point]
    assert main(args(tiny_mlm_dir, out, "--resume")) == 0
    assert_same_run(reference, out)


def interrupted(model: Path, tmp_path: Path, monkeypatch, at_batch: int = 5) -> Path:
    """An in-process run stopped by an interrupt at batch ``at_batch`` (checkpoints every 2 batches)."""
    from gradflow.runs import diagnose

    calls = {"n": 0}
    real = diagnose.collect_states

    def stop(*a, **k):
        calls["n"] += 1
        if calls["n"] == at_batch:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(diagnose, "collect_states", stop)
    out = tmp_path / "stopped"
    assert main(args(model, out)) == 130
    monkeypatch.setattr(diagnose, "collect_states", real)
    return out


def test_interrupted_run_writes_partial_tables_then_resumes_identically(tmp_path, reference, monkeypatch,
                                                                       tiny_mlm_dir):
    out = interrupted(tiny_mlm_dir, tmp_path, monkeypatch)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["complete"] is False and meta["counts"]["sequences"] == 16
    assert meta["progress"]["sequences"] == 16 and meta["progress"]["windows"] == 16
    assert all((out / name).is_file() for name in CSVS)  # the interrupt's partial tables
    assert main(args(tiny_mlm_dir, out, "--resume")) == 0
    assert_same_run(reference, out)


def test_refusals_name_what_to_do(tmp_path, reference, monkeypatch, capsys, tiny_mlm_dir):
    def refused(argv: list[str], *needles: str) -> None:
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and all(n in err for n in needles), err

    model = tiny_mlm_dir
    out = interrupted(model, tmp_path, monkeypatch)
    refused(args(model, out), "unfinished run", "--resume", "--overwrite")
    refused(args(model, out, "--resume", "--seed", "1"), "differ", "seed: 0 -> 1")
    refused(args(model, out, "--resume", "--max-length", "20"), "max_length: 24 -> 20")
    refused(args(model, out, "--resume", "--limit", "20"), "limit: 24 -> 20")
    refused(args("gradflow-mini-en", out, "--resume"), "differ", "config_hash")
    refused(["record", "--model", str(model), "--out", str(out), "--resume", "--max-length", "24",
             "--batch-size", "4", "--limit", "24"], "written by gradflow diagnose", "gradflow diagnose --resume")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(args(model, empty, "--resume"), "holds no checkpoint", "gradflow diagnose run")
    refused(args(model, tmp_path / "absent", "--resume"), "does not exist")
    refused(args(model, reference, "--resume"), "is complete")
    # --overwrite starts over deliberately: the checkpoints go
    assert main(args(model, out, "--overwrite", "--checkpoint-every", "1000")) == 0
    assert not (out / ".checkpoint").exists()
    assert_same_run(reference, out)


def test_full_disk_names_the_directory_and_keeps_the_checkpoint(tmp_path, reference, tiny_mlm_dir, monkeypatch,
                                                                 capsys):
    from gradflow.runs import diagnose

    real, calls = diagnose.save_checkpoint, {"n": 0}

    def full(folder, checkpoint):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint: the first (8 sequences) is durable
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(folder, checkpoint)

    monkeypatch.setattr(diagnose, "save_checkpoint", full)
    out = tmp_path / "full"
    assert main(args(tiny_mlm_dir, out)) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "No space left on device" in err and "8 sequences" in err and "--resume" in err
    assert "Traceback" not in err
    assert latest_checkpoint(rank_dir(out, 0)).state["progress"]["sequences"] == 8
    monkeypatch.setattr(diagnose, "save_checkpoint", real)
    assert main(args(tiny_mlm_dir, out, "--resume")) == 0
    assert_same_run(reference, out)


def test_record_checkpoint_is_refused_by_diagnose(tmp_path, capsys, tiny_mlm_dir):
    from gradflow.runs import record_tables as record  # the per-sequence rows are made there

    calls = {"n": 0}
    real = record.sequence_rows

    def stop(batch_record):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(batch_record)

    out = tmp_path / "rec"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(record, "sequence_rows", stop)
        assert main(["record", "--model", str(tiny_mlm_dir), "--out", str(out), "--max-length", "24",
                     "--batch-size", "4", "--limit", "24", "--checkpoint-every", "8", "--quiet"]) == 130
    capsys.readouterr()
    assert main(args(tiny_mlm_dir, out, "--resume")) == 2
    err = capsys.readouterr().err
    assert "written by gradflow record" in err and "gradflow record --resume" in err and "Traceback" not in err


# ---- the accumulators' state round trip exactly, whatever the split ----------------------------------------------

def _roundtrip(state: dict) -> dict:
    """``state`` through a checkpoint file's bytes (safetensors tensors + JSON), as a resumed job reads it."""
    tensors, rest = split_state(state)
    back = Checkpoint.from_bytes(Checkpoint({"accumulators": rest}, tensors).to_bytes())
    return {**back.state["accumulators"], **back.tensors}


@pytest.mark.parametrize("cut", [0, 1, 3, 7])
def test_reservoir_and_moments_resumed_at_any_point_equal_one_pass(cut):
    rng = np.random.default_rng(5)
    chunks = [rng.normal(size=(int(rng.integers(0, 9)), 6)).astype(np.float32) for _ in range(8)]
    whole, first = Reservoir(10, (0, 1, 2)), Reservoir(10, (0, 1, 2))
    moments, head = RunningMoments(), RunningMoments()
    for x in chunks:
        whole.add(x)
        moments.add(x)
    for x in chunks[:cut]:
        first.add(x)
        head.add(x)
    second, tail = Reservoir(10, (0, 1, 2)), RunningMoments()
    second.load_state_dict(_roundtrip(first.state_dict()))
    tail.load_state_dict(_roundtrip(head.state_dict()))
    for x in chunks[cut:]:
        second.add(x)
        tail.add(x)
    assert second.seen == whole.seen
    np.testing.assert_array_equal(second.sample(), whole.sample())
    np.testing.assert_array_equal(second.keys, whole.keys)
    assert tail.n == moments.n
    np.testing.assert_array_equal(tail.mean, moments.mean)
    np.testing.assert_array_equal(tail.m2, moments.m2)
