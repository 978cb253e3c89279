"""Losses the recorder can backpropagate. Each maps (logits (B, T, V), batch) to a scalar.

- ``mlm``: the model's MLM cross-entropy, mean over the selected positions (``labels != -100``:
  masked + random + kept). Non-loss positions receive exactly zero gradient at the logits.
- ``all-positions``: cross-entropy against the original token at every non-special, non-pad
  position (ELECTRA's All-Tokens MLM), mean over those positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .masking import MaskedBatch
from .roles import Role

LossFn = Callable[[torch.Tensor, MaskedBatch], torch.Tensor]


def mlm_loss(logits: torch.Tensor, batch: MaskedBatch) -> torch.Tensor:
    """Mean cross-entropy over ``labels != -100``; float32 whatever the logits' dtype."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch.labels.reshape(-1),
                           ignore_index=-100)


def all_positions_labels(batch: MaskedBatch) -> torch.Tensor:
    """(B, T) labels: the original token at every non-special, non-pad position, else -100."""
    keep = batch.roles <= Role.CONTEXT
    return torch.where(keep, batch.original_ids, torch.full_like(batch.original_ids, -100))


def all_positions_loss(logits: torch.Tensor, batch: MaskedBatch) -> torch.Tensor:
    """Mean cross-entropy over every non-special, non-pad position."""
    labels = all_positions_labels(batch)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100)


LOSSES: dict[str, LossFn] = {"mlm": mlm_loss, "all-positions": all_positions_loss}


def get_loss(name_or_fn: str | LossFn) -> LossFn:
    """A loss by name (``mlm``, ``all-positions``) or a callable passed through."""
    if callable(name_or_fn):
        return name_or_fn
    try:
        return LOSSES[name_or_fn]
    except KeyError:
        raise ValueError(f"unknown loss {name_or_fn!r}; choose one of {', '.join(LOSSES)}") from None
