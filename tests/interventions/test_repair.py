"""gradflow repair: only the last block (and optionally the head's transform) trains, under the all-positions loss."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import build_tiny_mlm_dir
from gradflow.cli import main
from gradflow.interventions.repair import META_NAME, RepairConfig, repair
from gradflow.provenance import content_hash

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

LAST = ".layer.1."  # the tiny BERT has 2 blocks


def _corpus(path):
    from conftest import SAMPLE_LINES

    lines = [" ".join(SAMPLE_LINES[i % 4] for i in range(k, k + 1 + k % 3)) for k in range(24)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _untied(path):
    from transformers import BertForMaskedLM

    model = BertForMaskedLM.from_pretrained(path)
    model.config.tie_word_embeddings = False
    torch.manual_seed(1)
    untied = BertForMaskedLM(model.config)
    untied.load_state_dict(model.state_dict())
    untied.save_pretrained(path)
    return path


def _run(tmp, base, texts, **kwargs):
    options = {"steps": 6, "batch_size": 4, "max_length": 32, "lr": 1e-2, "warmup": 0.0, "log_every": 3, "eval_windows": 4}
    config = RepairConfig(model=str(base), out_dir=str(tmp / "out"), texts=str(texts), **{**options, **kwargs})
    return repair(config)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("repair")
    tied = build_tiny_mlm_dir(root / "tied")
    untied = _untied(build_tiny_mlm_dir(root / "untied"))
    return root, tied, untied, _corpus(root / "corpus.txt")


@pytest.fixture(scope="module")
def tied_head(setup):
    root, tied, _, texts = setup
    return tied, _run(root / "tied_run", tied, texts, train_head=True)


@pytest.fixture(scope="module")
def untied_plain(setup):
    root, _, untied, texts = setup
    return untied, _run(root / "untied_run", untied, texts)


def _compare(base, model):
    from transformers import BertForMaskedLM

    original = dict(BertForMaskedLM.from_pretrained(base).named_parameters())
    return {n: torch.equal(p, original[n]) for n, p in model.named_parameters()}


def test_only_last_block_changes(untied_plain):
    base, result = untied_plain
    same = _compare(base, result.model)
    assert any(".decoder.weight" in n for n in same)  # untied: a separate decoder matrix exists
    outside = [n for n, eq in same.items() if LAST not in n and not eq]
    assert outside == []
    assert any(not eq for n, eq in same.items() if LAST in n)
    meta = result.meta
    assert not meta["tied_embeddings"] and all(LAST in n for n in meta["trained_parameters"])
    assert meta["trained_parameter_count"] == sum(p.numel() for n, p in result.model.named_parameters() if LAST in n)


def test_tied_head_trains_transform_and_bias_only(tied_head):
    base, result = tied_head
    same = _compare(base, result.model)
    changed = {n for n, eq in same.items() if not eq}
    assert all(LAST in n or n.startswith("cls.predictions.transform.") or n == "cls.predictions.bias"
               for n in changed), changed
    assert any(LAST in n for n in changed) and any("transform" in n for n in changed)
    assert same["bert.embeddings.word_embeddings.weight"]
    assert result.model.cls.predictions.decoder.weight is result.model.bert.embeddings.word_embeddings.weight
    meta = result.meta
    assert meta["tied_embeddings"] and "frozen" in meta["embeddings_note"]
    assert not any("embeddings" in n or "decoder.weight" in n for n in meta["trained_parameters"])


def test_checkpoint_reloads_with_same_logits(tied_head):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    _, result = tied_head
    reloaded = AutoModelForMaskedLM.from_pretrained(result.model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(result.model_dir)
    batch = tokenizer(["the cat sat on the mat", "a dog"], return_tensors="pt", padding=True)
    with torch.no_grad():
        assert torch.equal(reloaded(**batch).logits, result.model.eval()(**batch).logits)
    meta = json.loads((result.model_dir.parent / META_NAME).read_text())
    for key in ("model", "steps", "lr", "batch_size", "seed", "trained_parameter_count", "texts", "versions",
                "command", "top1_before", "top1_after"):
        assert key in meta
    tied, _ = tied_head  # inputs outside the repository are recorded as given, identified by their content hash
    assert meta["model"] == str(tied) and meta["inputs_sha256"]["model"].startswith("sha256:")
    assert meta["inputs_sha256"]["texts"] == content_hash(meta["texts"])


def test_context_share_positive_under_repair_and_zero_under_mlm(setup, untied_plain):
    _, result = untied_plain
    shares = result.meta["context_share"]
    assert [s["step"] for s in shares] == [1, 3, 6]
    assert all(s["hidden"] > 0 and s["weight"] > 0 for s in shares)
    root, _, untied, texts = setup
    mlm = _run(root / "mlm_run", untied, texts, objective="mlm", steps=1)
    assert [s["hidden"] for s in mlm.meta["context_share"]] == [0.0]


@pytest.mark.parametrize("extra, needle", [
    (["--model", "MODEL", "--steps", "0"], "--steps"),
    (["--model", "/no/such/model/dir"], "/no/such/model/dir"),
])
def test_cli_bad_input_exits_2(setup, tmp_path, capsys, extra, needle):
    _, tied, _, texts = setup
    argv = ["repair", "--out", str(tmp_path / "o"), "--texts", str(texts)] + [str(tied) if a == "MODEL" else a
                                                                           for a in extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gradflow: error:") and needle in err and "Traceback" not in err
    assert len(err.splitlines()) == 1


def test_cli_runs(setup, tmp_path, capsys):
    _, tied, _, texts = setup
    argv = ["repair", "--model", str(tied), "--out", str(tmp_path / "o"), "--texts", str(texts), "--steps", "2",
            "--batch-size", "2", "--max-length", "32", "--eval-windows", "2", "--log-every", "1"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["trained_parameter_count"] > 0 and summary["context_share"]["hidden"] > 0
    meta = json.loads((tmp_path / "o" / META_NAME).read_text())
    assert meta["command"].startswith("gradflow repair")
