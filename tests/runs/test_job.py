"""The one corpus-job skeleton (runs/job.py): one length check, one loop, one interrupt rule, for every job."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

from gradflow.errors import DiagnosticsError, UsageError
from gradflow.inputs.masking import BertMasking
from gradflow.roles import TOKEN_ROLES, Role
from gradflow.runs.check import check_model
from gradflow.runs.diagnose import diagnose_corpus
from gradflow.runs.evaluation import mlm_accuracy
from gradflow.runs.job import INTERRUPTED, CorpusJob, RoleTally, check_max_length, open_job
from gradflow.runs.record import RecordConfig, record_corpus

SRC = Path(__file__).resolve().parents[2] / "src" / "gradflow"
TOO_LONG = 1000  # the tiny model accepts 64 positions


@pytest.fixture(scope="module")
def loaded(tiny_mlm_dir):
    from gradflow.models import load_model

    return load_model(str(tiny_mlm_dir))


def _message(name: str) -> str:
    return f"--max-length {TOO_LONG} is longer than the 64 positions {name} accepts; pass --max-length 64 or less."


# ------------------------------------------------------------------------------ one length check
def test_check_max_length_names_the_option_and_the_limit(loaded):
    check_max_length(64, loaded)
    with pytest.raises(UsageError) as err:
        check_max_length(TOO_LONG, loaded, "some-model")
    assert str(err.value) == _message("some-model")


def test_record_refuses_an_over_long_window_and_leaves_nothing(loaded, tiny_mlm_dir, tiny_corpus, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(UsageError) as err:
        record_corpus(RecordConfig(out=str(out), model=str(tiny_mlm_dir), texts=str(tiny_corpus),
                                   max_length=TOO_LONG, quiet=True), loaded)
    assert str(err.value) == _message(str(tiny_mlm_dir))
    assert not out.exists()


@pytest.mark.parametrize("job", ["diagnose", "check", "evaluation"])
def test_every_job_refuses_an_over_long_window_the_same_way(job, loaded, tiny_corpus, tmp_path):
    run = {"diagnose": lambda: diagnose_corpus(loaded, str(tiny_corpus), tmp_path / "d", max_length=TOO_LONG),
           "check": lambda: check_model(loaded, str(tiny_corpus), max_length=TOO_LONG),
           "evaluation": lambda: mlm_accuracy(loaded, str(tiny_corpus), max_length=TOO_LONG)}[job]
    with pytest.raises(UsageError) as err:
        run()
    assert str(err.value) == _message(loaded.name)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("command", ["record", "diagnose", "check"])
def test_cli_length_error_is_one_paragraph_exit_2(command, tiny_mlm_dir, tiny_corpus, tmp_path, capsys):
    from gradflow.cli import main

    out = [] if command == "check" else ["--out", str(tmp_path / "o")]
    code = main([command, "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--max-length", str(TOO_LONG),
                 *out])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1
    assert re.search(rf"--max-length {TOO_LONG} is longer than the 64 positions .+ accepts; pass --max-length 64 "
                     r"or less\.", err), err


# ------------------------------------------------------------------------------ one loop, one tally
def test_role_tally_counts_and_merges():
    roles = torch.tensor([[Role.SPECIAL, Role.MASKED, Role.CONTEXT, Role.SPECIAL, Role.PAD],
                          [Role.SPECIAL, Role.PROMPT, Role.SPECIAL, Role.KEPT, Role.SPECIAL]])
    tally = RoleTally()
    tally.add(roles)
    assert (tally.sequences, tally.batches) == (2, 1)
    assert tally.tokens == {"masked": 1, "random": 0, "kept": 1, "context": 1, "prompt": 1, "special": 5, "pad": 1}
    assert list(tally.tokens) == list(TOKEN_ROLES)
    assert (tally.loss_tokens, tally.real_tokens) == (2, 9)
    other = RoleTally()
    other.add(roles[:1])
    tally.merge(other)
    assert (tally.sequences, tally.batches, tally.tokens["special"], tally.tokens["prompt"]) == (3, 2, 7, 1)
    before = RoleTally(tokens={"masked": 1, "random": 0, "kept": 0, "context": 2, "special": 2, "pad": 0})
    before.add(roles[1:])  # a tally restored from a checkpoint written before the prompt role
    assert list(before.tokens) == list(TOKEN_ROLES) and (before.tokens["prompt"], before.tokens["special"]) == (1, 5)


def test_batches_are_the_pipelines_and_counts_fill_in(loaded, tiny_corpus):
    job = open_job(loaded, str(tiny_corpus), BertMasking(seed=0), 24, 4, limit=10)
    batches = list(job.batches())
    assert [len(b.sequence_index) for b in batches] == [4, 4, 2]
    assert job.counts.windows == 10 and job.source == str(tiny_corpus)
    windows = list(open_job(loaded, str(tiny_corpus), BertMasking(seed=0), 24, 4, limit=10).windows())
    assert [w.sequence_index for w in windows] == list(range(10))


def _stopped(raised: BaseException) -> CorpusJob:
    job = CorpusJob(None, [], "<none>", BertMasking(seed=0), 8, 1)
    with job.running():
        raise raised
    return job


def test_interrupt_rule():
    job = _stopped(KeyboardInterrupt())
    assert not job.complete and job.error == INTERRUPTED and job.refusal(0) is None
    with pytest.raises(KeyboardInterrupt, match="interrupted"):
        job.reraise()
    job = _stopped(RuntimeError("boom"))
    assert not job.complete and job.error == "RuntimeError: boom" and job.refusal(0) is None
    with pytest.raises(RuntimeError, match="boom"):
        job.reraise()
    bad = DiagnosticsError("bad input")
    job = _stopped(bad)
    assert job.refusal(0) is bad and job.refusal(3) is None
    done = CorpusJob(None, [], "<none>", BertMasking(seed=0), 8, 1)
    with done.running():
        pass
    assert done.complete and done.error is None
    done.reraise()
    assert done.outcome("gradflow x", ".").complete is True


def test_the_corpus_loop_is_written_once():
    """Only the skeleton (and the pipeline that defines it) calls masked_batches or catches the interrupt."""
    calls, catches = [], []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        text = path.read_text(encoding="utf-8")
        if "masked_batches(" in text and rel not in ("inputs/pipeline.py", "runs/job.py"):
            calls.append(rel)
        if rel.startswith("runs/") and "except KeyboardInterrupt" in text and rel != "runs/job.py":
            catches.append(rel)
    assert calls == [] and catches == []


# ------------------------------------------------------------------------------ interrupts flush partial results
def _raise_on_call(monkeypatch, module, name: str, n: int, error: BaseException) -> None:
    """Make ``module.name`` raise ``error`` on its ``n``-th call (1-based) from inside the batch loop."""
    real, calls = getattr(module, name), {"n": 0}

    def patched(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, patched)


def _first_batches_roles(loaded, corpus, n: int) -> dict[str, int]:
    """Positions per role of the first ``n`` batches of 4 windows of 24 tokens (BERT masking, seed 0)."""
    tally = RoleTally()
    for batch, _ in zip(open_job(loaded, str(corpus), BertMasking(seed=0), 24, 4).batches(), range(n)):
        tally.add(batch.roles)
    return tally.tokens


def test_interrupted_record_keeps_partial_counts(loaded, tiny_mlm_dir, tiny_corpus, tmp_path, monkeypatch):
    import gradflow.runs.record_tables as record_module  # where the per-sequence rows are made

    _raise_on_call(monkeypatch, record_module, "sequence_rows", 2, KeyboardInterrupt())
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        record_corpus(RecordConfig(out=str(out), model=str(tiny_mlm_dir), texts=str(tiny_corpus), max_length=24,
                                   batch_size=4, quiet=True), loaded)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["complete"] is False and meta["error"] == INTERRUPTED
    counts = meta["counts"]
    assert counts["sequences_recorded"] == 4 and counts["batches"] == 1
    assert counts["tokens_per_role"] == _first_batches_roles(loaded, tiny_corpus, 1)
    assert pd.read_parquet(out / "sequences.parquet").sequence_index.nunique() == 4


def test_interrupted_diagnose_keeps_partial_counts(loaded, tiny_corpus, tmp_path, monkeypatch):
    import gradflow.runs.diagnose as diagnose_module

    _raise_on_call(monkeypatch, diagnose_module, "collect_states", 3, KeyboardInterrupt())
    out = tmp_path / "diag"
    with pytest.raises(KeyboardInterrupt):
        diagnose_corpus(loaded, str(tiny_corpus), out, max_length=24, batch_size=4, max_per_group=50)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["complete"] is False and meta["error"] == INTERRUPTED
    assert meta["counts"]["sequences"] == 8
    assert meta["counts"]["tokens_per_role"] == _first_batches_roles(loaded, tiny_corpus, 2)
    lens = pd.read_csv(out / "logit_lens.csv")
    assert lens[lens.role == "masked"].n_positions.iloc[0] == meta["counts"]["tokens_per_role"]["masked"]


def test_diagnose_error_mid_corpus_is_flushed_then_raised(loaded, tiny_corpus, tmp_path, monkeypatch):
    import gradflow.runs.diagnose as diagnose_module

    _raise_on_call(monkeypatch, diagnose_module, "collect_states", 2, RuntimeError("device lost"))
    out = tmp_path / "diag"
    with pytest.raises(RuntimeError, match="device lost"):
        diagnose_corpus(loaded, str(tiny_corpus), out, max_length=24, batch_size=4, max_per_group=50)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["complete"] is False and meta["error"] == "RuntimeError: device lost"
    assert meta["counts"]["sequences"] == 4


def test_bad_input_before_any_batch_writes_nothing(loaded, tiny_corpus, tmp_path, monkeypatch):
    import gradflow.runs.diagnose as diagnose_module

    _raise_on_call(monkeypatch, diagnose_module, "collect_states", 1, DiagnosticsError("cannot diagnose this"))
    out = tmp_path / "diag"
    with pytest.raises(DiagnosticsError, match="cannot diagnose"):
        diagnose_corpus(loaded, str(tiny_corpus), out, max_length=24, batch_size=4)
    assert not out.exists()
