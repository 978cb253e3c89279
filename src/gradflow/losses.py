"""Losses the recorder can backpropagate. Each maps (logits (B, T, V), batch) to a scalar.

- ``mlm``: the MLM cross-entropy at the selected positions (``labels != -100``: masked + random +
  kept). Non-loss positions receive exactly zero gradient at the logits.
- ``all-positions``: cross-entropy against the original token at every non-special, non-pad
  position (ELECTRA's All-Tokens MLM).

``reduction``: ``"batch"`` is the usual mean over every loss position of the batch (what the
model's own ``loss`` computes); ``"sequence"`` is the sum over sequences of each sequence's mean,
so a sequence's gradient is the same whatever batch it is in (used for corpus recordings, whose
results must not depend on batching or the number of processes).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from gradflow.inputs.masking import MaskedBatch
from gradflow.roles import Role

LossFn = Callable[[torch.Tensor, MaskedBatch], torch.Tensor]
REDUCTIONS = ("batch", "sequence")


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "batch") -> torch.Tensor:
    """Cross-entropy over ``labels != -100`` (float32 whatever the logits' dtype)."""
    flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                           ignore_index=-100, reduction="none").reshape(labels.shape)
    counted = labels != -100
    if reduction == "batch":
        return flat.sum() / counted.sum().clamp_min(1)
    if reduction == "sequence":
        return (flat.sum(dim=1) / counted.sum(dim=1).clamp_min(1)).sum()
    raise ValueError(f"unknown reduction {reduction!r}; choose one of {', '.join(REDUCTIONS)}")


def mlm_loss(logits: torch.Tensor, batch: MaskedBatch, reduction: str = "batch") -> torch.Tensor:
    """MLM cross-entropy at the selected positions."""
    return cross_entropy(logits, batch.labels, reduction)


def all_positions_labels(batch: MaskedBatch) -> torch.Tensor:
    """(B, T) labels: the original token at every non-special, non-pad position, else -100."""
    keep = batch.roles <= Role.CONTEXT
    return torch.where(keep, batch.original_ids, torch.full_like(batch.original_ids, -100))


def all_positions_loss(logits: torch.Tensor, batch: MaskedBatch, reduction: str = "batch") -> torch.Tensor:
    """Cross-entropy against the original token at every non-special, non-pad position."""
    return cross_entropy(logits, all_positions_labels(batch), reduction)


LOSSES: dict[str, Callable[..., torch.Tensor]] = {"mlm": mlm_loss, "all-positions": all_positions_loss}
LOSS_LABELS: dict[str, Callable[[MaskedBatch], torch.Tensor]] = {"mlm": lambda batch: batch.labels,
                                                                 "all-positions": all_positions_labels}
"""The (B, T) labels of each named loss (-100 outside it)."""


def cross_entropy_at_labels(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor,
                            reduction: str = "batch") -> torch.Tensor:
    """``cross_entropy(head(hidden), labels, reduction)`` with a position-wise ``head`` run at the labelled
    positions only: ``hidden`` (B, T, H), ``labels`` (B, T). The same value, and the same gradient towards
    ``hidden`` (exactly zero at every unlabelled position), without the (B, T, V) logits."""
    counted = labels != -100
    rows, cols = counted.nonzero(as_tuple=True)
    per = F.cross_entropy(head(hidden[rows, cols]).float(), labels[rows, cols], reduction="none")
    if reduction == "batch":
        return per.sum() / counted.sum().clamp_min(1)
    if reduction == "sequence":
        sums = per.new_zeros(labels.shape[0]).index_add_(0, rows, per)
        return (sums / counted.sum(dim=1).clamp_min(1)).sum()
    raise ValueError(f"unknown reduction {reduction!r}; choose one of {', '.join(REDUCTIONS)}")


def get_loss(name_or_fn: str | LossFn, reduction: str = "batch") -> LossFn:
    """A loss by name (``mlm``, ``all-positions``) with its reduction, or a callable passed through."""
    if callable(name_or_fn):
        return name_or_fn
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; choose one of {', '.join(REDUCTIONS)}")
    try:
        return partial(LOSSES[name_or_fn], reduction=reduction)
    except KeyError:
        raise ValueError(f"unknown loss {name_or_fn!r}; choose one of {', '.join(LOSSES)}") from None
