"""`gradflow record --resume` (issue 28) on the first 24 windows of the committed sample: a run killed with SIGKILL at
any point, then resumed, finishes with the tables of an uninterrupted run: every CSV byte-identical, meta.json
identical but for ``command`` and ``wall_s`` (and the source revision), the parquet rows identical. Settings that
differ from the checkpoint's are refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from gradflow.cli import main
from gradflow.runs.resume import open_resume

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
CSVS = ("channels.csv", "sublayers.csv")
PARQUETS = ("sequences.parquet", "sublayer_sequences.parquet")
RUN_FILES = {*CSVS, *PARQUETS, "meta.json"}
# 24 windows in batches of 4, a checkpoint every 8 sequences: 3 checkpoints in a run
KILL_POINTS = ("kill_in_checkpoint:2", "kill_after_parts:2", "kill_at_batch:5", "kill_after_checkpoint:2")
_REFERENCE: dict[tuple[str, str], Path] = {}


def args(model: Path, texts: Path | None, out: Path, *extra: str) -> list[str]:
    """The record command line every run of these tests shares (``texts`` None: the committed sample)."""
    corpus = ["--texts", str(texts)] if texts is not None else []
    return ["record", "--model", str(model), *corpus, "--out", str(out), "--max-length", "24",
            "--batch-size", "4", "--limit", "24", "--checkpoint-every", "8", "--quiet", *extra]


def same_meta(meta: dict) -> dict:
    """meta.json less what may differ between an uninterrupted and a resumed run."""
    meta = {k: v for k, v in meta.items() if k not in ("command", "wall_s")}
    meta["versions"] = {k: v for k, v in meta["versions"].items() if k != "gradflow_revision"}
    return meta


def assert_same_run(reference: Path, run: Path) -> None:
    """``run`` finished with ``reference``'s tables (CSV bytes, parquet rows, meta.json but timing/command)."""
    for name in CSVS:
        assert (run / name).read_bytes() == (reference / name).read_bytes(), name
    for name in PARQUETS:
        pd.testing.assert_frame_equal(pd.read_parquet(run / name), pd.read_parquet(reference / name), check_exact=True)
    ref_meta, meta = (json.loads((d / "meta.json").read_text()) for d in (reference, run))
    assert meta["complete"] is True and "progress" not in meta
    assert same_meta(meta) == same_meta(ref_meta)
    assert {p.name for p in run.iterdir()} == RUN_FILES, "parts and checkpoints are removed once the run is complete"


def reference_run(factory, model: Path, texts: Path | None = None) -> Path:
    """The uninterrupted run every resumed one is compared with (recorded once per session)."""
    key = (str(model), str(texts))
    if key not in _REFERENCE:
        out = factory.mktemp("ref") / "run"
        assert main(args(model, texts, out)) == 0
        assert json.loads((out / "meta.json").read_text())["counts"]["sequences_recorded"] == 24
        _REFERENCE[key] = out
    return _REFERENCE[key]


@pytest.fixture
def reference(tmp_path_factory, tiny_mlm_dir) -> Path:
    """The first 24 windows of the committed sample, recorded without a stop."""
    return reference_run(tmp_path_factory, tiny_mlm_dir)


@pytest.fixture(scope="module")
def killed(tmp_path_factory, tiny_mlm_dir) -> dict[str, Path]:
    """One real `gradflow record` per kill point, all started at once, each SIGKILLed by the test hook."""
    root = tmp_path_factory.mktemp("killed")
    procs = {}
    for point in KILL_POINTS:
        out = root / point.replace(":", "_")
        procs[point] = (out, subprocess.Popen([sys.executable, "-m", "gradflow", *args(tiny_mlm_dir, None, out)],
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
    assert len(pd.read_csv(out / "channels.csv")) > 0
    assert main(args(tiny_mlm_dir, None, out, "--resume")) == 0
    assert_same_run(reference, out)


def interrupted(tmp_path: Path, model: Path, texts: Path | None, monkeypatch, at_batch: int = 5) -> Path:
    """An in-process run stopped by an interrupt after ``at_batch`` batches (checkpoints every 2 batches)."""
    from gradflow.runs import record_tables as record  # the per-sequence rows are made there

    calls = {"n": 0}
    real = record.sequence_rows

    def stop(batch_record):
        calls["n"] += 1
        if calls["n"] == at_batch:
            raise KeyboardInterrupt
        return real(batch_record)

    monkeypatch.setattr(record, "sequence_rows", stop)
    out = tmp_path / "stopped"
    assert main(args(model, texts, out)) == 130
    monkeypatch.setattr(record, "sequence_rows", real)
    return out


def test_interrupted_run_resumes_identically(tmp_path, reference, tiny_mlm_dir, monkeypatch):
    out = interrupted(tmp_path, tiny_mlm_dir, None, monkeypatch)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["complete"] is False and meta["progress"] == {**meta["progress"], "sequences": 16, "windows": 16}
    assert pd.read_parquet(out / "sequences.parquet").sequence_index.nunique() == 16  # the SIGINT flush still works
    from gradflow.roles import ALL_ROLES
    from gradflow.schema_reports import RECORD_META_KEYS, undeclared_keys
    assert undeclared_keys(meta, RECORD_META_KEYS, ALL_ROLES) == []  # "progress" and its keys are documented
    # what a SIGKILLed (or torchrun-terminated) writer leaves: atomic writes' temporaries, removed on --resume
    for name in (".meta.json.k1x9.tmp", ".channels.rank1.csv.a7b2.tmp", ".sequences.parquet.q3.tmp"):
        (out / name).write_text("half written")
    assert main(args(tiny_mlm_dir, None, out, "--resume")) == 0
    assert_same_run(reference, out)  # (which finds any file left beside the run's own)


def test_only_a_run_s_own_temporaries_are_removed(tmp_path):
    from gradflow.runs.files import remove_stale_temporaries

    names = [".meta.json.k1x9.tmp", ".experts.csv.z.tmp", ".my-notes.tmp", ".metadata.tmp", "meta.json.tmp", "x.csv"]
    for name in names:
        (tmp_path / name).write_text("x")
    assert remove_stale_temporaries(tmp_path) == [".experts.csv.z.tmp", ".meta.json.k1x9.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])


def test_refusals_name_what_to_do(tmp_path, reference, tiny_mlm_dir, monkeypatch, capsys):
    def refused(argv: list[str], *needles: str) -> None:
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and all(n in err for n in needles), err

    out = interrupted(tmp_path, tiny_mlm_dir, None, monkeypatch)
    refused(args(tiny_mlm_dir, None, out), "unfinished run", "--resume")
    refused(args(tiny_mlm_dir, None, out, "--resume", "--seed", "1"), "differ", "seed: 0 -> 1")
    refused(args(tiny_mlm_dir, None, out, "--resume", "--max-length", "20"), "max_length: 24 -> 20")
    rank1 = out / ".checkpoint" / "rank1"
    shutil.copytree(out / ".checkpoint" / "rank0", rank1)
    refused(args(tiny_mlm_dir, None, out, "--resume"), "checkpointed by 2 process(es)", "has 1")
    # under torchrun, a process killed before its first checkpoint starts its shard over; the others resume
    assert open_resume(out, 1, 2).state["progress"]["sequences"] == 16
    shutil.move(out / ".checkpoint" / "rank0", tmp_path / "rank0")
    assert open_resume(out, 0, 2) is None
    shutil.move(tmp_path / "rank0", out / ".checkpoint" / "rank0")
    shutil.rmtree(rank1)
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(args(tiny_mlm_dir, None, empty, "--resume"), "holds no checkpoint", "--overwrite")
    refused(args(tiny_mlm_dir, None, tmp_path / "absent", "--resume"), "does not exist")
    refused(args(tiny_mlm_dir, None, reference, "--resume"), "is complete")
    # --overwrite starts over deliberately: the checkpoints go with the run files
    assert main(args(tiny_mlm_dir, None, out, "--overwrite", "--checkpoint-every", "1000")) == 0
    assert not (out / ".checkpoint").exists() and json.loads((out / "meta.json").read_text())["complete"] is True


def test_cadence_every_n_sequences_or_m_minutes(monkeypatch):
    from gradflow.runs import resume

    now = {"t": 1000.0}
    monkeypatch.setattr(resume.time, "time", lambda: now["t"])
    cadence = resume.Cadence(every=8, minutes=2.0)
    assert [cadence.due(4) for _ in range(4)] == [False, True, False, True]  # every 8 sequences
    now["t"] += 119.0
    assert cadence.due(1) is False
    now["t"] += 1.0
    assert cadence.due(1) is True and cadence.sequences == 0  # or after 2 minutes, whichever comes first
    assert (resume.DEFAULT_EVERY, resume.DEFAULT_MINUTES) == (1024, 10.0)


@pytest.mark.slow
def test_torchrun_two_processes_killed_then_resumed_is_identical(tmp_path, tiny_mlm_dir):
    # each rank checkpoints its own shard (.checkpoint/rank<r>); torchrun gives up when a rank is SIGKILLed
    env = {**ENV, "OMP_NUM_THREADS": "1", "GRADFLOW_BACKEND": "gloo"}

    def torchrun(out: Path, port: int, *extra: str, fault: str = "") -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
               "-m", "gradflow", "record", "--model", str(tiny_mlm_dir), "--out", str(out), "--max-length", "24",
               "--batch-size", "2", "--limit", "24", "--checkpoint-every", "4", "--quiet", *extra]
        proc = subprocess.run(cmd, check=False, env={**env, "GRADFLOW_FAULT": fault}, capture_output=True, text=True,
                              timeout=600)
        return proc

    ref, run = tmp_path / "ref", tmp_path / "run"
    proc = torchrun(ref, 29751)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torchrun(run, 29752, fault="kill_at_batch:4").returncode != 0
    # (a rank slower than the one killed may have no checkpoint yet: it starts its shard over)
    assert {p.name for p in (run / ".checkpoint").iterdir()} & {"rank0", "rank1"}
    # at each checkpoint every process rewrote its own partial tables and meta.json; rank 0's is meta.json too
    partial = [r for r in range(2) if (run / f"meta.rank{r}.json").is_file()]
    assert partial and set(partial) <= {int(p.name[4:]) for p in (run / ".checkpoint").iterdir()}
    for r in partial:
        meta = json.loads((run / f"meta.rank{r}.json").read_text())
        assert meta["complete"] is False and meta["world_size"] == 2 and meta["progress"]["sequences"] == 4
        assert meta["counts"]["sequences_recorded"] == 4
        channels = pd.read_csv(run / f"channels.rank{r}.csv")
        assert channels["n_positions"].sum() > 0 and (run / f"sublayers.rank{r}.csv").is_file()
    if 0 in partial:
        assert json.loads((run / "meta.json").read_text())["complete"] is False
    proc = torchrun(run, 29753, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run / "meta.json").read_text())["world_size"] == 2
    assert_same_run(ref, run)
