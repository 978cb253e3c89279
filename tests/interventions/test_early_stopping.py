"""Early stopping: the best checkpoint is kept and restored exactly, ties keep the earlier one, and a
fine-tuning run with ``patience`` scores the restored best checkpoint."""

from __future__ import annotations

import pytest
import torch

from gradflow.errors import GradflowError
from gradflow.interventions.finetune import finetune
from gradflow.interventions.finetune.early_stopping import BestCheckpoint
from test_finetune import SEQ_TASK, _config, _seq_rows, _splits


def test_best_checkpoint_restores_the_best_parameters_exactly():
    model = torch.nn.Linear(3, 2)
    keeper = BestCheckpoint("accuracy", patience=2)
    scores = [0.5, 0.7, 0.7, 0.6]  # best at step 2; the tie at step 3 keeps step 2; stop after step 4
    snapshots = {}
    stops = []
    for step, score in enumerate(scores, start=1):
        with torch.no_grad():
            model.weight.add_(1.0)
        snapshots[step] = model.weight.detach().clone()
        stops.append(keeper.update(model, step, {"accuracy": score}))
    assert stops == [False, False, False, True]
    assert (keeper.best_step, keeper.best_value, keeper.stopped_step) == (2, 0.7, 4)
    keeper.restore(model)
    assert torch.equal(model.weight, snapshots[2])


def test_patience_must_be_positive(tiny_mlm_dir):
    with pytest.raises(GradflowError, match="patience"):
        _config(tiny_mlm_dir, patience=0)


def test_finetune_with_patience_scores_the_best_checkpoint(tiny_mlm_dir):
    # a learning rate high enough to overshoot makes the validation score wander after its best
    result = finetune(_config(tiny_mlm_dir, steps=60, eval_every=5, lr=3e-2, patience=2), task=SEQ_TASK,
                      data=_splits(_seq_rows(64)))
    validation = [(r.step, r.metrics["accuracy"]) for r in result.history if r.split == "validation"]
    best_step, best = max(validation, key=lambda sv: (sv[1], -sv[0]))
    assert result.best_step == best_step
    assert result.final["validation"]["accuracy"] == pytest.approx(best)
    assert result.stopped_step == validation[-1][0] < 60  # this seed's curve plateaus: the run stops early
    assert result.stopped_step - result.best_step == 2 * 5
