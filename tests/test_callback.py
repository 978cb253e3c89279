"""GradFlowCallback: logged gradient norms, per-role norms and drift equal direct computations."""

from __future__ import annotations

import copy
import math

import pandas as pd
import pytest
import torch

from conftest import SAMPLE_LINES
from gradflow import schema
from gradflow.hooks.recorder import GradFlowRecorder
from gradflow.inputs.masking import MaskedBatch, mlm_roles
from gradflow.interventions.callback import GradFlowCallback, _param_groups
from gradflow.roles import Role

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
from transformers import (  # noqa: E402
    AutoTokenizer,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


class _Spy(TrainerCallback):
    """Snapshots the weights at each step's start and the inputs of each forward."""

    def __init__(self, model):
        self.weights: dict[int, dict] = {}
        self.inputs: dict[int, list[dict]] = {}
        self.grads: dict[int, dict] = {}
        self.step = 0
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.step = state.global_step + 1
        self.weights[self.step] = copy.deepcopy(model.state_dict())

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads[self.step] = {id(p): p.grad.detach().clone() for p in model.parameters() if p.grad is not None}

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.weights[state.global_step + 1] = copy.deepcopy(model.state_dict())

    def _hook(self, module, args, kwargs):
        if module.training:
            self.inputs.setdefault(self.step, []).append({k: v.detach().clone() for k, v in kwargs.items()
                                                          if isinstance(v, torch.Tensor)})


def _dataset(tokenizer):
    return [tokenizer(line, truncation=True, max_length=32) for line in SAMPLE_LINES * 4]


def _train(tiny_mlm_dir, tmp_path, steps=3, every=2, accumulation=1, max_grad_norm=1.0, logging_steps=None):
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_mlm_dir)
    model = BertForMaskedLM.from_pretrained(tiny_mlm_dir, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=accumulation, learning_rate=1e-3, report_to=[],
                             max_grad_norm=max_grad_norm,
                             use_cpu=True, save_strategy="no", disable_tqdm=True,
                             logging_strategy="steps" if logging_steps else "no", logging_steps=logging_steps or 500,
                             dataloader_num_workers=0, seed=0)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3)
    trainer = Trainer(model=model, args=args, train_dataset=_dataset(tokenizer), data_collator=collator,
                      processing_class=tokenizer)
    spy = _Spy(model)
    trainer.add_callback(spy)
    callback = GradFlowCallback.attach(trainer, every=every)
    trainer.train()
    return model, tokenizer, callback, spy, trainer


def _direct(model, weights, micro_batches):
    """Per-group gradient norms of the summed micro-batch losses, from a fresh copy of ``model``."""
    clone = copy.deepcopy(model)
    clone.load_state_dict(weights)
    clone.train()
    clone.zero_grad()
    for inputs in micro_batches:
        (clone(**inputs).loss / len(micro_batches)).backward()
    return {g.name: math.sqrt(sum(float(p.grad.pow(2).sum()) for p in g.params if p.grad is not None))
            for g in _param_groups(clone)}, clone


def _values(callback, step, quantity, role="all"):
    return {r["group"]: r["value"] for r in callback.rows
            if r["step"] == step and r["quantity"] == quantity and r["role"] == role}


@pytest.fixture(scope="module")
def trained(tiny_mlm_dir, tmp_path_factory):
    return _train(tiny_mlm_dir, tmp_path_factory.mktemp("cb"))


def test_grad_norms_equal_direct_computation(trained):
    model, _, callback, spy, _ = trained
    assert sorted({r["step"] for r in callback.rows}) == [1, 2]
    for step in (1, 2):
        direct, _ = _direct(model, spy.weights[step], spy.inputs[step])
        logged = _values(callback, step, "grad_norm")
        assert set(logged) == set(direct) == {"embeddings", "blocks.0", "blocks.1", "other"}
        for name, value in direct.items():
            assert logged[name] == pytest.approx(value, rel=1e-5, abs=1e-9), (step, name)


def test_per_role_norms_equal_recorder_on_same_batch(trained):
    model, tokenizer, callback, spy, _ = trained
    step = 2
    inputs = spy.inputs[step][0]
    clone = copy.deepcopy(model)
    clone.load_state_dict(spy.weights[step])
    clone.train()
    roles = mlm_roles(inputs["input_ids"], inputs["labels"], inputs["attention_mask"], tokenizer.mask_token_id,
                      tuple(tokenizer.all_special_ids))
    batch = MaskedBatch(inputs["input_ids"], inputs["input_ids"], inputs["labels"], roles, inputs["attention_mask"],
                        torch.arange(roles.shape[0]))
    with GradFlowRecorder(clone) as rec:
        record = rec.record(batch, loss="mlm")
    frame = record.sublayer_frame()
    expected = (frame.assign(sq=frame.contribution_norm ** 2).groupby(["layer", "role"])["sq"].sum() ** 0.5)
    for (layer, role), value in expected.items():
        logged = _values(callback, step, "grad_norm", role)[f"blocks.{layer - 1}"]
        assert logged == pytest.approx(value, rel=1e-4, abs=1e-10), (layer, role)
    # the last block's after-mixing sublayers get nothing from context positions: the claim itself
    last = frame[(frame.layer == 2) & (frame.role == "context") & (frame.sublayer == "ffn.out")]
    assert float(last.contribution_norm.max()) == 0.0
    grad_out, _ = record.site("blocks.0.out")
    ctx = roles == Role.CONTEXT
    assert _values(callback, step, "hidden_grad_mean", "context")["blocks.0"] == pytest.approx(
        float(grad_out[ctx].mean()), rel=1e-5)


def test_drift_equals_direct(trained):
    model, _, callback, spy, _ = trained
    initial, after = spy.weights[1], spy.weights[3]  # weights before step 1, after step 2
    groups = _param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    logged = _values(callback, 2, "drift")
    for g in groups:
        keys = [names[id(p)] for p in g.params]
        diff = sum(float((after[k] - initial[k]).pow(2).sum()) for k in keys)
        ref = sum(float(initial[k].pow(2).sum()) for k in keys)
        assert logged[g.name] == pytest.approx(math.sqrt(diff / ref), rel=1e-5)
    assert all(v > 0 for v in logged.values())


def test_csv_and_trainer_log(trained):
    _, _, callback, _, trainer = trained
    frame = pd.read_csv(callback.csv_path)
    assert callback.csv_path.name == schema.CALLBACK_FILE
    assert tuple(frame.columns) == schema.CALLBACK_COLUMNS
    assert all(tuple(row) == schema.CALLBACK_COLUMNS for row in callback.rows)
    assert len(frame) == len(callback.rows)
    assert set(frame.quantity) == set(schema.CALLBACK_QUANTITIES)
    logged = [h for h in trainer.state.log_history if "gradflow/blocks.1/grad_norm" in h]
    assert [h["step"] for h in logged] == [1, 2]
    assert "gradflow/blocks.1/grad_norm/masked" in logged[0]


def test_trainer_keeps_its_own_loss_log_on_logged_steps(tiny_mlm_dir, tmp_path):
    """Our trainer.log() must not swallow the Trainer's loss entry of the same step."""
    *_, trainer = _train(tiny_mlm_dir, tmp_path, steps=4, every=2, logging_steps=2)
    loss_steps = [h["step"] for h in trainer.state.log_history if "loss" in h]
    assert loss_steps == [2, 4]
    assert [h["step"] for h in trainer.state.log_history if "gradflow/blocks.1/grad_norm" in h] == [1, 2, 4]


def test_gradient_accumulation_sums_micro_batches(tiny_mlm_dir, tmp_path):
    """With accumulation the logged norm is that of the summed gradient the optimizer steps with
    (no clipping here, so ``.grad`` before the step is that very gradient)."""
    model, _, callback, spy, _ = _train(tiny_mlm_dir, tmp_path, steps=1, every=1, accumulation=2, max_grad_norm=0.0)
    assert len(spy.inputs[1]) == 2
    logged = _values(callback, 1, "grad_norm")
    for g in _param_groups(model):
        value = math.sqrt(sum(float(spy.grads[1][id(p)].pow(2).sum()) for p in g.params if id(p) in spy.grads[1]))
        assert logged[g.name] == pytest.approx(value, rel=1e-5), g.name
    assert {r["role"] for r in callback.rows if r["quantity"] == "grad_norm"} > {"all", "masked", "context"}


def test_param_groups_name_a_shared_layer_by_its_depth_range():
    from gradflow.hooks.sites import parse_block_group
    from tiny import tiny_model

    groups = [g.name for g in _param_groups(tiny_model("albert"))]
    assert groups == ["embeddings", "blocks.0-2", "other"]
    assert parse_block_group("blocks.0-2") == (0, 2)
    assert [g.name for g in _param_groups(tiny_model("bert"))] == ["embeddings", "blocks.0", "blocks.1", "blocks.2",
                                                                   "other"]
