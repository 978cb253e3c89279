"""Training-time gradient accounting (issue 62): 2 gloo ranks under DDP, DDP with accumulation and FSDP2 with
accumulation give the rows one process gives on the same global batch; the local-micro-batch-mean loss is flagged
with its scale; nothing runs at steps that are not logged; hooks never outlive a step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import accounting_worker as worker  # noqa: E402

from gradflow.interventions.accounting import ACCOUNTING_FILE, AccountingConfig, GradAccounting  # noqa: E402

KEYS = ["group", "role", "t_bin", "quantity"]
WHOLE = [slice(0, 8)]
HALVES = [slice(0, 4), slice(4, 8)]


def assert_same_rows(one: pd.DataFrame, many: pd.DataFrame, rtol: float = 1e-5) -> float:
    """The same (group, role, t_bin, quantity) rows, values to ``rtol``, exact zeros exact; the worst deviation."""
    merged = one.merge(many, on=KEYS, how="outer", suffixes=("_1", "_n"), indicator=True)
    assert (merged["_merge"] == "both").all(), merged[merged["_merge"] != "both"]
    x, y = merged["value_1"].to_numpy(np.float64), merged["value_n"].to_numpy(np.float64)
    assert np.array_equal(x == 0, y == 0)
    deviation = np.abs(x - y) / np.maximum(np.abs(x), 1e-30)
    assert deviation.max() <= rtol, merged.iloc[int(deviation.argmax())]
    return float(deviation.max())


@pytest.fixture(scope="module")
def reference() -> pd.DataFrame:
    return worker.one_process(WHOLE).frame()


def test_what_one_process_logs(reference):
    rows = reference.set_index(KEYS)["value"]
    assert set(reference.group) == {"model", "embeddings", "blocks.0", "blocks.1", "other"}
    assert {"prompt", "pad", "masked", "context"} <= set(reference.role)  # prompt and padding: roles of their own
    assert rows["blocks.1", "context", "", "hidden_grad_norm"] == 0  # past the last block's mixing: exactly zero
    assert rows["blocks.1", "pad", "", "hidden_grad_norm"] == 0
    assert rows["blocks.0", "prompt", "", "hidden_grad_norm"] > 0
    counts = reference[(reference.quantity == "n_positions") & (reference.group == "blocks.0")]
    by_role, by_t = counts[counts.t_bin == ""].value.sum(), counts[counts.t_bin != ""].value.sum()
    assert by_role == 8 * 12 and by_t == 8 * 12 - rows["blocks.0", "pad", "", "n_positions"]  # t rows: no padding
    assert rows["model", "all", "", "gradient_scale"] == pytest.approx(1.0, rel=1e-6)
    assert rows["model", "all", "", "loss_tokens"] == 24


def test_accumulation_in_one_process_equals_one_micro_batch(reference):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a global normaliser: no warning
        accumulated = worker.one_process(HALVES).frame()
    assert_same_rows(reference, accumulated)


def test_local_micro_batch_mean_is_flagged():
    with pytest.warns(UserWarning, match=r"2x what the objective's global-token normaliser gives .* accumulation"):
        accounting = worker.one_process(HALVES, normaliser="local")
    rows = accounting.frame().set_index(KEYS)["value"]
    assert rows["model", "all", "", "gradient_scale"] == pytest.approx(2.0, rel=1e-6)  # grad_accum x (1 rank)
    assert accounting.warned.count(". ") == 0  # one sentence


def test_nothing_runs_at_other_steps_and_hooks_are_removed():
    model = worker.tiny_model()
    accounting = GradAccounting(model, AccountingConfig(every=50))
    modules = list(model.modules())

    def hooks() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in modules)

    before = hooks()
    batch = worker.global_batch()
    with accounting.step(2):  # not logged: no hook, no capture, no row
        assert hooks() == before and not accounting.armed
        with accounting.micro_batch(batch["roles"], labels=batch["labels"]):
            model(input_ids=batch["input_ids"]).logits.sum().backward()
    assert accounting.rows == [] and hooks() == before
    with pytest.raises(RuntimeError, match="boom"), accounting.step(50):
        with accounting.micro_batch(batch["roles"], labels=batch["labels"]):
            assert hooks() > before
            raise RuntimeError("boom")
    assert hooks() == before and not accounting.armed and accounting.rows == []


def test_fsdp2_weight_gradients_are_left_alone_by_the_recorder(one_rank_group, reference):
    # an FSDP2 weight is swapped for a gathered copy at each forward: the recorder's split Linear must not run on it
    # (its gradient would be dropped: the node it checks never runs)
    from torch.distributed.fsdp import fully_shard

    model = worker.tiny_model()
    for layer in model.bert.encoder.layer:
        fully_shard(layer)
    fully_shard(model)
    accounting = GradAccounting(model, AccountingConfig(every=50, t_bins=worker.T_BINS, sublayers=True))
    worker.train_step(model, accounting, WHOLE, 1, "global")
    assert_same_rows(reference, accounting.frame())


@pytest.mark.slow
def test_two_ranks_equal_one_process_under_ddp_fsdp2_and_accumulation(tmp_path, reference):
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           "29781", str(Path(worker.__file__)), str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results) == {"ddp", "ddp_accumulation", "fsdp2_accumulation"}
    for name, rows in results.items():
        assert_same_rows(reference, pd.DataFrame(rows))



def trainer_rows(tmp_path: Path, accumulation: int, loss_kwargs: bool = True,
                 compute_loss_func=None) -> tuple[pd.DataFrame, list[dict]]:
    """One optimizer step of a Trainer over the 8-row global batch in ``accumulation`` micro-batches (each of 3
    loss tokens a row); ``loss_kwargs`` False: the Trainer divides each micro-batch's mean loss by the accumulation;
    ``compute_loss_func``: the Trainer's (it then takes the labels out of the model's inputs)."""
    from transformers import Trainer, TrainingArguments

    from gradflow.interventions.accounting_callback import GradAccountingCallback

    batch = worker.global_batch()
    data = [{k: batch[k][i] for k in ("input_ids", "attention_mask", "labels")} for i in range(8)]
    out = tmp_path / f"ga{accumulation}{loss_kwargs}{compute_loss_func is not None}"
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=8 // accumulation,
                             gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=1e-3,
                             report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, max_grad_norm=0.0,
                             disable_tqdm=True)
    trainer = Trainer(model=worker.tiny_model(), args=args, train_dataset=data, compute_loss_func=compute_loss_func)
    trainer.model_accepts_loss_kwargs = trainer.model_accepts_loss_kwargs and loss_kwargs
    callback = GradAccountingCallback.attach(trainer, every=50)
    trainer.train()
    frame = pd.read_csv(out / "gradflow_accounting.csv", keep_default_na=False)
    assert len(frame) == len(callback.accounting.rows) > 0 and callback._hook is None
    assert "compute_loss" not in vars(trainer)  # the callback's wrapper is gone after training
    return frame, [h["gradflow/gradient_scale"] for h in trainer.state.log_history if "gradflow/gradient_scale" in h]


def test_callback_audits_the_trainers_normalisation(tmp_path, reference):
    one, scale = trainer_rows(tmp_path, 1)
    assert scale == pytest.approx([1.0])
    whole = ["grad_norm", "gradient_scale", "loss_tokens"]  # (its roles come from labels alone: no prompt here)
    assert_same_rows(reference[reference.quantity.isin(whole)], one[one.quantity.isin(whole)])  # the plain loop's
    # transformers 5 passes num_items_in_batch to BertForMaskedLM, whose loss ignores it (a micro-batch mean): the
    # Trainer then leaves the loss undivided and the gradient doubles with 2 accumulation steps
    with pytest.warns(UserWarning, match="2x what the objective's global-token normaliser gives"):
        _, scale = trainer_rows(tmp_path, 2)
    assert scale == pytest.approx([2.0])
    divided, scale = trainer_rows(tmp_path, 2, loss_kwargs=False)  # mean / 2 over equal micro-batches: global
    assert scale == pytest.approx([1.0])
    assert_same_rows(one, divided)


def test_a_trainer_that_takes_the_labels_out_is_read_from_its_batch(tmp_path, recwarn):
    """``compute_loss_func`` makes the Trainer pop the labels before the forward: the attached callback reads them
    from the Trainer's batch and logs what the model's own loss gives (the same mean over the loss tokens)."""
    def token_mean(outputs, labels, num_items_in_batch=None):
        return torch.nn.functional.cross_entropy(outputs.logits.transpose(1, 2), labels)

    one, _ = trainer_rows(tmp_path, 1)
    popped, scale = trainer_rows(tmp_path, 1, compute_loss_func=token_mean)
    assert scale == pytest.approx([1.0]) and not [w for w in recwarn if "without labels" in str(w.message)]
    assert_same_rows(one, popped)


def test_a_forward_without_labels_is_warned_of_once():
    from gradflow.interventions.accounting_callback import GradAccountingCallback

    callback = GradAccountingCallback(every=1)
    batch = worker.global_batch()
    with pytest.warns(UserWarning, match="came without labels") as caught:
        for _ in range(2):
            assert callback._start_micro(None, (), {"input_ids": batch["input_ids"]}) is None
    assert len(caught) == 1 and callback._micro is None


def test_fsdp2_rmsnorm_model_keeps_its_norms_in_the_split(one_rank_group):
    # OLMoE's RMSNorms are split by role only after a probe of their forward, which cannot run on sharded weights:
    # the accounting probes them with gathered weights (without it the magnitudes lose the norms: 1.5% off)
    from torch.distributed.fsdp import fully_shard

    from tests.tiny import tiny_moe_model

    def rows(shard: bool) -> pd.DataFrame:
        model = tiny_moe_model("olmoe").train()
        if shard:
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        accounting = GradAccounting(model, AccountingConfig(every=50, sublayers=True))
        worker.train_step(model, accounting, WHOLE, 1, "global")
        return accounting.frame()

    whole, sharded = rows(False), rows(True)
    assert (whole.quantity == "magnitude_sum").sum() > 0
    assert_same_rows(whole, sharded)


@pytest.mark.slow
def test_trainer_callback_two_ranks_equal_one_process(tmp_path):
    # a real Trainer under torchrun, 2 gloo CPU ranks (DDP as the Trainer sets it up), the global batch in order
    import accounting_trainer_worker as trainer_worker

    out = tmp_path / "ranks"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           "29783", str(Path(trainer_worker.__file__)), str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, scale = trainer_rows(tmp_path, 1)
    assert scale == pytest.approx([1.0])
    gradient = one.quantity.isin(["grad_norm", "hidden_grad_norm", "hidden_grad_mean", "magnitude_sum",
                                  "gradient_scale"])
    assert gradient.sum() > 0 and (~gradient).sum() > 0  # counts (n_positions, loss_tokens) too
    for name, (accumulation, loss_kwargs) in trainer_worker.CASES.items():
        frame = pd.read_csv(out / name / ACCOUNTING_FILE, keep_default_na=False)
        ranks = [json.loads((out / name / f"rank{r}.json").read_text()) for r in range(2)]
        # the csv is rank 0's alone, once (a second writer would repeat the header and the rows)
        assert not frame.duplicated(["step", *KEYS]).any() and len(frame) == len(ranks[0]["rows"]) == len(one)
        assert (frame.step == 1).all() and {r["ddp"] for r in ranks} == {"DistributedDataParallel"}
        # accelerate deals the in-order per-device batches to the ranks in turn: rank r's micro-batches are the
        # global batch's k-th (k % 2 == r), together the whole global batch once, as one process sees it in a step
        size = worker.ROWS // 2 // accumulation
        dealt = [list(range(k * size, (k + 1) * size)) for k in range(2 * accumulation)]
        for r, rank in enumerate(ranks):
            assert rank["world"] == 2 and rank["micro_batches"] == dealt[r::2], (name, rank["micro_batches"])
        assert sorted(sum(ranks[0]["micro_batches"] + ranks[1]["micro_batches"], [])) == list(range(worker.ROWS))
        assert_same_rows(frame, pd.DataFrame(ranks[1]["rows"]))  # every rank makes the same rows
        # the audit's norm is the Trainer's own (its clip_grad_norm_ over DDP's averaged .grad, clipping off)
        norms = frame[frame.quantity == "grad_norm"].value.to_numpy()
        assert ranks[0]["trainer_grad_norms"] == pytest.approx([float(np.sqrt((norms ** 2).sum()))], rel=1e-5)
        if not loss_kwargs:
            # each micro-batch's mean over its 3 x rows loss tokens / accumulation, DDP's average over the ranks:
            # the global-token normaliser, the very gradient one process applies
            expected, factor = one, 1.0
            assert ranks[0]["warned"] is None
        else:
            # transformers multiplies the loss by the world size (average_tokens_across_devices: it expects the
            # loss over num_items_in_batch, the global count) but BertForMaskedLM ignores num_items_in_batch and
            # returns each micro-batch's mean, which the Trainer then leaves undivided by the accumulation: the
            # gradient and every gradient-derived quantity is world x accumulation times one process's, the counts
            # are the same; the callback reports that scale and warns of it
            factor = 2.0 * accumulation
            expected = one.assign(value=one.value.where(~gradient, one.value * factor))
            assert f"{factor:g}x" in ranks[0]["warned"] and "2 rank(s)" in ranks[0]["warned"]
        assert_same_rows(expected, frame)
        for rank in ranks:
            assert rank["scales"] == pytest.approx([factor], rel=1e-6)
