"""A Hugging Face ``Trainer`` that computes the MLM loss sparsely (:func:`gradflow.training.sparse_mlm`).

    trainer = SparseMLMTrainer(model=model, args=args, train_dataset=ds, data_collator=collator,
                               sparse_block=True)   # False: the sparse head alone
    trainer.train()

Only ``compute_loss`` changes: the batch's ``input_ids``, ``attention_mask`` and ``labels`` (and any other
model inputs) go through :class:`~gradflow.training.SparseMLM` instead of ``model(**inputs)``. With
``num_items_in_batch`` (gradient accumulation over token counts) the loss is the summed
cross-entropy over it, as the model computes it when the Trainer passes that count to it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Trainer

from gradflow.adapters import Adapter
from gradflow.training.sparse import sparse_mlm


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
        """The sparse MLM loss of ``inputs`` (a collated MLM batch with ``labels``)."""
        sparse = sparse_mlm(self.accelerator.unwrap_model(model), block=self.sparse_block, adapter=self.sparse_adapter)
        inputs = dict(inputs)
        input_ids, labels = inputs.pop("input_ids"), inputs.pop("labels")
        out = sparse(input_ids, inputs.pop("attention_mask", None), labels, **inputs)
        loss = out.loss
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            loss = F.cross_entropy(out.logits, out.labels, reduction="sum") / num_items_in_batch
            if self.args.average_tokens_across_devices:
                loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        return (loss, out) if return_outputs else loss


__all__ = ["SparseMLMTrainer"]
