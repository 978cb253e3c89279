"""A masked batch (:class:`MaskedBatch`), a masked sequence (:class:`SequenceDraw`), and padding draws into a batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gradflow.roles import Role


@dataclass
class SequenceDraw:
    """One sequence after an objective: lists of length T (unpadded), plus per-sequence numbers.

    ``labels`` and ``roles`` are on the loss side (under a shifted objective ``labels[p]`` is the
    token at ``p + 1``); ``input_roles`` says what happened to each input (equal to ``roles``
    unless shifted). ``weight``: the loss weight of every loss position (``1/t`` under masked
    diffusion, else 1); ``ratio``: the masking ratio ``t`` (NaN outside masked diffusion);
    ``norm``: what the reference divides this sequence's weighted loss by (its loss positions
    under BERT and span masking, its real tokens or its response tokens under masked diffusion).
    """

    input_ids: list[int]
    labels: list[int]
    roles: list[int]
    input_roles: list[int]
    weight: float = 1.0
    ratio: float = float("nan")
    norm: float = 0.0


@dataclass
class MaskedBatch:
    """One batch ready for the recorder. All tensors are (B, T) unless stated.

    ``input_ids``: corrupted inputs; ``original_ids``: the uncorrupted tokens; ``labels``: the
    target at each loss position, -100 elsewhere; ``roles``: int8 role codes
    (:class:`gradflow.roles.Role`) of the loss side; ``attention_mask``: 1 for real tokens;
    ``sequence_index``: (B,) index of each row in the corpus.

    Objectives beyond BERT's set the optional fields (None: BERT's plain mean over loss
    positions): ``loss_weights`` (B, T) float32, the weight of each loss position (0 elsewhere);
    ``loss_norm`` (B,) float32, each sequence's normaliser; ``mean_over_sequences``: the batch
    loss is the mean over sequences of their normalised losses (LLaDA's SFT) instead of the pooled
    sum over the pooled normaliser; ``mask_ratio`` (B,) float64, each sequence's ratio t;
    ``input_roles`` (B, T) int8, the roles of the inputs when they differ from ``roles`` (shifted);
    ``prompt_width``: a batch of prompt and canvas for a two-pass model (DiffusionGemma): its first
    ``prompt_width`` = P positions are the prompt and the rest the canvas, each right-padded
    (:mod:`gradflow.inputs.canvas`).
    """

    input_ids: torch.Tensor
    original_ids: torch.Tensor
    labels: torch.Tensor
    roles: torch.Tensor
    attention_mask: torch.Tensor
    sequence_index: torch.Tensor
    extra_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    loss_weights: torch.Tensor | None = None
    loss_norm: torch.Tensor | None = None
    mean_over_sequences: bool = False
    mask_ratio: torch.Tensor | None = None
    input_roles: torch.Tensor | None = None
    prompt_width: int | None = None

    def to(self, device: torch.device | str) -> "MaskedBatch":
        """Copy of the batch on ``device``."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return MaskedBatch(
            *(t.to(device) for t in (self.input_ids, self.original_ids, self.labels, self.roles,
                                      self.attention_mask, self.sequence_index)),
            extra_inputs={k: v.to(device) for k, v in self.extra_inputs.items()},
            loss_weights=move(self.loss_weights), loss_norm=move(self.loss_norm),
            mean_over_sequences=self.mean_over_sequences, mask_ratio=move(self.mask_ratio),
            input_roles=move(self.input_roles), prompt_width=self.prompt_width,
        )

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments for the model's forward."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, **self.extra_inputs}

    @property
    def shifted(self) -> bool:
        """True when the loss side is shifted from the input side (logits at p predict the token at p + 1)."""
        return self.input_roles is not None

    def clean_input_roles(self) -> torch.Tensor:
        """(B, T) int8: the roles of the inputs (``roles`` unless the objective is shifted)."""
        return self.roles if self.input_roles is None else self.input_roles


def pad_draws(draws: Sequence[SequenceDraw], originals: Sequence[Sequence[int]], indices: Sequence[int],
              pad_id: int, weighted: bool, shifted: bool, mean_over_sequences: bool) -> MaskedBatch:
    """Pad ``draws`` (with their uncorrupted ids) into one :class:`MaskedBatch` (B, max T); no extra inputs.

    ``weighted``: fill ``loss_weights``, ``loss_norm`` and ``mask_ratio``; ``shifted``: fill ``input_roles``.
    """
    width = max(len(d.input_ids) for d in draws)
    shape = (len(draws), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    original = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, -100, dtype=torch.long)
    roles = torch.full(shape, int(Role.PAD), dtype=torch.int8)
    input_roles = torch.full(shape, int(Role.PAD), dtype=torch.int8)
    attention = torch.zeros(shape, dtype=torch.long)
    for b, (draw, ids) in enumerate(zip(draws, originals)):
        n = len(draw.input_ids)
        input_ids[b, :n] = torch.tensor(draw.input_ids)
        original[b, :n] = torch.tensor(list(ids))
        labels[b, :n] = torch.tensor(draw.labels)
        roles[b, :n] = torch.tensor(draw.roles, dtype=torch.int8)
        input_roles[b, :n] = torch.tensor(draw.input_roles, dtype=torch.int8)
        attention[b, :n] = 1
    batch = MaskedBatch(input_ids, original, labels, roles, attention, torch.tensor(list(indices), dtype=torch.long),
                        input_roles=input_roles if shifted else None, mean_over_sequences=mean_over_sequences)
    if weighted:
        weight = torch.tensor([d.weight for d in draws], dtype=torch.float32)
        batch.loss_weights = torch.where(labels != -100, weight[:, None], torch.zeros((), dtype=torch.float32))
        batch.loss_norm = torch.tensor([d.norm for d in draws], dtype=torch.float32)
        batch.mask_ratio = torch.tensor([d.ratio for d in draws], dtype=torch.float64)
    return batch


__all__ = ["MaskedBatch", "SequenceDraw", "pad_draws"]
