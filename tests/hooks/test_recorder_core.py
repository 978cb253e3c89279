"""Recorder hygiene and modes: hooks removed, memory flat, bf16, train mode, ALBERT, DeBERTa relpos."""

from __future__ import annotations

import gc
import resource

import pytest
import torch

from gradflow import GradFlowRecorder, RecorderConfig, RecorderError, mlm_loss
from gradflow.adapters import UnsupportedArchitectureError, adapter_for
from gradflow.roles import Role
from tiny import tiny_batch, tiny_model


def _hook_counts(model):
    return [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()]


def test_hooks_removed_after_recording_and_on_exception():
    model = tiny_model("bert")
    batch = tiny_batch()
    model(**batch.model_inputs(), output_hidden_states=True)  # let transformers add its own hooks first
    before = _hook_counts(model)
    with GradFlowRecorder(model) as rec:
        assert _hook_counts(model) != before
        rec.record(batch)
    assert _hook_counts(model) == before
    with pytest.raises(ZeroDivisionError):
        with GradFlowRecorder(model) as rec:
            with rec.capture(batch.roles):
                model(**batch.model_inputs())
                1 / 0
    assert _hook_counts(model) == before
    # an exception raised inside a hook (roles of another batch) also leaves nothing behind
    with pytest.raises(RecorderError, match="roles have shape"):
        with GradFlowRecorder(model) as rec:
            with rec.capture(torch.zeros(1, 2, dtype=torch.int8)):
                out = model(**batch.model_inputs())
                mlm_loss(out.logits, batch).backward()
    assert _hook_counts(model) == before


def test_capture_mode_equals_record_mode_and_fills_grad():
    model = tiny_model("roberta")
    batch = tiny_batch()
    with GradFlowRecorder(model) as rec:
        a = rec.record(batch)
        assert all(p.grad is None for p in model.parameters())
        with rec.capture(batch.roles):
            mlm_loss(model(**batch.model_inputs()).logits, batch).backward()
        b = rec.result()
    assert any(p.grad is not None for p in model.parameters())
    torch.testing.assert_close(a.grad_norm, b.grad_norm, rtol=1e-5, atol=1e-10)
    fa, fb = a.sublayer_frame(), b.sublayer_frame()
    torch.testing.assert_close(torch.tensor(fa.contribution_norm.values), torch.tensor(fb.contribution_norm.values),
                               rtol=1e-4, atol=1e-12)


@pytest.mark.slow
def test_memory_flat_over_200_batches():
    model = tiny_model("bert")
    batch = tiny_batch(t=32, b=4)

    def live_tensors():
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))

    with GradFlowRecorder(model) as rec:
        for _ in range(20):
            rec.record(batch)
        tensors0 = live_tensors()
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(200):
            rec.record(batch)
        tensors1 = live_tensors()
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert tensors1 <= tensors0
    assert rss1 - rss0 < 20_000  # KiB: no growth beyond allocator noise


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_bfloat16_and_train_mode_keep_the_exact_zero(family):
    batch = tiny_batch()
    for dtype, train in ((torch.bfloat16, False), (torch.float32, True)):
        model = tiny_model(family, hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3).to(dtype)
        model.train(train)
        with GradFlowRecorder(model) as rec:
            record = rec.record(batch)
        grad, _ = record.site(f"blocks.{record.num_blocks - 1}.out")
        assert torch.all(grad[batch.roles == Role.CONTEXT] == 0)
        assert torch.all(grad[batch.roles == Role.MASKED] > 0)
        frame = record.sublayer_frame()
        last = frame[(frame.layer == record.num_blocks) & (frame.role == "context")]
        assert (last[last.sublayer.isin(["attn.q", "attn.out", "ffn.in", "ffn.out"])].contribution_norm == 0).all()


def test_albert_shared_layer_per_depth_and_in_aggregate():
    model = tiny_model("albert")
    batch = tiny_batch()
    with GradFlowRecorder(model, RecorderConfig(materialize=True)) as rec:
        record = rec.record(batch)
    assert record.num_blocks == 3
    last = record.num_blocks - 1
    # per depth: the last application of the shared layer gets nothing from context channels
    assert torch.count_nonzero(record.matrices[(last, "ffn.in", "weight", "context")]) == 0
    # in aggregate: the shared weight IS trained on context channels, by the earlier applications
    shared = sum(record.matrices[(d, "ffn.in", "weight", "context")] for d in range(record.num_blocks))
    assert float(shared.norm()) > 0


def test_deberta_relative_position_share_is_its_own_role():
    model = tiny_model("deberta-v2")
    batch = tiny_batch()
    with GradFlowRecorder(model) as rec:
        record = rec.record(batch)
    frame = record.sublayer_frame()
    relpos = frame[(frame.role == "relpos") & (frame.param == "weight")]
    assert set(relpos.sublayer) == {"attn.q", "attn.k"}
    assert (relpos.contribution_norm > 0).all()
    assert not (frame[frame.role == "relpos"].sublayer.isin(["attn.v", "ffn.in"])).any()


def test_unknown_architecture_error_names_families_and_registration():
    class Fake(torch.nn.Module):
        class config:
            model_type = "mystery"

    with pytest.raises(UnsupportedArchitectureError, match="register_adapter") as err:
        adapter_for(Fake())
    assert "bert" in str(err.value) and "modernbert" in str(err.value)


def test_recorder_errors_are_clear():
    model = tiny_model("bert")
    rec = GradFlowRecorder(model)
    with pytest.raises(RecorderError, match="context manager"):
        with rec.capture(tiny_batch().roles):
            pass
    with GradFlowRecorder(model) as rec:
        with pytest.raises(RecorderError, match="nothing captured"):
            rec.result()


def test_two_forwards_in_one_capture_are_refused_and_hooks_removed():
    model = tiny_model("albert")  # shared layer: the site layer's depth stack restarts at every forward
    batch = tiny_batch()
    before = _hook_counts(model)
    with pytest.raises(RecorderError, match="embeddings.out ran twice"):
        with GradFlowRecorder(model) as rec:
            with rec.capture(batch.roles):
                model(**batch.model_inputs())
                model(**batch.model_inputs())
    assert _hook_counts(model) == before
    with GradFlowRecorder(model) as rec:  # forwards outside a capture are ignored
        model(**batch.model_inputs())
        record = rec.record(batch)
    assert record.site_names == ("embeddings.out", *[f"blocks.{i}.{p}" for i in range(3) for p in ("mid", "out")])
    assert bool((record.act_norm > 0).all())


def test_recorder_module_exports():
    from gradflow.hooks import recorder
    from gradflow.schema import PARAMS

    assert recorder.PARAMS == PARAMS == ("weight", "bias")
    for name in ("GradFlowRecorder", "RecorderConfig", "BatchRecord", "SublayerRecord", "RecorderError"):
        assert hasattr(recorder, name), name
