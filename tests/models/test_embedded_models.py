"""The embedded models load offline by name, predict held-out text, and show the structural zero: the core pair
(in the gradflow package) and the companion's (gradflow-models, which ./setup.sh installs editable beside it)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
import torch

from gradflow import GradFlowRecorder, mask_batch
from gradflow.inputs.masking import BertMasking
from gradflow.models import CORE_MODELS, EMBEDDED_MODELS, embedded_model_dir, installed_embedded_models, load_model
from gradflow.roles import Role
from gradflow.runs.evaluation import mlm_accuracy
from gradflow.runs.record import default_texts

SHIPPED = all((embedded_model_dir(n) / "model.safetensors").exists() for n in CORE_MODELS)
pytestmark = pytest.mark.skipif(not SHIPPED, reason="embedded model weights not in this checkout")
MARGIN = 0.02


def _card(name: str) -> dict:
    return json.loads((embedded_model_dir(name) / "recipe.json").read_text())


def _reported(name: str) -> float:
    """The committed-sample top-1 reported when the model was shipped: its card's (a resumable-recipe model,
    analyses/pretraining/ship_base.py), else figures/pretraining_accuracy.json (the 6-block pair)."""
    if "held_out" in _card(name):
        return _card(name)["held_out"]["sample_top1"]
    root = Path(__file__).resolve().parents[2]
    return json.loads((root / "figures" / "pretraining_accuracy.json").read_text())[name]["sample_top1"]


def _layers(name: str) -> int:
    """The documented depth: the card's shape, else the 6-block pair's 6 (README, docs/reference/models.md)."""
    return _card(name)["shape"]["layers"] if "shape" in _card(name) else 6


def test_every_embedded_model_is_installed():
    """A checkout set up by ./setup.sh has the companion too, so every model of the family is tested below."""
    assert installed_embedded_models() == list(EMBEDDED_MODELS), "re-run ./setup.sh (it installs gradflow-models)"


def _model(name: str):
    """A companion model skips, with the reason, where the companion is not installed (the test above fails then)."""
    missing = name not in CORE_MODELS and name not in installed_embedded_models()
    return pytest.param(name, marks=pytest.mark.skipif(missing, reason="the companion gradflow-models is not installed"))


@pytest.fixture(scope="module", params=[_model(name) for name in sorted(EMBEDDED_MODELS)])
def loaded(request, monkeypatch_module):
    return load_model(request.param)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    yield mp
    mp.undo()


def test_loads_offline_by_name(loaded):
    assert loaded.adapter.family == "bert"
    assert len(loaded.tokenizer) == loaded.model.config.vocab_size
    assert loaded.model.config.num_hidden_layers == _layers(loaded.name)


@pytest.mark.slow
def test_heldout_accuracy_at_least_reported(loaded):
    acc = mlm_accuracy(loaded, default_texts(), BertMasking(seed=0), limit=256)
    reported = _reported(loaded.name)
    assert acc.top1 >= reported - MARGIN, (loaded.name, acc)
    assert acc.top1 > 20 / len(loaded.tokenizer)  # far above chance: random weights fail this


def test_random_weights_fail_the_accuracy_bar(loaded):
    from transformers import AutoModelForMaskedLM

    torch.manual_seed(0)
    random_model = AutoModelForMaskedLM.from_config(loaded.model.config).eval()
    shuffled = type(loaded)(random_model, loaded.tokenizer, "random", loaded.path, loaded.adapter, "")
    acc = mlm_accuracy(shuffled, default_texts(), BertMasking(seed=0), limit=64)
    assert acc.top1 < _reported(loaded.name) - MARGIN


def test_own_training_loss_zero_or_not(loaded):
    texts = [line for line in resources.files("gradflow").joinpath("data/sotu_sample.txt").read_text().splitlines()][:2]
    batch = mask_batch(loaded.tokenizer, [t[:400] for t in texts], BertMasking(seed=0))
    loss = "all-positions" if loaded.name.endswith("alltoken") else "mlm"
    with GradFlowRecorder(loaded.model) as rec:
        record = rec.record(batch, loss=loss)
    grad, _ = record.site(f"blocks.{record.num_blocks - 1}.out")
    context = grad[batch.roles == Role.CONTEXT]
    if loss == "mlm":
        assert torch.all(context == 0)
    else:
        assert torch.all(context > 0)
