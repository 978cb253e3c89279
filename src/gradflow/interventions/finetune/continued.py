"""Continued MLM pretraining on a task's own text, with the gradient flow logged as it trains.

``continue_mlm("gradflow-mini-en", texts, out_dir, steps=..., batch_size=..., lr=..., seed=...)``
loads the masked LM in float32 (the embedded models ship float16: AdamW on float16 weights would
lose updates), trains it with ``transformers.Trainer`` on ``texts`` (BERT masking through
``DataCollatorForLanguageModeling``: 15% of tokens selected, 80/10/10 mask/random/kept), with a
:class:`gradflow.interventions.callback.GradFlowCallback` attached, and writes to ``out_dir``:

- ``gradflow_callback.csv``: per block and position role, the weight-gradient norm, the mean
  hidden-state gradient norm and the weight drift every ``log_every`` steps (and at step 1);
- ``mlm_log.csv``: the training MLM loss of every step (of each micro-batch) and the learning rate
  it was taken with;
- ``continued.json``: the arguments (model paths as :func:`gradflow.provenance.portable_path`
  writes them), the number of texts, wall and CPU seconds and the final loss (mean of the last
  ``log_every`` steps);
- ``new_rows.csv`` (with ``new_words``): where the new vocabulary rows get their gradient, per side
  (input / output) and role (:class:`gradflow.interventions.new_rows.NewRowsCallback`);
- ``model/``: the trained ``*ForMaskedLM`` and its tokenizer (``save_pretrained``, float32), which
  :func:`gradflow.interventions.finetune.finetune` loads with ``model=str(path)``.

File names and columns: :mod:`gradflow.schema` (``CALLBACK_*``, ``MLM_LOG_*``, ``NEW_ROWS_*``).

The Trainer is kept quiet (no progress bars, no printed logs, no reporting integrations, no
checkpoints). Rerunning into the same ``out_dir`` starts afresh (the callback CSV is replaced).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch

from gradflow.errors import GradflowError
from gradflow.interventions.callback import GradFlowCallback
from gradflow.interventions.new_rows import NewRowsCallback
from gradflow.interventions.vocabulary import extend_vocabulary
from gradflow.models import load_model
from gradflow.models.quiet import quiet_transformers
from gradflow.provenance import portable_path
from gradflow.runs.meta import versions
from gradflow.schema import CALLBACK_FILE, CONTINUED_META_FILE, MLM_LOG_COLUMNS, MLM_LOG_FILE, NEW_ROWS_FILE

LOG_NAME = MLM_LOG_FILE
"""Alias of :data:`gradflow.schema.MLM_LOG_FILE` (kept for older imports)."""
META_NAME = CONTINUED_META_FILE
"""Alias of :data:`gradflow.schema.CONTINUED_META_FILE` (kept for older imports)."""
MODEL_DIR = "model"


def continue_mlm(model_spec: str, texts: list[str], out_dir: str | Path, steps: int, batch_size: int, lr: float,
                 seed: int, log_every: int = 50, max_length: int = 128, *, warmup: float = 0.1,
                 weight_decay: float = 0.01, mlm_probability: float = 0.15, bf16: bool = False,
                 device: str = "cpu", new_words: Sequence[str] = ()) -> Path:
    """Continue MLM training of ``model_spec`` on ``texts``; return the saved model's directory.

    ``warmup``: fraction of ``steps`` with a linearly rising learning rate (then linear decay to
    0); ``bf16``: bfloat16 autocast for the forward passes (weights and optimiser stay float32);
    ``new_words``: first add them to the vocabulary (:func:`gradflow.interventions.vocabulary.extend_vocabulary`)
    and log where their rows get their gradient.
    """
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback, ProgressCallback


    if steps < 1 or batch_size < 1 or log_every < 1:
        raise GradflowError("steps, batch_size and log_every must be >= 1")
    if not 0.0 <= warmup < 1.0:
        raise GradflowError(f"warmup is a fraction of the steps in [0, 1), got {warmup}")
    texts = [t for t in texts if t and t.strip()]
    if not texts:
        raise GradflowError("continue_mlm: no non-empty texts to train on")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (CALLBACK_FILE, MLM_LOG_FILE, CONTINUED_META_FILE, NEW_ROWS_FILE):
        (out / stale).unlink(missing_ok=True)

    start, cpu_start = time.perf_counter(), time.process_time()
    with quiet_transformers():
        loaded = load_model(model_spec, device=device, dtype="float32")
        model, tokenizer = loaded.model, loaded.tokenizer
        extension = extend_vocabulary(model, tokenizer, new_words) if new_words else None
        limit = min(max_length, loaded.max_positions())
        enc = tokenizer(texts, truncation=True, max_length=limit, return_token_type_ids=False)
        dataset = [{"input_ids": ids, "attention_mask": am} for ids, am in zip(enc["input_ids"], enc["attention_mask"])]
        args = TrainingArguments(
            output_dir=str(out), max_steps=steps, per_device_train_batch_size=batch_size, learning_rate=lr,
            lr_scheduler_type="linear", warmup_steps=int(round(warmup * steps)), weight_decay=weight_decay,
            max_grad_norm=1.0, seed=seed, data_seed=seed, bf16=bf16, use_cpu=device == "cpu",
            logging_strategy="no", save_strategy="no",
            eval_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
            remove_unused_columns=False, log_level="error")
        # masking draws from the global torch RNG, which the Trainer seeds with ``seed`` (the collator's own
        # ``seed`` refuses to run in a non-main process outside a DataLoader worker, e.g. in a process pool)
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=mlm_probability)
        trainer = _loss_recording(Trainer)(model=model, args=args, train_dataset=dataset, data_collator=collator,
                                           processing_class=tokenizer)
        for quiet in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(quiet)
        GradFlowCallback.attach(trainer, every=log_every)
        if extension is not None:
            trainer.add_callback(NewRowsCallback(extension.new_ids, out / NEW_ROWS_FILE, every=log_every,
                                                 tokenizer=tokenizer))
        trainer.train()
    model.eval()
    model_dir = out / MODEL_DIR
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    log = pd.DataFrame(trainer.loss_rows, columns=list(MLM_LOG_COLUMNS))
    log.to_csv(out / MLM_LOG_FILE, index=False)
    meta = {"model": portable_path(model_spec, out), "model_path": portable_path(loaded.path, out),
            "texts": len(texts), "steps": steps,
            "batch_size": batch_size, "lr": lr, "seed": seed, "log_every": log_every, "max_length": limit,
            "warmup": warmup, "weight_decay": weight_decay, "mlm_probability": mlm_probability, "bf16": bf16,
            "device": device, "torch_threads": torch.get_num_threads(),
            "final_loss": float(log.loss.tail(log_every).mean()),
            "vocabulary_extension": extension.to_dict() if extension is not None else None,
            "seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu_start,
            "versions": versions()}
    (out / CONTINUED_META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return model_dir


def _loss_recording(trainer_cls):
    """``trainer_cls`` that keeps ``(step, loss, learning_rate)`` of every training micro-batch.

    The Trainer's own loss logging is not used: ``GradFlowCallback.attach`` logs through
    ``trainer.log`` at the end of a logged step, which resets the Trainer's ``should_log`` flag, so
    the Trainer's loss rows for those very steps would be lost.
    """

    class LossRecordingTrainer(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_rows: list[tuple[int, float, float]] = []

        def compute_loss(self, model, inputs, *args, **kwargs):
            out = super().compute_loss(model, inputs, *args, **kwargs)
            if model.training:
                loss = out[0] if isinstance(out, tuple) else out
                lr = self.lr_scheduler.get_last_lr()[0] if self.lr_scheduler is not None else math.nan
                self.loss_rows.append((self.state.global_step + 1, float(loss.detach()), float(lr)))
            return out

    return LossRecordingTrainer


__all__ = ["LOG_NAME", "META_NAME", "MODEL_DIR", "continue_mlm"]
