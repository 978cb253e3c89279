"""continue_mlm: the MLM loss falls, the model saves and reloads, the callback CSV shows the last block."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from conftest import SAMPLE_LINES, build_tiny_mlm_dir
from gradflow import schema
from gradflow.errors import GradflowError
from gradflow.interventions.finetune import FinetuneConfig, Task, continue_mlm, finetune
from gradflow.roles import LOSS_ROLES

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

LAYERS = 2
STEPS = 30
EVERY = 10


@pytest.fixture(scope="module")
def continued(tmp_path_factory):
    base = build_tiny_mlm_dir(tmp_path_factory.mktemp("base"), layers=LAYERS)
    out = tmp_path_factory.mktemp("continued")
    texts = SAMPLE_LINES[:2] * 20  # repetitive toy text: quickly learnable
    model_dir = continue_mlm(str(base), texts, out, steps=STEPS, batch_size=8, lr=3e-3, seed=0, log_every=EVERY,
                             max_length=32)
    return base, out, model_dir


def test_mlm_loss_goes_down(continued):
    _, out, _ = continued
    log = pd.read_csv(out / schema.MLM_LOG_FILE)
    assert tuple(log.columns) == schema.MLM_LOG_COLUMNS
    assert list(log.step) == list(range(1, STEPS + 1))
    first, last = log.loss.head(5).mean(), log.loss.tail(5).mean()
    assert last < first - 0.5, (first, last)
    meta = json.loads((out / schema.CONTINUED_META_FILE).read_text())
    assert meta["steps"] == STEPS and meta["texts"] == 40


def test_saved_model_reloads_float32_and_changed(continued):
    from transformers import AutoTokenizer, BertForMaskedLM

    base, _, model_dir = continued
    assert model_dir.name == "model" and (model_dir / "config.json").exists()
    trained = BertForMaskedLM.from_pretrained(model_dir)
    original = BertForMaskedLM.from_pretrained(base)
    assert all(p.dtype == torch.float32 for p in trained.parameters())
    changed = [n for (n, p), q in zip(trained.named_parameters(), original.parameters()) if not torch.equal(p, q)]
    assert any(".layer.1." in n for n in changed) and any("embeddings" in n for n in changed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.mask_token_id is not None
    # the trained model predicts the repeated text better than the one it started from
    batch = tokenizer(SAMPLE_LINES[:2], return_tensors="pt", padding=True)
    labels = batch["input_ids"].clone()
    inputs = batch["input_ids"].clone()
    inputs[:, 3] = tokenizer.mask_token_id
    labels[:, [i for i in range(labels.shape[1]) if i != 3]] = -100
    with torch.no_grad():
        losses = [float(m.eval()(input_ids=inputs, attention_mask=batch["attention_mask"], labels=labels).loss)
                  for m in (original, trained)]
    assert losses[1] < losses[0]


def test_callback_csv_last_block(continued):
    _, out, _ = continued
    frame = pd.read_csv(out / schema.CALLBACK_FILE)
    assert tuple(frame.columns) == schema.CALLBACK_COLUMNS
    assert sorted(frame.step.unique()) == [1] + list(range(EVERY, STEPS + 1, EVERY))
    last = f"blocks.{LAYERS - 1}"
    hidden = frame[frame.quantity == "hidden_grad_mean"]
    weight = frame[frame.quantity == "grad_norm"]
    # after the last block nothing mixes positions: context outputs get exactly zero loss gradient ...
    ctx_out = hidden[(hidden.group == last) & (hidden.role == "context")]
    assert len(ctx_out) == frame.step.nunique() and (ctx_out.value == 0.0).all()
    # ... while the loss positions and, below the last block, the context outputs do get some
    assert (hidden[(hidden.group == last) & hidden.role.isin(LOSS_ROLES)].value > 0).all()
    assert (hidden[(hidden.group == "blocks.0") & (hidden.role == "context")].value > 0).all()
    loss_rows = weight[weight.role.isin(LOSS_ROLES)]
    assert set(loss_rows.group) == {f"blocks.{i}" for i in range(LAYERS)}
    assert (loss_rows[loss_rows.role == "masked"].value > 0).all()
    # the last block's context weight-gradient rows are not zero: its keys and values are read by the
    # loss positions' queries (only attn.q, attn.out, the FFN and the norms get exactly zero from context)
    assert (weight[(weight.group == last) & (weight.role == "context")].value > 0).all()


def test_finetune_loads_the_continued_model(continued):
    _, _, model_dir = continued
    task = Task("toy-seq", "sequence", "accuracy", ("neg", "pos"))
    rows = [{"text": line, "label": ("neg", "pos")[i % 2]} for i, line in enumerate(SAMPLE_LINES * 4)]
    result = finetune(FinetuneConfig(model=str(model_dir), task="toy", steps=2, batch_size=4, eval_every=2,
                                     head_only=True, progress=False, max_length=32),
                      task=task, data={"train": rows, "validation": rows[:4], "test": rows[4:8]})
    assert result.trainable_parameters < result.total_parameters
    assert set(result.final) == {"validation", "test"}


def test_rejects_empty_texts(tmp_path):
    with pytest.raises(GradflowError, match="no non-empty texts"):
        continue_mlm("unused", ["", "  "], tmp_path, steps=1, batch_size=1, lr=1e-3, seed=0)
