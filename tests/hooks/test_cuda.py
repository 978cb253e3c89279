"""CUDA readiness: the exactness suite, bfloat16/float16 recording, the Trainer callback and NCCL, on a GPU.

Every test here needs a CUDA device and skips with its reason without one (``-m cuda`` selects
them; ``benchmarks/gpu_checklist.py`` runs them). The exactness tests are the CPU suite's own
functions (``test_recorder_families``) run on this module's ``family_run``, whose model and batch
sit on the GPU; the others reuse the CPU tests' helpers.

Tolerances of the reduced-precision tests, against a float32 recording of the same weights and
batch, relative to the largest value of each compared group: bfloat16 5e-2 (about 13 times its unit
roundoff 2^-8, for three blocks of forward and backward; measured under 1e-2 on a CPU), float16
1e-2 (about 20 times 2^-11; measured under 1.2e-3 on a CPU). Exact zeros are compared exactly: they
are structural (no arithmetic reaches them) in every precision.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from gradflow import GradFlowRecorder, mlm_loss
from gradflow.roles import Role
from test_callback import _dataset, _direct, _Spy, _values
from test_distributed import ENV, assert_same_tables
from test_recorder_core import _hook_counts
from test_recorder_families import (  # noqa: F401  (collected here, on the GPU)
    _record,
    test_last_block_context_contributions,
    test_last_block_output_gradient_is_exactly_zero_off_loss,
    test_role_contributions_sum_to_autograd_grad,
    test_site_norms_match_hidden_states,
)
from tiny import FAMILIES, tiny_batch, tiny_model

pytestmark = pytest.mark.cuda
REDUCED = {"bfloat16": (torch.bfloat16, 5e-2), "float16": (torch.float16, 1e-2)}
"""Reduced precision -> (dtype, tolerance relative to the largest value of a compared group)."""


def cuda_or_reason() -> str | None:
    """None where a CUDA device is usable, else why not (the skip reason)."""
    if not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, {built})"
    return None


@pytest.fixture(scope="module")
def cuda() -> torch.device:
    """The first CUDA device, float32 kept exact (no TF32 in matmuls or convolutions); skips without one."""
    reason = cuda_or_reason()
    if reason:
        pytest.skip(reason)
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.fixture(scope="module", params=FAMILIES)
def family_run(request, cuda):
    """As in test_recorder_families, recorded on the GPU: (family, model, batch, materialised record).

    The recorder hands its results over on the CPU; its site norms and matrices are moved back to the
    GPU (losslessly) for the CPU tests to compare them with the model's own tensors there."""
    model = tiny_model(request.param).to(cuda)
    batch = tiny_batch().to(cuda)
    record = _record(model, batch, materialize=True)
    on_gpu = dataclasses.replace(record, grad_norm=record.grad_norm.to(cuda), act_norm=record.act_norm.to(cuda),
                                 matrices={key: m.to(cuda) for key, m in record.matrices.items()})
    return request.param, model, batch, on_gpu


def test_hooks_removed_on_cuda(cuda):
    model = tiny_model("bert").to(cuda)
    batch = tiny_batch().to(cuda)
    model(**batch.model_inputs(), output_hidden_states=True)  # let transformers add its own hooks first
    before = _hook_counts(model)
    with GradFlowRecorder(model) as rec:
        assert _hook_counts(model) != before
        rec.record(batch)
    assert _hook_counts(model) == before
    with pytest.raises(ZeroDivisionError):
        with GradFlowRecorder(model) as rec:
            with rec.capture(batch.roles):
                mlm_loss(model(**batch.model_inputs()).logits, batch).backward()
                1 / 0
    assert _hook_counts(model) == before


def _assert_close_by_group(got, want, tol: float, scale: float = 1.0) -> None:
    """Sublayer frames equal to ``tol`` x the largest norm of each (layer, sublayer, param); zeros exactly."""
    key = ["layer", "sublayer", "param", "role"]
    a, b = got.set_index(key).sort_index(), want.set_index(key).sort_index()
    assert a.index.equals(b.index)
    x, y = a.contribution_norm.to_numpy() / scale, b.contribution_norm.to_numpy()
    np.testing.assert_array_equal(x == 0, y == 0)
    largest = b.contribution_norm.groupby(level=["layer", "sublayer", "param"]).transform("max").to_numpy()
    assert np.all(np.abs(x - y) <= tol * np.maximum(largest, 1e-30))


def _assert_sites_close(got, want, sites, tol: float, scale: float = 1.0) -> None:
    for site in sites:
        g, g0 = got.site(site)[0].float().cpu() / scale, want.site(site)[0].float().cpu()
        assert torch.equal(g == 0, g0 == 0), site
        assert float((g - g0).abs().max()) <= tol * float(g0.max()), site


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_bfloat16_weights_record_close_to_float32(cuda, family):
    """As `gradflow record --dtype bfloat16`: weights in bfloat16, against float32 on the same (rounded) weights."""
    batch = tiny_batch().to(cuda)
    low = tiny_model(family).to(cuda, torch.bfloat16)
    high = copy.deepcopy(low).float()
    with GradFlowRecorder(low) as rec:
        got = rec.record(batch)
    with GradFlowRecorder(high) as rec:
        want = rec.record(batch)
    last = got.num_blocks - 1
    grad, roles = got.site(f"blocks.{last}.out")[0], batch.roles.cpu()  # records come back on the CPU
    assert torch.all(grad[roles == Role.CONTEXT] == 0) and torch.all(grad[roles == Role.MASKED] > 0)
    _assert_sites_close(got, want, ["embeddings.out", "blocks.0.out", f"blocks.{last}.out"], REDUCED["bfloat16"][1])
    _assert_close_by_group(got.sublayer_frame(), want.sublayer_frame(), REDUCED["bfloat16"][1])


@pytest.mark.parametrize("precision", list(REDUCED))
def test_autocast_with_a_loss_scaler_records_the_scaled_gradient(cuda, precision):
    """A mixed-precision training step (float32 weights, autocast, GradScaler) in capture mode: the record is
    the gradient of the scaled loss, so divided by the scale it equals the float32 record (to the tolerance)."""
    dtype, tol = REDUCED[precision]
    model = tiny_model("bert").to(cuda)
    batch = tiny_batch().to(cuda)
    with GradFlowRecorder(model) as rec:
        want = rec.record(batch)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10)
    model.zero_grad(set_to_none=True)
    with GradFlowRecorder(model) as rec:
        with rec.capture(batch.roles):
            with torch.autocast("cuda", dtype=dtype):
                loss = mlm_loss(model(**batch.model_inputs()).logits, batch)
            scaler.scale(loss).backward()
        got = rec.result()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)  # no overflow
    scale = float(scaler.get_scale())
    _assert_sites_close(got, want, ["embeddings.out", "blocks.0.out", "blocks.2.out"], tol, scale)
    _assert_close_by_group(got.sublayer_frame(), want.sublayer_frame(), tol, scale)


def test_callback_in_a_trainer_step_on_cuda(cuda, tiny_mlm_dir, tmp_path):
    from transformers import AutoTokenizer, BertForMaskedLM, DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from gradflow.interventions.callback import GradFlowCallback

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_mlm_dir)
    model = BertForMaskedLM.from_pretrained(tiny_mlm_dir, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-3, report_to=[], use_cpu=False, save_strategy="no", disable_tqdm=True,
                             logging_strategy="no", dataloader_num_workers=0, seed=0)
    if args.n_gpu > 1:
        args._n_gpu = 1  # one GPU: no DataParallel wrapper (torchrun is the multi-GPU path, tested below)
    trainer = Trainer(model=model, args=args, train_dataset=_dataset(tokenizer), processing_class=tokenizer,
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3))
    spy = _Spy(model)
    trainer.add_callback(spy)
    callback = GradFlowCallback.attach(trainer, every=1, log="all")
    trainer.train()
    assert next(model.parameters()).device.type == "cuda"
    assert sorted({r["step"] for r in callback.rows}) == [1, 2]
    for step in (1, 2):
        direct, _ = _direct(model, spy.weights[step], spy.inputs[step])
        logged = _values(callback, step, "grad_norm")
        assert set(logged) == set(direct) == {"embeddings", "blocks.0", "blocks.1", "other"}
        for name, value in direct.items():
            assert logged[name] == pytest.approx(value, rel=1e-4, abs=1e-9), (step, name)  # GPU reduction order


def test_torchrun_two_processes_on_nccl(cuda, tmp_path, tiny_mlm_dir, tiny_corpus):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"torchrun on NCCL needs 2 GPUs; this machine has {torch.cuda.device_count()}")
    env = {k: v for k, v in ENV.items() if k != "GRADFLOW_BACKEND"}  # CUDA processes pick NCCL themselves
    common = ["record", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--max-length", "24",
              "--batch-size", "3", "--quiet", "--device", "cuda"]
    one, two = tmp_path / "one", tmp_path / "two"
    for cmd in ([sys.executable, "-m", "gradflow", *common, "--out", str(one)],
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29733",
                 "-m", "gradflow", *common, "--out", str(two)]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    # a sequence is computed in a batch of another composition on each side: cuBLAS may sum it in another order
    assert_same_tables(one, two, rtol=1e-5)


def test_torchrun_fsdp2_two_gpus_on_nccl(cuda, tmp_path, tiny_mlm_dir, tiny_corpus):
    """Issue 62's checklist step: ``record --shard fsdp2`` on 2 GPUs (NCCL) gives the one-process tables, and
    ``meta.json`` says the sharding and the world size."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"FSDP2 on NCCL needs 2 GPUs; this machine has {torch.cuda.device_count()}")
    env = {k: v for k, v in ENV.items() if k != "GRADFLOW_BACKEND"}
    common = ["record", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--max-length", "24",
              "--batch-size", "3", "--quiet", "--device", "cuda"]
    one, two = tmp_path / "one", tmp_path / "two"
    for cmd in ([sys.executable, "-m", "gradflow", *common, "--out", str(one)],
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29735",
                 "-m", "gradflow", *common, "--shard", "fsdp2", "--out", str(two)]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_tables(one, two, rtol=1e-5)
    sharding = json.loads((two / "meta.json").read_text())["sharding"]
    assert sharding["kind"] == "fsdp2" and sharding["world_size"] == 2
