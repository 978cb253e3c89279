"""`gradflow record` end to end on a tiny model: tables, determinism, exact zeros, bad input, faults."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from gradflow.cli import main
from gradflow.progress import LOG_INTERVAL_S
from gradflow.schema import CHANNEL_COLUMNS, SUBLAYER_COLUMNS

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}


def _record(tmp: Path, model: Path, texts: Path, name: str = "run", *extra: str) -> tuple[int, Path]:
    out = tmp / name
    code = main(["record", "--model", str(model), "--texts", str(texts), "--out", str(out), "--max-length", "24",
                 "--batch-size", "4", "--quiet", *extra])
    return code, out


def test_tables_columns_and_exact_zero(tmp_path, tiny_mlm_dir, tiny_corpus):
    code, out = _record(tmp_path, tiny_mlm_dir, tiny_corpus)
    assert code == 0
    channels = pd.read_csv(out / "channels.csv")
    sublayers = pd.read_csv(out / "sublayers.csv")
    sequences = pd.read_parquet(out / "sequences.parquet")
    meta = json.loads((out / "meta.json").read_text())
    assert tuple(channels.columns) == CHANNEL_COLUMNS and tuple(sublayers.columns) == SUBLAYER_COLUMNS
    assert meta["complete"] is True and meta["num_layers"] == 2 and meta["seed"] == 0
    assert {"python", "torch", "transformers", "gradflow"} <= set(meta["versions"])
    assert meta["command"].startswith("gradflow record")
    last = meta["num_layers"]
    ctx = channels[(channels.role == "context") & (channels.point == "out")].set_index("layer")
    assert ctx.loc[last, "grad_norm_mean"] == 0.0 and ctx.loc[last, "grad_norm_zero_fraction"] == 1.0
    assert (ctx.loc[: last - 1, "grad_norm_mean"] > 0).all()
    sub = sublayers[(sublayers.layer == last) & (sublayers.role == "context") & (sublayers.param == "weight")]
    shares = sub.set_index("sublayer").share
    for name in ("attn.q", "attn.out", "ffn.in", "ffn.out"):
        assert shares[name] == 0.0
    assert shares["attn.k"] > 0 and shares["attn.v"] > 0
    sums = sublayers.groupby(["layer", "sublayer", "param"]).share.sum()
    assert ((sums - 1).abs() < 1e-6).all()
    # per-sequence rows add up to the channel counts
    per = sequences.groupby(["site", "role"]).n_positions.sum()
    merged = channels.set_index(["site", "role"]).n_positions
    assert per.sort_index().equals(merged.sort_index())
    assert meta["counts"]["windows"] == sequences.sequence_index.nunique()


def test_same_seed_byte_identical_tables(tmp_path, tiny_mlm_dir, tiny_corpus):
    _, a = _record(tmp_path, tiny_mlm_dir, tiny_corpus, "a")
    _, b = _record(tmp_path, tiny_mlm_dir, tiny_corpus, "b")
    _, c = _record(tmp_path, tiny_mlm_dir, tiny_corpus, "c", "--seed", "1")
    for name in ("channels.csv", "sublayers.csv"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "channels.csv").read_bytes() != (c / "channels.csv").read_bytes()


def test_long_documents_are_windowed_not_dropped(tmp_path, tiny_mlm_dir):
    texts = tmp_path / "long.txt"
    texts.write_text(" ".join(["the treasury of the union"] * 40) + "\nthe nation\n", encoding="utf-8")
    code, out = _record(tmp_path, tiny_mlm_dir, texts)
    meta = json.loads((out / "meta.json").read_text())
    assert code == 0 and meta["counts"]["documents"] == 2
    assert meta["counts"]["windows"] >= 10 and meta["counts"]["split_documents"] == 1


def test_jsonl_directory_and_limit(tmp_path, tiny_mlm_dir):
    jl = tmp_path / "c.jsonl"
    jl.write_text('{"text": "the nation and the union"}\n{"text": "the treasury"}\n', encoding="utf-8")
    d = tmp_path / "dir"
    d.mkdir()
    (d / "a.txt").write_text("the nation\n", encoding="utf-8")
    (d / "b.txt").write_text("the union\nthe treasury\n", encoding="utf-8")
    for texts, n in ((jl, 2), (d, 3)):
        code, out = _record(tmp_path, tiny_mlm_dir, texts, f"r_{texts.name}")
        assert code == 0 and json.loads((out / "meta.json").read_text())["counts"]["windows"] == n
    code, out = _record(tmp_path, tiny_mlm_dir, d, "limited", "--limit", "2")
    assert json.loads((out / "meta.json").read_text())["counts"]["sequences_recorded"] == 2


def _bad(tmp_path, capsys, args, match):
    code = main(["record", "--quiet", "--max-length", "24", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert match in err and "Traceback" not in err
    return err


def test_bad_inputs_exit_2_with_clear_message(tmp_path, capsys, tiny_mlm_dir, tiny_corpus):
    out = tmp_path / "out"
    _bad(tmp_path, capsys, ["--model", str(tmp_path / "nope"), "--texts", str(tiny_corpus), "--out", str(out)],
         "does not exist")
    _bad(tmp_path, capsys, ["--model", str(tiny_mlm_dir), "--texts", str(tmp_path / "missing.txt"), "--out", str(out)],
         "does not exist")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    _bad(tmp_path, capsys, ["--model", str(tiny_mlm_dir), "--texts", str(empty), "--out", str(out)], "empty")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("the nation\ncaf\xe9 au lait\n".encode("latin-1"))
    err = _bad(tmp_path, capsys, ["--model", str(tiny_mlm_dir), "--texts", str(latin), "--out", str(out)], "UTF-8")
    assert "latin.txt, line 2" in err
    specials = tmp_path / "specials.txt"
    specials.write_text("\u200b\u200b\n\u200b\n", encoding="utf-8")
    _bad(tmp_path, capsys, ["--model", str(tiny_mlm_dir), "--texts", str(specials), "--out", str(out)], "can be masked")
    assert not out.exists() or not any(out.iterdir())  # nothing half-written is left behind
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("keep me")
    _bad(tmp_path, capsys, ["--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--out", str(full)],
         "--overwrite")
    assert (full / "x").read_text() == "keep me"


def test_unsupported_architecture_and_missing_head(tmp_path, capsys, tiny_corpus):
    import torch
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    from conftest import build_tiny_mlm_dir

    bare = build_tiny_mlm_dir(tmp_path / "bare")
    config = BertConfig.from_pretrained(bare)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(bare)  # overwrite the weights with a head-less encoder
    (bare / "model.safetensors").exists()
    err = _bad(tmp_path, capsys, ["--model", str(bare), "--texts", str(tiny_corpus), "--out", str(tmp_path / "o1")],
               "no masked-LM head")
    assert "ForMaskedLM" in err
    gpt = tmp_path / "gpt"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).save_pretrained(gpt)
    err = _bad(tmp_path, capsys, ["--model", str(gpt), "--texts", str(tiny_corpus), "--out", str(tmp_path / "o2")],
               "no adapter for model_type 'gpt2'")
    assert "register_adapter" in err


def test_nonfinite_batches_are_counted_not_averaged(tmp_path, tiny_mlm_dir, tiny_corpus, monkeypatch):
    import gradflow.runs.record as run_module

    calls = {"n": 0}
    real = run_module.record_is_finite

    def flaky(record):
        calls["n"] += 1
        return False if calls["n"] == 2 else real(record)

    monkeypatch.setattr(run_module, "record_is_finite", flaky)
    code, out = _record(tmp_path, tiny_mlm_dir, tiny_corpus)
    meta = json.loads((out / "meta.json").read_text())
    assert code == 0 and meta["counts"]["skipped"]["nonfinite_batches"] == 1
    assert meta["counts"]["sequences_recorded"] == meta["counts"]["windows"] - 4


def test_crash_mid_run_flushes_partial_results(tmp_path, tiny_mlm_dir, tiny_corpus, monkeypatch):
    import gradflow.runs.record_tables as run_module  # where the per-sequence rows are made

    calls = {"n": 0}
    real = run_module.sequence_rows

    def crash_on_third(record):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(record)

    monkeypatch.setattr(run_module, "sequence_rows", crash_on_third)
    code, out = _record(tmp_path, tiny_mlm_dir, tiny_corpus)
    assert code == 130
    meta = json.loads((out / "meta.json").read_text())
    assert meta["complete"] is False and "interrupted" in meta["error"]
    assert meta["counts"]["sequences_recorded"] == 8
    assert len(pd.read_csv(out / "channels.csv")) > 0
    assert pd.read_parquet(out / "sequences.parquet").sequence_index.nunique() == 8


@pytest.mark.slow
def test_sigint_subprocess_leaves_loadable_partial_run(tmp_path, tiny_mlm_dir):
    import pty
    import re
    import threading

    texts = tmp_path / "big.txt"
    texts.write_text("\n".join(["the treasury of the union and the nation"] * 40000) + "\n", encoding="utf-8")
    out = tmp_path / "sig"
    # stderr is a pseudo-terminal, as for a user at a shell: the bar redraws every 0.1 s (into a pipe it would
    # draw once in 30 s, and the test would wait that long for the first count)
    # opened without a size (0 x 0, as `docker run -t` from a script gives): the bar falls back to 80 x 24
    parent_fd, child_fd = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "gradflow", "record", "--model", str(tiny_mlm_dir), "--texts",
                             str(texts), "--out", str(out), "--max-length", "24"],
                            env=ENV, stderr=child_fd, text=True,
                            # a shell's background job ignores SIGINT and children inherit that (then
                            # Python installs no KeyboardInterrupt handler): give the child the default
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(child_fd)

    # interrupt once the progress bar shows recorded sequences (not after a fixed delay: a loaded
    # machine may take seconds for the first batch)
    stderr: list[str] = []
    started = threading.Event()

    def read() -> None:
        while True:
            try:
                chunk = os.read(parent_fd, 1024).decode(errors="replace")
            except OSError:  # EIO: the child has closed the terminal
                return
            if not chunk:
                return
            stderr.append(chunk)
            if re.search(r"recording: [1-9]\d*seq", "".join(stderr)[-400:]):
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(timeout=600), "recording never started: " + "".join(stderr)[-2000:]
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=600)
        reader.join(timeout=60)
    finally:
        proc.kill()
        os.close(parent_fd)
    err = "".join(stderr)
    assert proc.returncode == 130, err
    meta = json.loads((out / "meta.json").read_text())
    assert meta["complete"] is False
    assert 0 < meta["counts"]["sequences_recorded"] < 40000
    assert len(pd.read_parquet(out / "sequences.parquet")) > 0


def test_progress_into_a_log_file_is_a_few_lines_not_one_per_batch(tmp_path, tiny_mlm_dir, tiny_corpus, capsys):
    # stderr is not a terminal under capsys, as in a cluster job's log: the bar may draw at start and end only
    out = tmp_path / "run"
    started = time.monotonic()
    assert main(["record", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--out", str(out),
                 "--max-length", "24", "--batch-size", "1"]) == 0
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    batches = json.loads((out / "meta.json").read_text())["counts"]["batches"]
    assert batches >= 4, "the corpus must give several batches for this test to mean anything"
    # start, end, and at most one line per LOG_INTERVAL_S of the run: a loaded machine makes the run slow,
    # not the log long
    allowed = 3 + int(elapsed // LOG_INTERVAL_S)
    assert 1 <= err.count("recording:") <= min(allowed, batches), err
