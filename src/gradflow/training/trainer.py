"""A Hugging Face ``Trainer`` that computes the MLM loss sparsely (:func:`gradflow.training.sparse_mlm`).

    trainer = SparseMLMTrainer(model=model, args=args, train_dataset=ds, data_collator=collator,
                               sparse_block=True)   # False: the sparse head alone
    trainer.train()

Only ``compute_loss`` changes: the batch's ``input_ids``, ``attention_mask`` and ``labels`` (and any other
model inputs) go through :class:`~gradflow.training.SparseMLM` instead of ``model(**inputs)``. With
``num_items_in_batch`` (gradient accumulation over token counts) the loss is the summed
cross-entropy over it, as the model computes it when the Trainer passes that count to it.

Objectives beyond BERT's (masked diffusion's ``1/t`` weights, LLaDA's normalisers): the collator (the user's)
adds the batch fields of :data:`LOSS_FIELDS`, ``loss_weights`` (B, T), ``loss_norm`` (B,) and optionally
``mean_over_sequences`` (a bool, or a tensor of them), as :class:`~gradflow.inputs.MaskedBatch` holds them;
``compute_loss`` pops them before the model sees the rest, and the loss is
:func:`gradflow.losses.weighted_cross_entropy`'s. Each micro-batch is then normalised by its own
``loss_norm`` (as LLaDA's training loop does), and gradient accumulation averages the micro-batches.
(A ``datasets.Dataset`` column the model's forward does not name is dropped before the collator unless
``remove_unused_columns=False``: let the collator compute these fields, or keep the columns.)

With a :class:`~gradflow.interventions.callback.GradFlowCallback` attached, the micro-batch it records on a logged step
runs through the dense model (the same loss and gradients), since the recorder follows the model's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Trainer

from gradflow.adapters import Adapter
from gradflow.training.sparse import IGNORE, SparseMLMOutput, sparse_mlm, weighted_loss

LOSS_FIELDS = ("loss_weights", "loss_norm", "mean_over_sequences")
"""The batch keys ``compute_loss`` pops and passes to :meth:`SparseMLM.forward` (the weighted loss)."""


def pop_loss_fields(inputs: dict[str, Any]) -> dict[str, Any]:
    """Remove :data:`LOSS_FIELDS` from ``inputs`` and return them as :meth:`SparseMLM.forward` keywords
    (``mean_over_sequences`` as a bool: a tensor of per-sequence flags counts when any is set)."""
    fields = {name: inputs.pop(name) for name in LOSS_FIELDS if name in inputs}
    if "mean_over_sequences" in fields:
        flag = fields["mean_over_sequences"]
        fields["mean_over_sequences"] = bool(flag.any()) if isinstance(flag, torch.Tensor) else bool(flag)
    return fields


def dense_output(logits: torch.Tensor, labels: torch.Tensor, loss_weights: torch.Tensor | None = None,
                 loss_norm: torch.Tensor | None = None, mean_over_sequences: bool = False) -> SparseMLMOutput:
    """The :class:`SparseMLMOutput` of the dense model's ``logits`` (B, T, V): the same loss as the sparse forward
    (the logits at the loss positions, row-major), for a step the recorder follows."""
    at = labels != IGNORE
    positions = at.nonzero()
    flat, targets = logits[at], labels[at]
    if loss_weights is None:
        return SparseMLMOutput(F.cross_entropy(flat, targets), flat, targets, positions)
    weights = loss_weights[at]
    loss = weighted_loss(flat, targets, positions[:, 0], weights, loss_norm, mean_over_sequences)
    return SparseMLMOutput(loss, flat, targets, positions, weights)


class SparseMLMTrainer(Trainer):
    """``Trainer`` whose loss is the sparse MLM loss; ``sparse_block``: also the last block (default);
    ``sparse_adapter``: the adapter (an :class:`~gradflow.adapters.Adapter` or ``"auto"``; None: the registered one)."""

    def __init__(self, *args: Any, sparse_block: bool = True, sparse_adapter: Adapter | str | None = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sparse_block = sparse_block
        self.sparse_adapter = sparse_adapter
        sparse_mlm(self.accelerator.unwrap_model(self.model), block=sparse_block,
                   adapter=sparse_adapter)  # refuse before training starts

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """The sparse MLM loss of ``inputs`` (a collated MLM batch with ``labels``; the weighted loss with
        ``loss_weights`` and ``loss_norm``, see :data:`LOSS_FIELDS`)."""
        sparse = sparse_mlm(self.accelerator.unwrap_model(model), block=self.sparse_block, adapter=self.sparse_adapter)
        inputs = dict(inputs)
        weighted = pop_loss_fields(inputs)
        input_ids, labels = inputs.pop("input_ids"), inputs.pop("labels")
        attention_mask = inputs.pop("attention_mask", None)
        recording = [cb for cb in self.callback_handler.callbacks if getattr(cb, "wants_batch", False)]
        if recording:  # a GradFlowCallback records this micro-batch: the recorder follows the dense model's forward
            for callback in recording:
                callback.capture_batch(input_ids, labels, attention_mask)
            logits = model(input_ids=input_ids, attention_mask=attention_mask, **inputs).logits
            out = dense_output(logits, labels, **weighted)
        else:
            out = sparse(input_ids, attention_mask, labels, **weighted, **inputs)
        loss = out.loss
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            if out.weights is not None:  # the Trainer leaves the loss undivided: average the micro-batches here
                loss = loss / getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
            else:
                loss = F.cross_entropy(out.logits, out.labels, reduction="sum") / num_items_in_batch
                if self.args.average_tokens_across_devices:
                    loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        return (loss, out) if return_outputs else loss


__all__ = ["LOSS_FIELDS", "SparseMLMTrainer", "dense_output", "pop_loss_fields"]
