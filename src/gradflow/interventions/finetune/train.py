"""The fine-tuning loop: a plain AdamW loop with linear warm-up and decay, evaluated every N steps.

``finetune(FinetuneConfig(model="gradflow-mini-en", task="brown-pos", ...))`` loads any
masked-LM checkpoint (embedded name, ``zoo:NAME``, directory or hub name) into
``AutoModelForTokenClassification`` / ``AutoModelForSequenceClassification`` (the task head and,
for sequence tasks of BERT-like models, the pooler are newly initialised from ``seed``), optionally
applies block surgery (drop or re-initialise the last k blocks) or trains the head only, and
writes to ``out_dir``:

- ``eval.csv``: tidy rows of :data:`gradflow.schema.EVAL_FIELDS` (train loss since the last evaluation,
  evaluation loss and the task's metrics), rewritten after every evaluation;
- ``result.json``: the config, surgery records, parameter counts and final metrics (paths in the
  config written as :func:`gradflow.provenance.portable_path` does: never a machine's absolute path).

``head_only`` freezes every parameter loaded from the checkpoint: only the newly initialised
parameters (head, and pooler where the checkpoint has none) are trained.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from gradflow.adapters import adapter_for
from gradflow.adapters.extra_inputs import token_inputs
from gradflow.errors import GradflowError, UnsupportedArchitectureError
from gradflow.inputs.tasks import Task, check_rows, load_split, load_task, score
from gradflow.interventions.finetune.data import (
    IGNORE,
    Encoded,
    class_weights,
    collate,
    encode,
    eval_batches,
    label_counts,
    train_batches,
)
from gradflow.interventions.finetune.early_stopping import BestCheckpoint
from gradflow.interventions.finetune.outputs import write_history, write_outputs
from gradflow.interventions.finetune.prepare import prepare_encoder
from gradflow.interventions.surgery import SurgeryPlan, apply_surgery
from gradflow.models import resolve_model_path
from gradflow.models.quiet import quiet_transformers
from gradflow.progress import progress_bar
from gradflow.schema import EVAL_COLUMNS


@dataclass
class FinetuneConfig:
    """Everything a fine-tuning run depends on.

    ``warmup``: fraction of ``steps`` with a linearly rising learning rate (then linear decay to 0).
    ``class_weights``: ``None``, ``"balanced"`` or one weight per label (training loss only).
    ``train_limit`` / ``eval_limit``: use a seeded sample of that many examples (quick runs);
    ``test_limit``: the same for the splits scored only at the end (default: ``eval_limit``).
    ``autocast``: ``None`` (float32) or ``"bfloat16"``: mixed precision for the forward passes
    (weights, optimiser state and the loss stay float32). ``patience``: stop after that many
    evaluations without a better ``eval_split`` score and score the best checkpoint (None: never).
    ``extend_vocabulary`` (words) / ``continue_mlm_steps``: prepare the encoder first (new vocabulary
    rows from their pieces; continued MLM on the training text at ``continue_mlm_lr``), see
    :mod:`gradflow.interventions.finetune.prepare`.
    """

    model: str
    task: str
    out_dir: str | None = None
    data_root: str | None = None
    lr: float = 5e-5
    steps: int = 1000
    batch_size: int = 32
    eval_batch_size: int = 128
    warmup: float = 0.1
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    max_length: int = 256
    seed: int = 0
    eval_every: int = 200
    eval_split: str = "validation"
    final_splits: tuple[str, ...] = ("validation", "test")
    class_weights: str | tuple[float, ...] | None = None
    drop_last: int = 0
    reinit_last: int = 0
    head_only: bool = False
    train_limit: int | None = None
    eval_limit: int | None = None
    test_limit: int | None = None
    patience: int | None = None
    extend_vocabulary: tuple[str, ...] = ()
    continue_mlm_steps: int = 0
    continue_mlm_lr: float = 1e-4
    device: str = "cpu"
    autocast: str | None = None
    progress: bool = True
    save_model: bool = False

    def __post_init__(self) -> None:
        if min(self.steps, self.batch_size, self.eval_every, 1 if self.patience is None else self.patience) < 1:
            raise GradflowError("steps, batch_size, eval_every and patience must be >= 1")
        if not 0.0 <= self.warmup < 1.0:
            raise GradflowError(f"warmup is a fraction of the steps in [0, 1), got {self.warmup}")
        if self.head_only and self.reinit_last:
            raise GradflowError("head_only freezes the encoder: a re-initialised, frozen block would stay random. "
                                "Use head_only with drop_last only.")
        if isinstance(self.class_weights, list):
            self.class_weights = tuple(self.class_weights)
        self.extend_vocabulary = tuple(self.extend_vocabulary or ())
        if self.continue_mlm_steps < 0:
            raise GradflowError(f"continue_mlm_steps must be >= 0, got {self.continue_mlm_steps}")
        if self.autocast not in (None, "bfloat16"):
            raise GradflowError(f"autocast must be None or 'bfloat16', got {self.autocast!r}")


def autocast_context(config: FinetuneConfig) -> contextlib.AbstractContextManager:
    """The forward-pass precision context of ``config`` (a no-op for float32)."""
    if config.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(config.device).type, dtype=torch.bfloat16)


@dataclass
class EvalRecord:
    """Metrics of one split at one step."""

    step: int
    split: str
    metrics: dict[str, float]


@dataclass
class FinetuneResult:
    """What a run produced. ``final``: split -> metrics after the last step."""

    config: FinetuneConfig
    task: str
    final: dict[str, dict[str, float]]
    history: list[EvalRecord] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    surgery: list[dict] = field(default_factory=list)
    trainable_parameters: int = 0
    total_parameters: int = 0
    seconds: float = 0.0
    out_dir: str | None = None
    max_length: int = 0
    best_step: int | None = None
    stopped_step: int | None = None

    def frame(self) -> pd.DataFrame:
        """The evaluation history as a tidy frame (columns :data:`gradflow.schema.EVAL_COLUMNS`)."""
        rows = [{"step": r.step, "split": r.split, "metric": k, "value": v} for r in self.history
                for k, v in r.metrics.items()]
        return pd.DataFrame(rows, columns=list(EVAL_COLUMNS))

    def to_dict(self) -> dict:
        return {"config": asdict(self.config), "task": self.task, "final": self.final, "surgery": self.surgery,
                "trainable_parameters": self.trainable_parameters, "total_parameters": self.total_parameters,
                "seconds": self.seconds, "steps": self.config.steps, "max_length": self.max_length,
                "best_step": self.best_step, "stopped_step": self.stopped_step}


# ---------------------------------------------------------------------------------------- model
def load_task_model(model_spec: str, task: Task, seed: int) -> tuple[nn.Module, object, set[str]]:
    """(model with a fresh ``task`` head, tokenizer, names of newly initialised parameters)."""
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

    path, _ = resolve_model_path(model_spec)
    cls = AutoModelForTokenClassification if task.kind == "token" else AutoModelForSequenceClassification
    torch.manual_seed(seed)
    with quiet_transformers():
        try:
            # float32 master weights whatever the checkpoint's storage dtype (the embedded models ship
            # float16, which transformers 5 would otherwise keep: AdamW on float16 weights loses updates)
            model, info = cls.from_pretrained(path, num_labels=task.num_labels, id2label=dict(enumerate(task.labels)),
                                              label2id=task.label2id, output_loading_info=True, dtype=torch.float32)
        except (OSError, ValueError) as err:
            raise GradflowError(f"could not load {model_spec!r} for {task.kind} classification: {err}") from None
    tokenizer = AutoTokenizer.from_pretrained(path)
    if task.kind == "token" and getattr(tokenizer, "add_prefix_space", None) is False:
        tokenizer = AutoTokenizer.from_pretrained(path, add_prefix_space=True)  # BPE + pre-split words
    return model, tokenizer, set(info.get("missing_keys", ()))


def max_input_length(model: nn.Module, tokenizer, requested: int) -> int:
    """``requested``, capped by the model's learned positions and the tokenizer's own limit."""
    limit = requested
    config = model.config
    positions = getattr(config, "max_position_embeddings", None)
    if positions and getattr(config, "position_embedding_type", "absolute") == "absolute":
        limit = min(limit, positions - _position_offset(config))
    tok_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_limit, int) and 0 < tok_limit < 1_000_000:
        limit = min(limit, tok_limit)
    return limit


def _position_offset(config) -> int:
    """Learned positions before the first usable one (RoBERTa-style: ``pad_token_id + 1``), from the adapter."""
    try:
        return adapter_for(config).position_offset(config)
    except UnsupportedArchitectureError:
        return 0  # no adapter: no offset assumed


def freeze_loaded(model: nn.Module, new_params: set[str]) -> int:
    """Freeze every parameter except the newly initialised ones; return the trainable count."""
    for name, p in model.named_parameters():
        p.requires_grad_(name in new_params)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trainable == 0:
        raise GradflowError("head_only: no newly initialised parameters found to train")
    return trainable


def make_optimizer(model: nn.Module, config: FinetuneConfig) -> tuple[torch.optim.Optimizer, object]:
    """AdamW (no weight decay on biases and norms) and a linear warm-up / decay schedule."""
    from transformers import get_linear_schedule_with_warmup

    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=config.lr)
    warmup = int(round(config.warmup * config.steps))
    return optimizer, get_linear_schedule_with_warmup(optimizer, warmup, config.steps)


# ---------------------------------------------------------------------------------------- loss and eval
def task_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy over labelled positions (token) or examples (sequence), optionally class-weighted.

    With weights the mean is weighted: ``sum_i w[y_i] * nll_i / sum_i w[y_i]``.
    """
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(flat, labels.reshape(-1), weight=weights, ignore_index=IGNORE)


def model_inputs(batch: dict[str, torch.Tensor], tokenizer: object = None) -> dict[str, torch.Tensor]:
    """The model's inputs for a collated batch: ids, attention and what the tokenizer derives per token
    (RoCBert's shape and pronunciation ids: :func:`gradflow.adapters.extra_inputs.token_inputs`)."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if tokenizer is not None:
        inputs.update(token_inputs(tokenizer, batch["input_ids"], batch["attention_mask"]))
    return inputs


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, rows: list[dict], examples: list[Encoded], pad_id: int,
             batch_size: int, device: str, tokenizer: object = None) -> dict[str, float]:
    """Loss (unweighted) and the task's metrics on one split."""
    was_training = model.training
    model.eval()
    preds: list = [None] * len(examples)
    loss_sum, loss_n = 0.0, 0
    for idx in eval_batches(examples, batch_size):
        batch = {k: v.to(device) for k, v in collate([examples[i] for i in idx], pad_id).items()}
        logits = model(**model_inputs(batch, tokenizer)).logits
        n = int((batch["labels"] != IGNORE).sum())
        loss_sum += float(task_loss(logits, batch["labels"])) * n
        loss_n += n
        best = logits.argmax(-1).cpu()
        for row, i in enumerate(idx):
            if task.kind == "token":
                mask = batch["labels"][row].cpu() != IGNORE
                preds[i] = best[row][mask].tolist()
            else:
                preds[i] = int(best[row])
    model.train(was_training)
    gold, pred = _decode(task, rows, examples, preds)
    dropped = sum(e.num_words - len(e.words) for e in examples) if task.kind == "token" else 0
    return {"loss": loss_sum / max(loss_n, 1), **score(task, gold, pred), "dropped_words": float(dropped)}


def _decode(task: Task, rows: list[dict], examples: list[Encoded], preds: list) -> tuple[list, list]:
    """Gold and predicted label names; unseen (truncated) words get the fallback label."""
    if task.kind == "sequence":
        return [r["label"] for r in rows], [task.labels[p] for p in preds]
    gold, pred = [], []
    for row, ex, p in zip(rows, examples, preds):
        words = [task.fallback_label()] * len(row["tags"])
        for w, label_id in zip(ex.words, p):
            words[w] = task.labels[label_id]
        gold.append(list(row["tags"]))
        pred.append(words)
    return gold, pred


# ---------------------------------------------------------------------------------------- data
def _sample(rows: list[dict], limit: int | None, seed: int) -> list[dict]:
    if limit is None or limit >= len(rows):
        return rows
    keep = sorted(torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:limit].tolist())
    return [rows[i] for i in keep]


def _task_and_data(config: FinetuneConfig, task: Task | None,
                   data: dict[str, list[dict]] | None) -> tuple[Task, dict[str, list[dict]]]:
    task = task or load_task(config.task, config.data_root)
    splits = {"train", config.eval_split, *config.final_splits}
    if data is None:
        data = {s: load_split(task, s) for s in splits}
    for s, rows in data.items():
        check_rows(task, rows, s)
    missing = splits - set(data)
    if missing:
        raise GradflowError(f"no rows for split(s) {', '.join(sorted(missing))}")
    out = {"train": _sample(data["train"], config.train_limit, config.seed)}
    final_only_limit = config.eval_limit if config.test_limit is None else config.test_limit
    for s in splits - {"train"}:
        out[s] = _sample(data[s], config.eval_limit if s == config.eval_split else final_only_limit, config.seed)
    return task, out


# ---------------------------------------------------------------------------------------- loop
def finetune(config: FinetuneConfig, *, task: Task | None = None,
             data: dict[str, list[dict]] | None = None) -> FinetuneResult:
    """Fine-tune ``config.model`` on ``config.task`` (or on ``task`` with rows ``data``)."""
    start = time.perf_counter()
    task, rows = _task_and_data(config, task, data)
    model, tokenizer, new_params = load_task_model(prepare_encoder(config, task, rows["train"]), task, config.seed)
    model, surgery = apply_surgery(model, SurgeryPlan(config.drop_last, config.reinit_last, config.seed))
    if config.head_only:
        freeze_loaded(model, new_params)
    model.to(config.device).train()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    max_length = max_input_length(model, tokenizer, config.max_length)
    encoded = {s: encode(task, tokenizer, r, max_length) for s, r in rows.items()}
    weights = class_weights(config.class_weights, label_counts(encoded["train"], task.num_labels))
    weights = weights.to(config.device) if weights is not None else None
    optimizer, scheduler = make_optimizer(model, config)
    out = Path(config.out_dir) if config.out_dir else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    result = FinetuneResult(config, task.name, {}, surgery=surgery.to_dict(), max_length=max_length,
                            trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
                            total_parameters=sum(p.numel() for p in model.parameters()),
                            out_dir=str(out) if out else None)
    torch.manual_seed(config.seed)
    batches = train_batches(len(encoded["train"]), config.batch_size, config.seed)
    running: list[float] = []
    keeper = BestCheckpoint(task.metric, config.patience) if config.patience else None
    bar = progress_bar(range(1, config.steps + 1), desc=f"finetune {task.name}", disable=not config.progress)
    for step in bar:
        idx = next(batches)
        batch = {k: v.to(config.device) for k, v in collate([encoded["train"][i] for i in idx], pad_id).items()}
        with autocast_context(config):
            logits = model(**model_inputs(batch, tokenizer)).logits
        loss = task_loss(logits, batch["labels"], weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], config.max_grad_norm)
        optimizer.step()
        scheduler.step()
        value = float(loss.detach())
        result.train_loss.append(value)
        running.append(value)
        bar.set_postfix(loss=f"{value:.4f}", refresh=False)
        if step % config.eval_every == 0 or step == config.steps:
            result.history.append(EvalRecord(step, "train", {"loss": sum(running) / len(running)}))
            running = []
            with autocast_context(config):
                metrics = evaluate(model, task, rows[config.eval_split], encoded[config.eval_split], pad_id,
                                   config.eval_batch_size, config.device, tokenizer)
            result.history.append(EvalRecord(step, config.eval_split, metrics))
            write_history(result, out)
            if keeper is not None and keeper.update(model, step, metrics):
                break
    if keeper is not None:
        keeper.restore(model)
        result.best_step, result.stopped_step = keeper.best_step, keeper.stopped_step
    final_step = result.best_step if keeper is not None else config.steps
    for split in config.final_splits:
        last = [r for r in result.history if r.step == final_step == config.steps and r.split == split]
        if last:
            result.final[split] = last[0].metrics
            continue
        with autocast_context(config):
            result.final[split] = evaluate(model, task, rows[split], encoded[split], pad_id,
                                           config.eval_batch_size, config.device, tokenizer)
    result.seconds = time.perf_counter() - start
    write_outputs(result, out, model, tokenizer)
    return result
