"""Early stopping on the evaluation split, keeping the best checkpoint in memory (CPU copy)."""

from __future__ import annotations

import math

import torch
from torch import nn


class BestCheckpoint:
    """The parameters of the best evaluation so far and the evaluations since it improved.

    ``metric``: the name in the evaluation metrics to maximise (``accuracy``, ``entity_f1``);
    ``patience``: stop after this many evaluations in a row without a strictly better score.
    Ties keep the earlier checkpoint.
    """

    def __init__(self, metric: str, patience: int):
        if patience < 1:
            raise ValueError(f"patience must be >= 1 evaluation, got {patience}")
        self.metric, self.patience = metric, patience
        self.best_value = -math.inf
        self.best_step: int | None = None
        self.stopped_step: int | None = None
        self.since_best = 0
        self._state: dict[str, torch.Tensor] | None = None

    def update(self, model: nn.Module, step: int, metrics: dict[str, float]) -> bool:
        """Fold in one evaluation at ``step``; True when training should stop now."""
        value = metrics[self.metric]
        if value > self.best_value:
            self.best_value, self.best_step, self.since_best = value, step, 0
            self._state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            return False
        self.since_best += 1
        if self.since_best >= self.patience:
            self.stopped_step = step
            return True
        return False

    def restore(self, model: nn.Module) -> None:
        """Load the best checkpoint's parameters back into ``model`` (nothing if none was kept)."""
        if self._state is not None:
            model.load_state_dict(self._state)


__all__ = ["BestCheckpoint"]
