"""Training masked LMs with the compute the analysis proves wasted left out (:mod:`gradflow.training.sparse`).

``sparse_mlm(model)``: the MLM head and the last block's query side at the loss positions only, the
same loss and gradients as the dense model; ``SparseMLMTrainer`` (``gradflow.training.trainer``,
loaded on first use: it imports transformers' Trainer): the same inside a Hugging Face Trainer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from gradflow.training.sparse import IGNORE, LossIndex, SparseMLM, SparseMLMOutput, loss_index, sparse_mlm

if TYPE_CHECKING:  # loads on first use (see __getattr__)
    from gradflow.training.trainer import SparseMLMTrainer


def __getattr__(name: str) -> object:
    """``SparseMLMTrainer`` on first use (it imports transformers' Trainer)."""
    if name == "SparseMLMTrainer":
        return importlib.import_module("gradflow.training.trainer").SparseMLMTrainer
    raise AttributeError(f"module 'gradflow.training' has no attribute {name!r}")


__all__ = ["IGNORE", "LossIndex", "SparseMLM", "SparseMLMOutput", "SparseMLMTrainer", "loss_index", "sparse_mlm"]
