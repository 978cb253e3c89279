"""Ctrl-C during a corpus job: the first SIGINT ends the job at the next batch boundary, the second at once."""

from __future__ import annotations

import json
import os
import signal

import pandas as pd
import pytest

from gradflow.cli import main
from gradflow.runs import record as record_module
from gradflow.runs.interrupts import stop_on_sigint


@pytest.fixture(autouse=True)
def python_default_sigint():
    """Each test starts from Python's own SIGINT handler, however pytest was launched: a shell's background
    job (``nohup pytest &``) inherits an ignored SIGINT, which ``stop_on_sigint`` rightly leaves alone."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_first_sigint_is_a_request_the_second_an_interrupt_and_the_handler_comes_back():
    with stop_on_sigint() as request:
        assert not request.requested
        os.kill(os.getpid(), signal.SIGINT)
        assert request.requested  # no KeyboardInterrupt: the job decides where to stop
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_sigint_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with stop_on_sigint() as request:
            os.kill(os.getpid(), signal.SIGINT)
            assert not request.requested
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.slow
def test_sigint_mid_record_stops_after_that_batch_and_writes_it(tmp_path, tiny_mlm_dir, tiny_corpus, monkeypatch,
                                                                capsys):
    real = record_module._record_batch
    done: list[int] = []

    def record_then_interrupt(job, recorder, batch, writers):
        result = real(job, recorder, batch, writers)
        done.append(len(batch.sequence_index))
        if len(done) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # arrives while the second batch is finishing
        return result

    monkeypatch.setattr(record_module, "_record_batch", record_then_interrupt)
    out = tmp_path / "run"
    code = main(["record", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--out", str(out),
                 "--max-length", "24", "--batch-size", "2"])
    assert code == 130
    assert "stopping after this batch" in capsys.readouterr().err
    meta = json.loads((out / "meta.json").read_text())
    assert meta["complete"] is False and meta["error"] == "interrupted (SIGINT)"
    assert meta["counts"]["batches"] == 2 == len(done)
    assert meta["counts"]["sequences_recorded"] == sum(done)
    assert pd.read_parquet(out / "sequences.parquet").sequence_index.nunique() == sum(done)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
