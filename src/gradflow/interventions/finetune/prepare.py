"""The encoder a fine-tuning run starts from: the checkpoint as given, or one prepared under ``out_dir``.

With ``FinetuneConfig.extend_vocabulary`` (words) and/or ``continue_mlm_steps`` (> 0), the masked
LM is first prepared and saved, and the run fine-tunes that checkpoint:

- ``<out_dir>/encoder/continued/`` (``continue_mlm_steps`` > 0): the vocabulary extended (if
  words are given), then continued MLM on the training split's text
  (:func:`gradflow.interventions.finetune.continue_mlm`, which logs ``gradflow_callback.csv`` and,
  with new words, ``new_rows.csv``: where the new rows get their gradient);
- ``<out_dir>/encoder/extended/`` (words only): the extended checkpoint and ``vocabulary.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from gradflow.errors import GradflowError
from gradflow.inputs.tasks import Task
from gradflow.interventions.finetune.continued import continue_mlm
from gradflow.interventions.vocabulary import extend_vocabulary
from gradflow.models import load_model
from gradflow.models.quiet import quiet_transformers

ENCODER_DIR = "encoder"


def task_texts(task: Task, rows: list[dict]) -> list[str]:
    """The rows as plain text: a token task's words joined by spaces, a sequence task's texts."""
    return [" ".join(r["tokens"]) if task.kind == "token" else r["text"] for r in rows]


def prepare_encoder(config, task: Task, train_rows: list[dict]) -> str:
    """The model spec ``finetune`` loads for ``config`` (a ``FinetuneConfig``); see the module docstring."""
    words = tuple(config.extend_vocabulary or ())
    if not words and not config.continue_mlm_steps:
        return config.model
    if not config.out_dir:
        raise GradflowError("extend_vocabulary and continue_mlm_steps save a prepared checkpoint: give out_dir")
    root = Path(config.out_dir) / ENCODER_DIR
    if config.continue_mlm_steps:
        model_dir = continue_mlm(config.model, task_texts(task, train_rows), root / "continued",
                                 steps=config.continue_mlm_steps, batch_size=config.batch_size,
                                 lr=config.continue_mlm_lr, seed=config.seed, log_every=max(1, config.eval_every),
                                 max_length=config.max_length, device=config.device, new_words=words)
        return str(model_dir)
    with quiet_transformers():
        loaded = load_model(config.model, dtype="float32")
        extension = extend_vocabulary(loaded.model, loaded.tokenizer, words)
        out = root / "extended"
        loaded.model.save_pretrained(out)
        loaded.tokenizer.save_pretrained(out)
    (out / "vocabulary.json").write_text(json.dumps(extension.to_dict(), indent=2) + "\n")
    return str(out)


__all__ = ["ENCODER_DIR", "prepare_encoder", "task_texts"]
