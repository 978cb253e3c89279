"""Repair the last block: continue training only it on every position (the all-positions objective).

Under the MLM loss the last block's after-mixing sublayers get exactly zero gradient from context
positions. ``repair(RepairConfig(model=..., out_dir=...))`` loads the masked LM in float32, freezes
everything except the last block (and, with ``train_head``, the MLM head's transform and bias;
never the output-embedding matrix, which tied models share with the input embeddings), and trains
with ``transformers.Trainer`` on the same BERT corruption (80/10/10 on the selected positions,
:class:`gradflow.inputs.masking.BertMasking`, seeded per window and draw) but the loss at every
non-special, non-pad position predicting the original token (:func:`gradflow.losses.all_positions_labels`).
The Trainer is used (not a plain loop) because :class:`GradFlowCallback` is a TrainerCallback: it
logs the last block's per-role gradient under the repair objective. The model's ``labels`` are the
MLM labels (so the callback derives roles from the selection); the loss backpropagated is the
all-positions one (``objective="mlm"`` backpropagates the MLM loss instead, for comparison).

The first ``eval_windows`` windows of the corpus are held out: masked-token top-1 at the selected
positions (:func:`gradflow.runs.evaluation.mlm_accuracy`) is measured on them before and after;
training draws from the remaining windows. Writes to ``out_dir``: ``model/`` (``save_pretrained``
model + tokenizer), ``gradflow_callback.csv`` and ``repair.json`` (provenance, see :func:`repair`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from gradflow.adapters import adapter_for, block_modules, get_module
from gradflow.errors import GradflowError, UsageError
from gradflow.inputs.corpus import default_texts
from gradflow.inputs.masking import BertMasking
from gradflow.inputs.pipeline import mask_windows
from gradflow.interventions.callback import CSV_NAME, GradFlowCallback
from gradflow.losses import all_positions_labels, cross_entropy
from gradflow.models import load_model
from gradflow.models.quiet import quiet_transformers
from gradflow.runs.evaluation import mlm_accuracy
from gradflow.runs.job import open_job
from gradflow.runs.meta import JobInputs, JobOutcome, job_meta
from gradflow.site_names import block_group_name

META_NAME = "repair.json"
MODEL_DIR = "model"
OBJECTIVES = ("all-positions", "mlm")


@dataclass
class RepairConfig:
    """What to repair and how. ``texts``: a corpus path (None: the committed default sample)."""

    model: str
    out_dir: str
    steps: int = 200
    batch_size: int = 16
    max_length: int = 128
    lr: float = 1e-4
    warmup: float = 0.1
    weight_decay: float = 0.01
    seed: int = 0
    train_head: bool = False
    texts: str | None = None
    eval_windows: int | None = None  # held-out windows (default: a fifth of the corpus, at most 256)
    log_every: int = 50
    objective: str = "all-positions"
    device: str = "cpu"
    command: list[str] | None = field(default=None, repr=False)


@dataclass
class RepairResult:
    """Where things went and the numbers (also in ``repair.json``)."""

    model_dir: Path
    meta: dict
    model: torch.nn.Module = field(repr=False)


def _check(config: RepairConfig) -> None:
    if config.steps < 1 or config.batch_size < 1 or config.log_every < 1 or config.max_length < 4:
        raise UsageError("repair: steps, batch_size and log_every must be >= 1 and max_length >= 4")
    if not config.lr > 0 or not 0.0 <= config.warmup < 1.0:
        raise UsageError(f"repair: lr must be > 0 and warmup in [0, 1), got {config.lr}, {config.warmup}")
    if config.objective not in OBJECTIVES:
        raise UsageError(f"repair: objective must be one of {', '.join(OBJECTIVES)}, got {config.objective!r}")
    if config.eval_windows is not None and config.eval_windows < 1:
        raise UsageError("repair: eval_windows must be >= 1")


def trainable_parameters(model: torch.nn.Module, train_head: bool) -> dict[str, torch.nn.Parameter]:
    """The parameters repair trains, by name: the last block's, plus the head's (minus the output embeddings)."""
    adapter = adapter_for(model)
    blocks = block_modules(adapter, model.base_model)
    last = blocks[-1]
    if sum(b is last for b in blocks) > 1:
        raise GradflowError(f"repair: the last block of this {adapter.family} model is shared by several depths; "
                            "training it would change them all (unshare the blocks first)")
    chosen = {id(p) for p in last.parameters()}
    if train_head:
        if adapter.head.call is not None:
            raise GradflowError(f"repair: --train-head needs a module chain head, not {adapter.head.describe()}")
        embeddings = {id(p) for p in get_module(model.base_model, adapter.embeddings).parameters()}
        out_emb = model.get_output_embeddings()
        decoder = {id(out_emb.weight)} if out_emb is not None else set()
        for path in adapter.head.modules:
            chosen |= {id(p) for p in get_module(model, path).parameters()
                       if id(p) not in embeddings and id(p) not in decoder}
    return {n: p for n, p in model.named_parameters() if id(p) in chosen}


def _ties_embeddings(model: torch.nn.Module) -> bool:
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    return out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight


class _Collator:
    """Mask a group of training windows (the pipeline's :func:`mask_windows`); each item's
    ``sequence_index`` is its draw number, which seeds the masking, so every repeat of a window differs."""

    def __init__(self, tokenizer, policy, max_length: int):
        self.tokenizer, self.policy, self.max_length = tokenizer, policy, max_length

    def __call__(self, items: list) -> dict:

        batch = mask_windows(self.tokenizer, items, self.policy, self.max_length)
        return {**batch.model_inputs(), "labels": batch.labels, "repair_labels": all_positions_labels(batch)}


def _repair_trainer(trainer_cls, objective: str):
    class RepairTrainer(trainer_cls):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            targets = inputs.pop("repair_labels")
            outputs = model(**inputs)  # MLM labels passed along: the callback reads the roles from them
            loss = outputs.loss if objective == "mlm" else cross_entropy(outputs.logits, targets)
            return (loss, outputs) if return_outputs else loss

    return RepairTrainer


def context_shares(rows: list[dict], group: str) -> list[dict]:
    """Per logged step, the context positions' share of ``group``'s gradient.

    ``hidden``: share of the summed per-position hidden-state gradient norms at the block's output
    (exactly 0 for the last block under the MLM loss); ``weight``: share of the squared per-role
    weight-gradient norms (all standard sublayers, so K and V give context a share even under MLM).
    """
    out = []
    for step in sorted({r["step"] for r in rows}):
        at = [r for r in rows if r["step"] == step and r["group"] == group and r["role"] != "all"]
        count = {r["role"]: r["value"] for r in at if r["quantity"] == "n_positions"}
        hidden = {r["role"]: r["value"] * count.get(r["role"], 0) for r in at if r["quantity"] == "hidden_grad_mean"}
        weight = {r["role"]: r["value"] ** 2 for r in at if r["quantity"] == "grad_norm"}
        shares = {"step": step}
        for name, parts in (("hidden", hidden), ("weight", weight)):
            total = sum(parts.values())
            shares[name] = parts.get("context", 0.0) / total if total > 0 else float("nan")
        out.append(shares)
    return out


def repair(config: RepairConfig) -> RepairResult:
    """Repair ``config.model``'s last block; write the checkpoint and ``repair.json``; return the result.

    ``repair.json``: the provenance block of every job (:func:`gradflow.runs.meta.job_meta`: model,
    corpus, masking, seed, versions, command, wall seconds, ``complete``), the config, trained
    parameter names and count, whether the embeddings are tied (then frozen), held-out top-1
    before/after and their difference (``top1_drop_ok``: it fell by at most 0.01) and the last
    block's context share per logged step. The window length is ``max_length`` fitted to the model
    (never longer than it accepts).
    """
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    _check(config)
    start = time.time()
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (CSV_NAME, META_NAME):
        (out / stale).unlink(missing_ok=True)
    texts = config.texts if config.texts is not None else default_texts()
    torch.manual_seed(config.seed)
    with quiet_transformers():
        loaded = load_model(config.model, device=config.device, dtype="float32")
        model, tokenizer = loaded.model, loaded.tokenizer
        limit = min(config.max_length, loaded.max_positions())
        policy = BertMasking(seed=config.seed)
        windows = list(open_job(loaded, texts, policy, limit, config.batch_size).windows())
        n_eval = config.eval_windows if config.eval_windows is not None else min(256, max(1, len(windows) // 5))
        train_windows = windows[n_eval:]
        if not train_windows:
            raise UsageError(f"repair: the corpus has {len(windows)} windows of {limit} tokens; "
                             f"none left for training after {n_eval} held-out windows")

        def top1() -> float:
            model.eval()
            return mlm_accuracy(loaded, texts, policy, limit, config.batch_size, limit=n_eval).top1

        before = top1()
        trained = trainable_parameters(model, config.train_head)
        for p in model.parameters():
            p.requires_grad_(False)
        for p in trained.values():
            p.requires_grad_(True)
        total = config.steps * config.batch_size
        offset = len(windows)  # draws of training items start after the held-out windows' masking indices
        dataset = [replace(train_windows[i % len(train_windows)], sequence_index=offset + i) for i in range(total)]
        args = TrainingArguments(
            output_dir=str(out), max_steps=config.steps, per_device_train_batch_size=config.batch_size,
            learning_rate=config.lr, lr_scheduler_type="linear", warmup_steps=round(config.warmup * config.steps),
            weight_decay=config.weight_decay, max_grad_norm=1.0, seed=config.seed, data_seed=config.seed,
            use_cpu=config.device == "cpu", logging_strategy="no", save_strategy="no", eval_strategy="no",
            report_to="none", disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False,
            log_level="error")
        model.train()
        trainer = _repair_trainer(Trainer, config.objective)(
            model=model, args=args, train_dataset=dataset, data_collator=_Collator(tokenizer, policy, limit),
            processing_class=tokenizer)
        for quiet in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(quiet)
        callback = GradFlowCallback.attach(trainer, every=config.log_every, drift=False)
        trainer.train()
        for p in model.parameters():
            p.requires_grad_(True)
        after = top1()
    model_dir = out / MODEL_DIR
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    blocks = block_modules(loaded.adapter, model.base_model)
    group = block_group_name(len(blocks) - 1)
    tied = _ties_embeddings(model)
    inputs = JobInputs(model=config.model, texts=texts, masking=policy.describe(), seed=config.seed,
                       num_layers=len(blocks))
    fields = {
        "windows": len(windows), "eval_windows": n_eval, "train_windows": len(train_windows), "max_length": limit,
        **{k: v for k, v in asdict(config).items()
           if k in ("steps", "batch_size", "lr", "warmup", "weight_decay", "train_head", "objective", "log_every",
                    "device")},
        "trained_parameters": sorted(trained), "trained_parameter_count": sum(p.numel() for p in trained.values()),
        "total_parameter_count": sum(p.numel() for p in model.parameters()),
        "tied_embeddings": tied,
        "embeddings_note": ("input and output embeddings are tied: both stay frozen (the head's decoder matrix is "
                            "never trained)") if tied else "the output embedding matrix is never trained",
        "top1_before": before, "top1_after": after, "top1_change": after - before,
        "top1_drop_ok": after >= before - 0.01,
        "last_block_group": group, "context_share": context_shares(callback.rows, group),
    }
    meta = job_meta(loaded, inputs, JobOutcome(True, None, start, config.command or "", str(out)), fields)
    (out / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
    model.eval()
    return RepairResult(model_dir, meta, model)


__all__ = ["META_NAME", "MODEL_DIR", "OBJECTIVES", "RepairConfig", "RepairResult", "context_shares", "repair",
           "trainable_parameters"]
