"""The pretraining objectives of the embedded family beyond BERT 15% (issue 52): 40% masking and masked diffusion.

Both keep mini-en's data order: a step draws its windows from the recipe's generator first, then the
corruption draws the same three tensors mini-en's does (the selection ``u``, the 80/10/10 action and the
random tokens, each of the batch's shape), so step k of every objective trains on mini-en's windows of step k.

- ``mask40``: BERT masking at 40% (Wettig et al. 2023), 80/10/10 of the selected tokens; the cross-entropy
  averaged over the selected positions, as ``mlm``.
- ``diffusion``: masked diffusion as LLaDA pretrains (its ``GUIDELINES.md``): a ratio ``t = (1 - eps) u + eps``
  per window (``eps`` 1e-3; drawn from a generator of its own, seeded ``seed + 1``, so mini-en's draws stay as they
  are), every non-special token selected with probability ``t`` and replaced by [MASK] (no random or kept tokens),
  the cross-entropy at the selected positions weighted by ``1/t`` and summed, divided by the batch's real tokens
  (LLaDA's ``b * l``; here the padding is not counted): :func:`gradflow.losses.weighted_reduction`, the library's
  one rule. mini-en's action and random-token draws are made and left unused.

The head runs at the loss positions only, gathered into a number of rows rounded up to a multiple of
:data:`HEAD_ROWS` (a handful of shapes per run: the CPU kernels' caches stay bounded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gradflow.losses import weighted_reduction

OBJECTIVES = ("mlm", "alltoken", "mask40", "diffusion")
"""``--loss`` choices of ``pretrain.py``: mini-en's, the twin's, and the two of issue 52."""
RATES = {"mlm": 0.15, "alltoken": 0.15, "mask40": 0.40}
"""The BERT selection rate of each BERT-masked objective."""
EPS = 1e-3
"""LLaDA's lower bound of the masking ratio t."""
HEAD_ROWS = 256
"""The head's gathered rows are a multiple of this (the loss positions, padded)."""


@dataclass(frozen=True)
class Corrupted:
    """One step's corrupted batch: ``inputs`` and ``labels`` (B, T) (-100 outside the loss), ``selected`` (B, T)
    bool, and ``ratio`` (B,) float32, each window's masking ratio t (None for the BERT objectives)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    selected: torch.Tensor
    ratio: torch.Tensor | None = None


def special_positions(ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """(B, T) bool: [CLS], [SEP] and padding."""
    return (ids == tokenizer.cls_token_id) | (ids == tokenizer.sep_token_id) | (ids == tokenizer.pad_token_id)


def corrupt_bert(ids: torch.Tensor, tokenizer, gen: torch.Generator, rate: float = 0.15,
                 alltoken: bool = False) -> Corrupted:
    """BERT masking at ``rate`` (80% [MASK], 10% random, 10% kept); the loss at the selected positions, or at
    every non-special one with ``alltoken``. At 0.15: mini-en's corruption, draw for draw."""
    special = special_positions(ids, tokenizer)
    u = torch.rand(ids.shape, generator=gen)
    selected = (u < rate) & ~special
    action = torch.rand(ids.shape, generator=gen)
    inputs = ids.clone()
    inputs[selected & (action < 0.8)] = tokenizer.mask_token_id
    rand_pos = selected & (action >= 0.8) & (action < 0.9)
    inputs[rand_pos] = torch.randint(len(tokenizer), ids.shape, generator=gen)[rand_pos]
    loss_at = ~special if alltoken else selected
    return Corrupted(inputs, torch.where(loss_at, ids, torch.full_like(ids, -100)), selected)


def corrupt_diffusion(ids: torch.Tensor, tokenizer, gen: torch.Generator, ratio_gen: torch.Generator,
                      eps: float = EPS) -> Corrupted:
    """Masked diffusion: t ~ U(eps, 1) per window from ``ratio_gen``, each non-special token selected with
    probability t (``u < t``, ``u`` mini-en's selection draw) and masked; mini-en's other two draws made, unused."""
    special = special_positions(ids, tokenizer)
    u = torch.rand(ids.shape, generator=gen)
    torch.rand(ids.shape, generator=gen)  # mini-en's 80/10/10 action and random tokens: drawn so that the
    torch.randint(len(tokenizer), ids.shape, generator=gen)  # generator, and the windows, stay mini-en's
    ratio = (1 - eps) * torch.rand(ids.shape[0], generator=ratio_gen) + eps
    selected = (u < ratio[:, None]) & ~special
    inputs = torch.where(selected, torch.full_like(ids, tokenizer.mask_token_id), ids)
    return Corrupted(inputs, torch.where(selected, ids, torch.full_like(ids, -100)), selected, ratio)


def corrupt(objective: str, ids: torch.Tensor, tokenizer, gen: torch.Generator,
            ratio_gen: torch.Generator | None = None) -> Corrupted:
    """``ids`` (B, T) corrupted by ``objective`` (one of :data:`OBJECTIVES`; diffusion needs ``ratio_gen``)."""
    if objective == "diffusion":
        if ratio_gen is None:
            raise ValueError("the diffusion objective draws its ratios from ratio_gen; pass one")
        return corrupt_diffusion(ids, tokenizer, gen, ratio_gen)
    if objective not in RATES:
        raise ValueError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    return corrupt_bert(ids, tokenizer, gen, RATES[objective], alltoken=objective == "alltoken")


def head_rows(labels: torch.Tensor) -> int:
    """The head's row count for ``labels`` (B, T): the loss positions rounded up to :data:`HEAD_ROWS`."""
    return max(HEAD_ROWS, HEAD_ROWS * math.ceil(int((labels != -100).sum()) / HEAD_ROWS))


def objective_loss(model: torch.nn.Module, batch: Corrupted, attention_mask: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, logits at the loss positions (n, V), their targets (n,)); the head on :func:`head_rows` gathered rows.

    BERT objectives: the mean cross-entropy at the loss positions. Diffusion: ``sum_b sum_p CE / t_b`` over the
    loss positions divided by the batch's real tokens (:func:`gradflow.losses.weighted_reduction`, ``"batch"``)."""
    hidden = model.base_model(input_ids=batch.inputs, attention_mask=attention_mask).last_hidden_state
    where = torch.nonzero(batch.labels.reshape(-1) != -100).squeeze(1)
    rows = torch.cat([where, torch.zeros(head_rows(batch.labels) - where.numel(), dtype=torch.long)])
    logits = (model.cls if hasattr(model, "cls") else model.lm_head)(hidden.reshape(-1, hidden.shape[-1])[rows])
    logits, targets = logits[: where.numel()], batch.labels.reshape(-1)[where]
    ce = F.cross_entropy(logits.float(), targets, reduction="none")
    if batch.ratio is None:
        return ce.mean(), logits, targets
    sequence = torch.div(where, batch.labels.shape[1], rounding_mode="floor")
    sums = torch.zeros(batch.labels.shape[0], dtype=ce.dtype).index_add_(0, sequence, ce / batch.ratio[sequence])
    return weighted_reduction(sums, attention_mask.sum(dim=1).to(ce.dtype)), logits, targets


__all__ = [
    "EPS",
    "HEAD_ROWS",
    "OBJECTIVES",
    "RATES",
    "Corrupted",
    "corrupt",
    "corrupt_bert",
    "corrupt_diffusion",
    "head_rows",
    "objective_loss",
    "special_positions",
]
