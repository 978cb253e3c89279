"""Losses the recorder can backpropagate. Each maps (logits (B, T, V), batch) to a scalar.

- ``mlm``: the objective's own loss: cross-entropy at the loss positions (``labels != -100``:
  masked + random + kept), weighted and normalised as the objective says (BERT and span masking:
  the plain mean; masked diffusion: ``1/t`` weights and the reference normaliser, see
  :func:`weighted_cross_entropy`). Non-loss positions receive exactly zero gradient at the logits.
- ``all-positions``: cross-entropy against the original token at every non-special, non-pad
  position (ELECTRA's All-Tokens MLM), unweighted whatever the objective; under a shifted
  objective position ``p`` predicts the token at ``p + 1``.

``reduction``: ``"batch"`` is the usual mean over every loss position of the batch (what the
model's own ``loss`` computes; masked diffusion: the reference's normalisation); ``"sequence"`` is
the sum over sequences of each sequence's normalised loss, so a sequence's gradient is the same
whatever batch it is in (used for corpus recordings, whose results must not depend on batching or
the number of processes).
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


def weighted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, norm: torch.Tensor,
                           reduction: str = "batch", mean_over_sequences: bool = False) -> torch.Tensor:
    """Cross-entropy weighted per position and normalised per sequence (float32 whatever the logits' dtype).

    ``logits`` (B, T, V); ``labels`` (B, T), -100 outside the loss; ``weights`` (B, T), e.g. ``1/t``;
    ``norm`` (B,), each sequence's normaliser. With ``S_b = sum_p weights[b, p] * CE[b, p]``:
    ``"batch"`` is ``sum_b S_b / sum_b norm_b`` (LLaDA's pre-training loss, ``norm_b`` its tokens:
    ``sum / (b * l)``; MDLM's mean over real tokens), or with ``mean_over_sequences``
    ``mean_b S_b / norm_b`` (LLaDA's SFT loss, ``norm_b`` the response length); ``"sequence"`` is
    ``sum_b S_b / norm_b``.
    """
    flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                           ignore_index=-100, reduction="none").reshape(labels.shape)
    return weighted_reduction((flat * weights.to(flat.dtype)).sum(dim=1), norm, reduction, mean_over_sequences)


def weighted_reduction(sums: torch.Tensor, norm: torch.Tensor, reduction: str = "batch",
                       mean_over_sequences: bool = False) -> torch.Tensor:
    """The reference normalisation of per-sequence weighted cross-entropy sums ``S_b`` (``sums``, (B,)) by ``norm``
    (B,; a normaliser under 1 counts as 1): see :func:`weighted_cross_entropy`. The one rule of every weighted loss
    (on the logits, at the labelled positions only, and in sparse training)."""
    norm = norm.to(sums.dtype).clamp_min(1)
    if reduction == "batch":
        return (sums / norm).mean() if mean_over_sequences else sums.sum() / norm.sum()
    if reduction == "sequence":
        return (sums / norm).sum()
    raise ValueError(f"unknown reduction {reduction!r}; choose one of {', '.join(REDUCTIONS)}")


def mlm_loss(logits: torch.Tensor, batch: MaskedBatch, reduction: str = "batch") -> torch.Tensor:
    """The objective's cross-entropy at the loss positions (weighted and normalised as it says, if it does)."""
    if batch.loss_weights is None or batch.loss_norm is None:
        return cross_entropy(logits, batch.labels, reduction)
    return weighted_cross_entropy(logits, batch.labels, batch.loss_weights, batch.loss_norm, reduction,
                                  batch.mean_over_sequences)


def all_positions_labels(batch: MaskedBatch) -> torch.Tensor:
    """(B, T) labels: the original token at every non-special, non-pad position, else -100.

    Shifted (``batch.input_roles`` set): position ``p`` gets the token at ``p + 1`` when that one is
    neither special nor padding; the last position none.
    """
    roles = batch.clean_input_roles()
    keep = (roles != Role.SPECIAL) & (roles != Role.PAD)  # an SFT prompt's tokens (``prompt``) too
    none = torch.full_like(batch.original_ids, -100)
    if not batch.shifted:
        return torch.where(keep, batch.original_ids, none)
    none[:, :-1] = torch.where(keep[:, 1:], batch.original_ids[:, 1:], none[:, 1:])
    return none


def all_positions_loss(logits: torch.Tensor, batch: MaskedBatch, reduction: str = "batch") -> torch.Tensor:
    """Cross-entropy against the original token at every non-special, non-pad position."""
    return cross_entropy(logits, all_positions_labels(batch), reduction)


LOSSES: dict[str, Callable[..., torch.Tensor]] = {"mlm": mlm_loss, "all-positions": all_positions_loss}
LOSS_LABELS: dict[str, Callable[[MaskedBatch], torch.Tensor]] = {"mlm": lambda batch: batch.labels,
                                                                 "all-positions": all_positions_labels}
"""The (B, T) labels of each named loss (-100 outside it)."""


def cross_entropy_at_labels(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor,
                            reduction: str = "batch", weights: torch.Tensor | None = None,
                            norm: torch.Tensor | None = None, mean_over_sequences: bool = False) -> torch.Tensor:
    """``cross_entropy(head(hidden), labels, reduction)`` with a position-wise ``head`` run at the labelled
    positions only: ``hidden`` (B, T, H), ``labels`` (B, T). The same value, and the same gradient towards
    ``hidden`` (exactly zero at every unlabelled position), without the (B, T, V) logits. With ``weights``
    (B, T) and ``norm`` (B,): :func:`weighted_cross_entropy`'s value instead."""
    counted = labels != -100
    rows, cols = counted.nonzero(as_tuple=True)
    per = F.cross_entropy(head(hidden[rows, cols]).float(), labels[rows, cols], reduction="none")
    if weights is not None and norm is not None:
        sums = per.new_zeros(labels.shape[0]).index_add_(0, rows, per * weights[rows, cols].to(per.dtype))
        return weighted_reduction(sums, norm, reduction, mean_over_sequences)
    if reduction == "batch":
        return per.sum() / counted.sum().clamp_min(1)
    if reduction == "sequence":
        sums = per.new_zeros(labels.shape[0]).index_add_(0, rows, per)
        return (sums / counted.sum(dim=1).clamp_min(1)).sum()
    raise ValueError(f"unknown reduction {reduction!r}; choose one of {', '.join(REDUCTIONS)}")


def head_loss(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, batch: MaskedBatch, name: str,
              reduction: str = "batch") -> torch.Tensor:
    """The loss ``name`` of ``batch`` (its weights too, for ``mlm``) with a position-wise ``head`` run at its
    labelled positions only (:func:`cross_entropy_at_labels`): the value ``get_loss(name)`` gives on the logits."""
    labels = LOSS_LABELS[name](batch)
    if name == "mlm" and batch.loss_weights is not None and batch.loss_norm is not None:
        return cross_entropy_at_labels(head, hidden, labels, reduction, batch.loss_weights, batch.loss_norm,
                                       batch.mean_over_sequences)
    return cross_entropy_at_labels(head, hidden, labels, reduction)


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
