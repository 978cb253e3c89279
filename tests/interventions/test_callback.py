"""GradFlowCallback: logged gradient norms, per-role norms and drift equal direct computations; the log modes."""

from __future__ import annotations

import copy
import math
import warnings

import pandas as pd
import pytest
import torch

from conftest import SAMPLE_LINES
from gradflow import schema
from gradflow.hooks.recorder import GradFlowRecorder
from gradflow.inputs.masking import MaskedBatch, mlm_roles
from gradflow.interventions.callback import LOG_MODES, GradFlowCallback, _param_groups, _scalar_name, summary_scalars
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


def _train(tiny_mlm_dir, tmp_path, steps=3, every=2, accumulation=1, max_grad_norm=1.0, logging_steps=None,
           log="all"):
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
    callback = GradFlowCallback.attach(trainer, every=every, log=log)
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


@pytest.mark.parametrize(("log", "key"), [("all", "gradflow/blocks.1/grad_norm"),
                                          ("summary", "gradflow/last_block/grad_norm")])
def test_trainer_keeps_its_own_loss_log_on_logged_steps(tiny_mlm_dir, tmp_path, log, key):
    """Our trainer.log() must not swallow the Trainer's loss entry of the same step."""
    *_, trainer = _train(tiny_mlm_dir, tmp_path, steps=4, every=2, logging_steps=2, log=log)
    loss_steps = [h["step"] for h in trainer.state.log_history if "loss" in h]
    assert loss_steps == [2, 4]
    assert [h["step"] for h in trainer.state.log_history if key in h] == [1, 2, 4]


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


# ---------------------------------------------------------------------------------------- log modes
def _gradflow_logs(trainer) -> dict[int, dict]:
    """step -> the gradflow scalars that reached trainer.log at that step."""
    out = {}
    for entry in trainer.state.log_history:
        scalars = {k: v for k, v in entry.items() if k.startswith("gradflow/")}
        if scalars:
            assert entry["step"] not in out
            out[entry["step"]] = scalars
    return out


@pytest.fixture(scope="module")
def by_mode(trained, tiny_mlm_dir, tmp_path_factory):
    """The same seeded training under each log mode (``all`` is the ``trained`` fixture)."""
    runs = {"all": trained}
    for mode in ("summary", "none"):
        runs[mode] = _train(tiny_mlm_dir, tmp_path_factory.mktemp(f"cb-{mode}"), log=mode)
    return runs


def test_default_log_mode_is_summary():
    assert GradFlowCallback().log == "summary" and LOG_MODES == ("summary", "all", "none")
    with pytest.raises(ValueError, match="log must be one of"):
        GradFlowCallback(log="quiet")


def test_csv_is_identical_in_every_log_mode(by_mode):
    frames = {mode: pd.read_csv(run[2].csv_path) for mode, run in by_mode.items()}
    assert sorted(frames["all"].step.unique()) == [1, 2]
    for mode in ("summary", "none"):
        pd.testing.assert_frame_equal(frames[mode], frames["all"], check_exact=True)
        assert by_mode[mode][2].rows == by_mode["all"][2].rows


def test_log_none_sends_nothing_through_trainer_log(by_mode):
    assert _gradflow_logs(by_mode["none"][4]) == {}
    assert len(by_mode["none"][2].rows) == len(by_mode["all"][2].rows)  # ... while every row is kept and written


def test_log_all_sends_every_row_but_counts(by_mode):
    callback, trainer = by_mode["all"][2], by_mode["all"][4]
    logged = _gradflow_logs(trainer)
    assert sorted(logged) == [1, 2]
    for step, scalars in logged.items():
        rows = [r for r in callback.rows if r["step"] == step and r["quantity"] != "n_positions"]
        assert scalars == {_scalar_name(r): r["value"] for r in rows}
        assert len(scalars) == len(rows) > 20  # 33 on this 2-block model, about 150 on 6 blocks


def test_log_summary_sends_exactly_the_documented_scalars(by_mode):
    callback, trainer = by_mode["summary"][2], by_mode["summary"][4]
    logged = _gradflow_logs(trainer)
    frame = pd.read_csv(callback.csv_path)
    assert sorted(logged) == [1, 2]
    for step, scalars in logged.items():
        assert list(scalars) == list(schema.CALLBACK_SUMMARY_SCALARS)
        assert scalars == pytest.approx(summary_scalars(frame[frame.step == step].to_dict("records")))
        norms = _values(callback, step, "grad_norm")
        assert scalars["gradflow/grad_norm"] == pytest.approx(math.sqrt(sum(v * v for v in norms.values())))
        assert scalars["gradflow/last_block/grad_norm"] == norms["blocks.1"]
        assert scalars["gradflow/last_block/drift"] == _values(callback, step, "drift")["blocks.1"]
        # under the MLM loss the last block's output gets exactly nothing at context positions ...
        assert scalars["gradflow/last_block/context_share"] == 0.0
        assert scalars["gradflow/last_block/context_loss_ratio"] == 0.0
        # ... its K and V still do, and one block earlier context positions get a gradient
        assert 0 < scalars["gradflow/last_block/context_weight_share"] < 1
        assert scalars["gradflow/block_before_last/context_loss_ratio"] > 0


def test_summary_scalars_by_hand():
    def row(group, role, quantity, value):
        return {"step": 1, "group": group, "role": role, "quantity": quantity, "value": value}

    rows = [row("embeddings", "all", "grad_norm", 3.0), row("blocks.0-2", "all", "grad_norm", 4.0),
            row("other", "all", "grad_norm", 12.0), row("blocks.0-2", "all", "drift", 0.5)]
    for group, context in (("blocks.1", 1.0), ("blocks.2", 0.5)):
        rows += [row(group, "masked", "hidden_grad_mean", 2.0), row(group, "masked", "n_positions", 2.0),
                 row(group, "kept", "hidden_grad_mean", 5.0), row(group, "kept", "n_positions", 1.0),
                 row(group, "context", "hidden_grad_mean", context), row(group, "context", "n_positions", 6.0),
                 row(group, "masked", "grad_norm", 3.0), row(group, "context", "grad_norm", 4.0)]
    got = summary_scalars(rows)
    assert got == pytest.approx({
        "gradflow/grad_norm": 13.0, "gradflow/last_block/grad_norm": 4.0, "gradflow/last_block/drift": 0.5,
        "gradflow/last_block/context_share": 3.0 / (4.0 + 5.0 + 3.0),
        "gradflow/last_block/context_weight_share": 16.0 / 25.0,
        "gradflow/last_block/context_loss_ratio": 0.5 / 3.0,  # loss mean: (2 * 2 + 5 * 1) / 3
        "gradflow/block_before_last/context_loss_ratio": 1.0 / 3.0})
    assert set(got) == set(schema.CALLBACK_SUMMARY_SCALARS)
    whole_only = summary_scalars(rows[:3])  # roles="off", drift=False: the norms only
    assert whole_only == pytest.approx({"gradflow/grad_norm": 13.0, "gradflow/last_block/grad_norm": 4.0})
    assert summary_scalars([]) == {}


def test_log_mode_applies_without_attach(tiny_mlm_dir, tmp_path):
    """Added with add_callback (no trainer.log), the chosen scalars go to state.log_history."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_mlm_dir)
    logged = {}
    for mode in LOG_MODES:
        model = BertForMaskedLM.from_pretrained(tiny_mlm_dir)
        args = TrainingArguments(output_dir=str(tmp_path / mode), max_steps=1, per_device_train_batch_size=4,
                                 report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                                 logging_strategy="no", dataloader_num_workers=0, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=_dataset(tokenizer), processing_class=tokenizer,
                          data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3),
                          callbacks=[GradFlowCallback(every=1, log=mode)])
        trainer.train()
        logged[mode] = [{k for k in entry if k.startswith("gradflow/")} for entry in trainer.state.log_history]
        assert (tmp_path / mode / schema.CALLBACK_FILE).stat().st_size > 100
    assert logged["summary"][0] == set(schema.CALLBACK_SUMMARY_SCALARS)
    assert len(logged["all"][0]) > 20
    assert not any(logged["none"])


def test_more_than_one_process_is_said_once_to_be_rank_zeros_numbers(tmp_path):
    import types

    from tests.tiny import tiny_model

    model = tiny_model("bert")
    for world, warned in ((1, False), (2, True)):
        args = types.SimpleNamespace(world_size=world, output_dir=str(tmp_path / str(world)))
        state = types.SimpleNamespace(is_world_process_zero=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            GradFlowCallback(every=5).on_train_begin(args, state, None, model=model)
        said = [str(w.message) for w in seen if "GradFlowCallback on" in str(w.message)]
        assert len(said) == int(warned), said
        if warned:
            assert "rank 0's own numbers" in said[0] and "GradAccountingCallback" in said[0] and "\n" not in said[0]
