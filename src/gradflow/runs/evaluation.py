"""Masked-token accuracy of an MLM over a corpus (streamed, seeded masking)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradflow.inputs.masking import BertMasking
from gradflow.models import LoadedModel
from gradflow.roles import Role
from gradflow.runs.job import open_job


@dataclass(frozen=True)
class MlmAccuracy:
    """Top-1 accuracy and mean cross-entropy (nats) at the loss positions, and at [MASK] positions."""

    top1: float
    loss: float
    positions: int
    top1_masked: float
    masked_positions: int


@torch.no_grad()
def mlm_accuracy(loaded: LoadedModel, texts: str, policy: BertMasking | None = None, max_length: int = 128,
                 batch_size: int = 16, limit: int | None = None) -> MlmAccuracy:
    """Predict the original token at the selected positions of a seeded masking of ``texts``.

    ``max_length`` longer than the model accepts raises :class:`~gradflow.errors.UsageError`;
    ``limit`` stops after that many windows.
    """
    job = open_job(loaded, texts, policy or BertMasking(seed=0), max_length, batch_size, limit=limit,
                   one_pass="the MLM evaluation")
    model = loaded.model
    device = next(model.parameters()).device
    correct = total = correct_masked = total_masked = 0
    loss_sum = 0.0
    for batch in job.batches():
        batch = batch.to(device)
        logits = model(**batch.model_inputs()).logits.float()
        where = batch.labels != -100
        pred = logits.argmax(-1)
        hits = (pred == batch.labels) & where
        correct += int(hits.sum())
        total += int(where.sum())
        masked = batch.roles == Role.MASKED
        correct_masked += int((hits & masked).sum())
        total_masked += int(masked.sum())
        loss_sum += float(torch.nn.functional.cross_entropy(logits[where], batch.labels[where], reduction="sum"))
    return MlmAccuracy(correct / max(total, 1), loss_sum / max(total, 1), total,
                       correct_masked / max(total_masked, 1), total_masked)
