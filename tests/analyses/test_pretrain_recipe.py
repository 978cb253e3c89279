"""The resumable pretraining recipe (analyses/pretraining/recipe, pretrain_base.py): bit-identical resume.

Tiny config (2 layers, hidden 32, 32 positions, vocab from a synthetic corpus), CPU float32, one thread.
"""

from __future__ import annotations

import csv
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from analyses.pretraining import pretrain_base
from analyses.pretraining.recipe.checkpoint import load_checkpoint
from analyses.pretraining.recipe.train import CURVE_VALUE_FIELDS, EXIT_CONFIG, EXIT_DONE, EXIT_STOPPED

REPO = Path(__file__).resolve().parents[2]

STEPS = 24
# eval every 6 steps, checkpoint every 5: the stop points below fall between both
COMMON = ["--arch", "tiny", "--vocab-size", "256", "--steps", str(STEPS), "--warmup", "3", "--batch-size", "4",
          "--lr", "3e-3", "--eval-every", "6", "--checkpoint-every", "5", "--log-every", "1", "--valid-windows", "16",
          "--threads", "1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train.txt / valid.txt of random 'words' over a 150-word vocabulary, one document per line."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnoprstuw") for _ in range(rng.randint(2, 7))) for _ in range(150)]
    for split, n_docs in (("train", 60), ("valid", 10)):
        docs = [" ".join(rng.choice(words) for _ in range(rng.randint(30, 120))) for _ in range(n_docs)]
        (root / f"{split}.txt").write_text("\n".join(docs) + "\n")
    return root


def cli(corpus: Path, out: Path, *extra: str) -> int:
    """pretrain_base.py in-process, with the tokenizer shared by all runs; returns its exit code."""
    return pretrain_base.main(["--corpus", str(corpus), "--out", str(out), "--tokenizer", str(corpus / "tokenizer"),
                               *COMMON, *extra])


@pytest.fixture(scope="module")
def straight(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of STEPS steps in one command."""
    out = tmp_path_factory.mktemp("straight")
    assert cli(corpus, out) == EXIT_DONE
    return out


def curve(out: Path) -> list[dict[str, str]]:
    with open(out / "training_log.csv") as fh:
        return [{k: row[k] for k in CURVE_VALUE_FIELDS} for row in csv.DictReader(fh)]


def assert_same_run(a: Path, b: Path) -> None:
    """Bitwise-equal final weights (every tensor) and equal loss curves (every value column)."""
    wa, wb = load_checkpoint(a)["model"], load_checkpoint(b)["model"]
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    ca, cb = curve(a), curve(b)
    assert len(ca) == STEPS and ca == cb


def test_straight_run_writes_outputs(straight: Path) -> None:
    rows = curve(straight)
    assert [r["step"] for r in rows] == [str(s) for s in range(1, STEPS + 1)]
    assert rows[5]["valid_top1"] != "" and rows[4]["valid_top1"] == ""
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])
    assert (straight / "meta.json").exists() and (straight / "model" / "config.json").exists()
    assert load_checkpoint(straight)["step"] == STEPS


def test_half_stop_resume_is_bit_identical(corpus: Path, straight: Path, tmp_path: Path) -> None:
    assert cli(corpus, tmp_path, "--stop-after", str(STEPS // 2)) == EXIT_STOPPED
    assert load_checkpoint(tmp_path)["step"] == STEPS // 2
    assert cli(corpus, tmp_path) == EXIT_DONE
    assert_same_run(straight, tmp_path)
    segments = json.loads((tmp_path / "meta.json").read_text())["segments"]  # each command's steps, wall and CPU
    assert [(s["start_step"], s["end_step"]) for s in segments] == [(0, STEPS // 2), (STEPS // 2, STEPS)]
    assert all(s["wall_s"] > 0 and s["cpu_s"] > 0 for s in segments)


@pytest.mark.slow
def test_sigterm_mid_run_then_resume(corpus: Path, straight: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "analyses.pretraining.pretrain_base", "--corpus", str(corpus), "--out", str(tmp_path),
           "--tokenizer", str(corpus / "tokenizer"), *COMMON, "--throttle-s", "0.2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    lines = []
    deadline = time.monotonic() + 120
    for line in proc.stdout:  # wait until a few steps are logged
        lines.append(line)
        if line.startswith("step 3 "):
            proc.send_signal(signal.SIGTERM)
            break
        assert time.monotonic() < deadline, "".join(lines)
    rest, _ = proc.communicate(timeout=60)
    log = "".join(lines) + rest
    assert proc.returncode == EXIT_STOPPED, log
    assert "received SIGTERM" in log and "Rerun the same command to resume" in log
    stopped_at = load_checkpoint(tmp_path)["step"]
    assert 3 <= stopped_at < STEPS, log
    assert cli(corpus, tmp_path) == EXIT_DONE
    assert_same_run(straight, tmp_path)


def test_max_minutes_stops_with_checkpoint_and_rerun_resumes(corpus: Path, straight: Path, tmp_path: Path) -> None:
    steps_seen = []
    for _ in range(3):  # each command stops after its first step: the limit is already spent
        assert cli(corpus, tmp_path, "--max-minutes", "0.00001") == EXIT_STOPPED
        steps_seen.append(load_checkpoint(tmp_path)["step"])
    assert steps_seen == [1, 2, 3]
    assert cli(corpus, tmp_path, "--max-minutes", "60") == EXIT_DONE
    assert_same_run(straight, tmp_path)


def test_changed_config_is_refused(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(corpus, tmp_path, "--stop-after", "2") == EXIT_STOPPED
    assert cli(corpus, tmp_path, "--lr", "1e-3") == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "different config" in err and "lr: 0.003 -> 0.001" in err and "new --out" in err
    assert load_checkpoint(tmp_path)["step"] == 2  # untouched
    # runtime fields may change between commands
    assert cli(corpus, tmp_path, "--stop-after", "4", "--checkpoint-every", "7", "--eval-every", "2") == EXIT_STOPPED


def test_checkpoint_loads_with_weights_only(straight: Path) -> None:
    payload = torch.load(straight / "checkpoint.pt", weights_only=True)
    assert {"model", "optimizer", "scheduler", "rng", "curve", "data_position", "config", "step"} <= payload.keys()
    assert payload["data_position"]["next_step"] == STEPS
    assert set(payload["rng"]) == {"python", "numpy", "torch", "cuda"}


def test_missing_corpus_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert pretrain_base.main(["--out", str(tmp_path / "run"), "--corpus", str(tmp_path / "none")]) == EXIT_CONFIG
    assert "train.txt" in capsys.readouterr().err


def test_windows_match_pretrain_py(straight: Path, corpus: Path) -> None:
    """The batched window encoder gives pretrain.py's windows."""
    from analyses.pretraining.pretrain import windows
    from analyses.pretraining.recipe.data import encode_windows
    from transformers import BertTokenizerFast

    tok = BertTokenizerFast.from_pretrained(corpus / "tokenizer")
    ours = encode_windows(tok, corpus / "valid.txt", 32)
    assert torch.equal(torch.from_numpy(ours).long(), windows(tok, corpus / "valid.txt", 32))


def test_pretrain_py_sparse_loss_is_the_dense_loss() -> None:
    """pretrain.py --sparse: the same loss and gradients as its dense head-gathering loss (float32, no cut)."""
    from analyses.pretraining.pretrain import mlm_loss, sparse_loss
    from transformers import RoFormerConfig, RoFormerForMaskedLM

    torch.manual_seed(0)
    model = RoFormerForMaskedLM(RoFormerConfig(vocab_size=64, hidden_size=32, embedding_size=32, num_hidden_layers=2,
                                               num_attention_heads=2, intermediate_size=48, max_position_embeddings=32))
    model.eval()  # no dropout: both losses see the same computation
    ids = torch.randint(5, 64, (3, 20))
    attention = torch.ones_like(ids)
    attention[2, 15:] = 0
    labels = torch.full_like(ids, -100)
    labels[:, [2, 7]] = ids[:, [2, 7]]
    labels[1, 11] = ids[1, 11]
    dense, _, _ = mlm_loss(model, ids, labels, attention, ids.numel())
    sparse = sparse_loss(model, ids, labels, attention)
    assert abs(sparse.item() - dense.item()) <= 1e-5 * dense.item()
    params = [p for p in model.parameters() if p.requires_grad]
    for g_dense, g_sparse in zip(torch.autograd.grad(dense, params), torch.autograd.grad(sparse, params)):
        assert float((g_sparse - g_dense).norm()) <= 1e-5 * float(g_dense.norm()) + 1e-9


def test_pretrain_py_sparse_trains_and_refuses_alltoken(corpus: Path, tmp_path: Path) -> None:
    from analyses.pretraining import pretrain

    out = tmp_path / "run"
    pretrain.main(["--corpus", str(corpus), "--tokenizer", str(tmp_path / "tok"), "--out", str(out), "--vocab-size",
                   "256", "--steps", "2", "--warmup", "1", "--batch-size", "2", "--valid-windows", "4", "--sparse"])
    with open(out / "training_log.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["step"] for r in rows] == ["1", "2"] and all(float(r["train_loss"]) > 0 for r in rows)
    with pytest.raises(SystemExit):
        pretrain.main(["--out", str(out), "--loss", "alltoken", "--sparse"])
