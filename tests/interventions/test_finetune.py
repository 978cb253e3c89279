"""Fine-tuning harness on a tiny BERT: encoding, metrics, class weights, learning, surgery options."""

from __future__ import annotations

import json
import math
import random
import re

import pandas as pd
import pytest
import torch

from conftest import SAMPLE_LINES
from gradflow import schema
from gradflow.errors import GradflowError
from gradflow.interventions.finetune import (
    FinetuneConfig,
    Task,
    TaskError,
    accuracy,
    class_weights,
    encode_tokens,
    entity_scores,
    finetune,
    label_counts,
    load_split,
    load_task,
    task_loss,
)
from gradflow.interventions.finetune.data import IGNORE

WORDS = sorted(set(" ".join(SAMPLE_LINES).lower().replace(".", "").split()))
FUNCTION_WORDS = {"the", "of", "and", "a", "by", "with", "that", "this"}
TOKEN_TASK = Task("toy-tags", "token", "entity_f1", ("O", "B-F", "I-F"))
SEQ_TASK = Task("toy-seq", "sequence", "accuracy", ("neg", "pos"))


def _token_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        tokens = rng.sample(WORDS, 8)
        rows.append({"tokens": tokens, "tags": ["B-F" if t in FUNCTION_WORDS else "O" for t in tokens]})
    return rows


def _seq_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"text": " ".join(rng.sample(WORDS, 5) + (["progress"] if i % 2 else [])), "label": "pos" if i % 2 else "neg"}
            for i in range(n)]


def _config(model_dir, **kw) -> FinetuneConfig:
    base = dict(model=str(model_dir), task="toy", lr=3e-3, steps=30, batch_size=16, eval_every=10, progress=False,
                max_length=32)
    return FinetuneConfig(**{**base, **kw})


def _splits(rows):
    return {"train": rows, "validation": rows[:16], "test": rows[16:32]}


# ---------------------------------------------------------------------------------------- metrics
def test_entity_f1_matches_hand_computation():
    gold = [["B-PROPN", "I-PROPN", "O", "B-PROPN"], ["O", "B-PROPN"]]
    # gold entities: (0-1) and (3) in row 0, (1) in row 1: 3 in all
    missed = [["B-PROPN", "I-PROPN", "O", "O"], ["O", "B-PROPN"]]  # 2 predicted, both right
    assert entity_scores(gold, missed) == pytest.approx({"precision": 1.0, "recall": 2 / 3, "entity_f1": 0.8})
    boundary = [["B-PROPN", "O", "O", "B-PROPN"], ["O", "B-PROPN"]]  # (0) has the wrong boundary: 2 of 3 right
    assert entity_scores(gold, boundary) == pytest.approx({"precision": 2 / 3, "recall": 2 / 3, "entity_f1": 2 / 3})
    assert accuracy(gold, boundary) == pytest.approx(5 / 6)
    assert accuracy(["a", "b", "b"], ["a", "b", "a"]) == pytest.approx(2 / 3)


# ---------------------------------------------------------------------------------------- encoding
def test_first_subword_is_labelled(tiny_mlm_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_mlm_dir)
    rows = [{"tokens": ["the", "unionstate", "credit"], "tags": ["B-F", "O", "I-F"]}]
    pieces = tok.tokenize("unionstate")
    assert len(pieces) > 1  # the made-up word splits into several sub-words
    (enc,) = encode_tokens(tok, rows, TOKEN_TASK.label2id, max_length=32)
    labelled = [(i, y) for i, y in enumerate(enc.labels) if y != IGNORE]
    assert [y for _, y in labelled] == [1, 0, 2]
    assert labelled[0][0] == 1 and labelled[1][0] == 2 and labelled[2][0] == 2 + len(pieces)  # after [CLS]
    assert enc.labels[0] == IGNORE and enc.labels[-1] == IGNORE and enc.words == (0, 1, 2)
    (short,) = encode_tokens(tok, rows, TOKEN_TASK.label2id, max_length=4)
    assert short.words == (0, 1) and short.num_words == 3  # the third word is cut off


# ---------------------------------------------------------------------------------------- class weights
def test_class_weights_change_the_loss_as_expected():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.5], [0.3, 0.2]])
    labels = torch.tensor([0, 1, 1, IGNORE])
    nll = -torch.log_softmax(logits, -1)[torch.arange(3), labels[:3]]
    assert float(task_loss(logits, labels)) == pytest.approx(float(nll.mean()), rel=1e-6)
    weights = torch.tensor([1.0, 3.0])
    expected = (1 * nll[0] + 3 * nll[1] + 3 * nll[2]) / (1 + 3 + 3)
    assert float(task_loss(logits, labels, weights)) == pytest.approx(float(expected), rel=1e-6)
    # class 1 is predicted worse than class 0 here, so up-weighting it raises the loss
    assert float(task_loss(logits, labels, weights)) > float(task_loss(logits, labels))


def test_balanced_weights():
    counts = torch.tensor([6, 2, 0])
    assert class_weights("balanced", counts).tolist() == pytest.approx([8 / 18, 8 / 6, 1.0])
    assert class_weights(None, counts) is None
    assert class_weights((1, 2, 3), counts).tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(TaskError):
        class_weights((1, 2), counts)
    with pytest.raises(TaskError):
        class_weights("inverse", counts)


def test_label_counts_count_first_subwords(tiny_mlm_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_mlm_dir)
    enc = encode_tokens(tok, [{"tokens": ["the", "unionstate"], "tags": ["B-F", "O"]}], TOKEN_TASK.label2id, 32)
    assert label_counts(enc, 3).tolist() == [1, 1, 0]


def test_weights_of_one_equal_no_weights(tiny_mlm_dir):
    rows = _token_rows(32)
    plain = finetune(_config(tiny_mlm_dir, steps=2, eval_every=2), task=TOKEN_TASK, data=_splits(rows))
    ones = finetune(_config(tiny_mlm_dir, steps=2, eval_every=2, class_weights=(1, 1, 1)), task=TOKEN_TASK,
                    data=_splits(rows))
    balanced = finetune(_config(tiny_mlm_dir, steps=2, eval_every=2, class_weights="balanced"), task=TOKEN_TASK,
                        data=_splits(rows))
    assert ones.train_loss == pytest.approx(plain.train_loss, rel=1e-6)
    assert balanced.train_loss[0] != pytest.approx(plain.train_loss[0], rel=1e-4)


# ---------------------------------------------------------------------------------------- training
@pytest.mark.slow
def test_token_task_loss_decreases(tiny_mlm_dir, tmp_path):
    result = finetune(_config(tiny_mlm_dir, out_dir=str(tmp_path / "run")), task=TOKEN_TASK, data=_splits(_token_rows(64)))
    first, last = sum(result.train_loss[:5]) / 5, sum(result.train_loss[-5:]) / 5
    assert last < 0.5 * first
    assert result.final["validation"]["entity_f1"] > 0.9
    frame = pd.read_csv(tmp_path / "run" / schema.EVAL_FILE)
    assert tuple(frame.columns) == schema.EVAL_COLUMNS
    assert sorted(frame.step.unique()) == [10, 20, 30]
    assert {"loss", "entity_f1", "precision", "recall", "accuracy"} <= set(frame[frame.split == "validation"].metric)
    saved = json.loads((tmp_path / "run" / schema.FINETUNE_RESULT_FILE).read_text())
    assert saved["final"]["test"]["entity_f1"] == pytest.approx(result.final["test"]["entity_f1"])


@pytest.mark.slow
def test_sequence_task_with_surgery_and_seeds(tiny_mlm_dir):
    rows = _seq_rows(64)
    result = finetune(_config(tiny_mlm_dir, drop_last=1), task=SEQ_TASK, data=_splits(rows))
    assert result.surgery[0]["operation"] == "drop_last_blocks"
    assert sum(result.train_loss[-5:]) < sum(result.train_loss[:5])
    again = finetune(_config(tiny_mlm_dir, drop_last=1), task=SEQ_TASK, data=_splits(rows))
    assert again.train_loss == result.train_loss  # same seed, same run
    other = finetune(_config(tiny_mlm_dir, drop_last=1, seed=1, steps=2), task=SEQ_TASK, data=_splits(rows))
    assert other.train_loss[0] != result.train_loss[0]


@pytest.mark.slow
def test_float16_checkpoint_trains_in_float32(tiny_mlm_dir, tmp_path):
    """The embedded models ship float16: fine-tuning must keep float32 master weights."""
    import shutil

    from transformers import AutoModelForMaskedLM

    half = tmp_path / "half"
    shutil.copytree(tiny_mlm_dir, half)
    AutoModelForMaskedLM.from_pretrained(tiny_mlm_dir).half().save_pretrained(half)
    from gradflow.interventions.finetune.train import load_task_model

    model, _, _ = load_task_model(str(half), TOKEN_TASK, seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    result = finetune(_config(half, steps=4, eval_every=4), task=TOKEN_TASK, data=_splits(_token_rows(32)))
    assert all(math.isfinite(v) for v in result.train_loss)


@pytest.mark.slow
def test_bfloat16_autocast_matches_float32_closely(tiny_mlm_dir):
    rows = _splits(_token_rows(48))
    exact = finetune(_config(tiny_mlm_dir, steps=20), task=TOKEN_TASK, data=rows)
    mixed = finetune(_config(tiny_mlm_dir, steps=20, autocast="bfloat16"), task=TOKEN_TASK, data=rows)
    assert mixed.train_loss != exact.train_loss  # the option does change the arithmetic
    assert mixed.train_loss[0] == pytest.approx(exact.train_loss[0], rel=0.02)
    assert sum(mixed.train_loss[-5:]) < 0.6 * sum(mixed.train_loss[:5])  # and still learns
    with pytest.raises(GradflowError, match="autocast"):
        _config(tiny_mlm_dir, autocast="float16")


def test_head_only_trains_new_parameters_only(tiny_mlm_dir):
    result = finetune(_config(tiny_mlm_dir, steps=2, head_only=True), task=SEQ_TASK, data=_splits(_seq_rows(32)))
    hidden, labels = 32, 2
    assert result.trainable_parameters == (hidden * hidden + hidden) + (hidden * labels + labels)  # pooler + classifier
    with pytest.raises(GradflowError, match="head_only"):
        _config(tiny_mlm_dir, head_only=True, reinit_last=1)


def test_reinit_option_runs(tiny_mlm_dir):
    result = finetune(_config(tiny_mlm_dir, steps=2, reinit_last=1), task=TOKEN_TASK, data=_splits(_token_rows(32)))
    assert result.surgery[0]["operation"] == "reinit_last_blocks" and result.surgery[0]["seed"] == 0


def test_truncated_words_get_the_fallback_label(tiny_mlm_dir):
    rows = _token_rows(32)
    result = finetune(_config(tiny_mlm_dir, steps=1, max_length=6), task=TOKEN_TASK, data=_splits(rows))
    assert result.final["validation"]["dropped_words"] > 0


# ---------------------------------------------------------------------------------------- task files
@pytest.mark.slow
def test_task_directory(tmp_path, tiny_mlm_dir):
    task_dir = tmp_path / "toy"
    task_dir.mkdir()
    (task_dir / "task.json").write_text(json.dumps({"name": "toy", "kind": "sequence", "metric": "accuracy",
                                                    "labels": ["neg", "pos"]}))
    rows = _seq_rows(40)
    for split, part in _splits(rows).items():
        (task_dir / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    task = load_task("toy", tmp_path)
    assert task.kind == "sequence" and task.labels == ("neg", "pos")
    assert load_task(task_dir) == task
    assert load_split(task, "test") == rows[16:32]
    result = finetune(_config(tiny_mlm_dir, task=str(task_dir), steps=2, train_limit=20, eval_limit=8))
    assert result.task == "toy"
    with pytest.raises(TaskError, match=f"gradflow tasks fetch --out {re.escape(str(tmp_path))}`"):
        load_task("brown-pos", tmp_path)
    (task_dir / "validation.jsonl").write_text(json.dumps({"text": "x", "label": "maybe"}) + "\n")
    with pytest.raises(TaskError, match="row 0"):
        load_split(task, "validation")


def test_builtin_task_files_when_fetched():
    """The fetched tasks (git-ignored data/tasks) parse and fit their task.json; skipped when absent."""
    from gradflow.inputs.tasks import BUILTIN_TASKS, default_data_root

    root = default_data_root()
    if not (root / "brown-pos" / "task.json").exists():
        pytest.skip("run `gradflow tasks fetch` to build the task data")
    for name in BUILTIN_TASKS:
        task = load_task(name, root)
        rows = load_split(task, "validation")
        assert len(rows) > 500 and task.name == name


def test_test_limit_samples_only_the_splits_scored_at_the_end():
    from gradflow.interventions.finetune.train import _task_and_data

    rows = _seq_rows(40)
    data = {"train": rows, "validation": rows[:20], "test": rows[20:40]}
    task = Task("toy", "sequence", "accuracy", ("neg", "pos"))
    _, sampled = _task_and_data(_config("unused", eval_limit=8, test_limit=5), task, data)
    assert (len(sampled["train"]), len(sampled["validation"]), len(sampled["test"])) == (40, 8, 5)
    _, sampled = _task_and_data(_config("unused", eval_limit=8), task, data)
    assert len(sampled["test"]) == 8  # test_limit defaults to eval_limit
    assert set(map(str, sampled["test"])) <= set(map(str, data["test"]))
