"""The recorder under the objectives beyond BERT's: the per-role split sums to autograd, the exact zero holds at
every masking ratio of a grid, and under a shift it sits at the positions that carry no loss, whatever their input."""

from __future__ import annotations

import pytest
import torch

from gradflow import GradFlowRecorder, RecorderConfig
from gradflow.adapters import adapter_for
from gradflow.inputs.masking import BertMasking, MaskedDiffusion, SpanMasking, mask_batch
from gradflow.losses import get_loss
from gradflow.roles import Role

TEXTS = ["The progress of public credit is witnessed by a considerable rise of American stock abroad.",
         "We must ensure that the laws are faithfully executed.",
         "Congress will consider the state of the treasury and the revenues of the nation this year."]
GRID = (0.05, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0)
NON_LOSS = (Role.CONTEXT, Role.SPECIAL, Role.PAD)


@pytest.fixture(scope="module")
def loaded(tiny_mlm_dir):
    from gradflow.models import load_model

    return load_model(str(tiny_mlm_dir))


def _record(model, batch, reduction="sequence"):
    with GradFlowRecorder(model, RecorderConfig(materialize=True)) as rec:
        return rec.record(batch, reduction=reduction)


def _assert_split_sums_to_autograd(model, batch, record, reduction):
    """Every split sublayer's role matrices, summed, against autograd's gradient of the same loss."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for p in model.parameters()]
    value = get_loss("mlm", reduction)(model(**batch.model_inputs()).logits, batch)
    torch.testing.assert_close(torch.tensor(record.loss), value.detach(), rtol=1e-6, atol=0)
    grads = dict(zip((names[id(p)] for p in params), torch.autograd.grad(value, params, allow_unused=True)))
    adapter = adapter_for(model)
    recorder = GradFlowRecorder(model)
    floor = 1e-3 * max(float(g.norm()) for g in grads.values() if g is not None)  # attn.k's bias: zero but rounding
    checked = 0
    for (depth, sublayer, param, _), _matrix in record.matrices.items():
        module = recorder.blocks[depth].get_submodule(adapter.sublayers[sublayer].path)
        full = next(n for n, p in model.named_parameters() if p is getattr(module, param))
        total = sum(m.double() for (d, s, p, _), m in record.matrices.items() if (d, s, p) == (depth, sublayer, param))
        want = grads[full].double()
        assert float((total - want).norm()) <= 1e-5 * max(float(want.norm()), floor), (depth, sublayer, param)
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("t", GRID)
def test_diffusion_exact_zero_at_every_ratio_and_split_sums_to_autograd(loaded, t):
    model = loaded.model
    batch = mask_batch(loaded.tokenizer, TEXTS, MaskedDiffusion(ratio=t, seed=1, min_selected=1))
    assert batch.loss_weights is not None and torch.all(batch.mask_ratio == t)
    record = _record(model, batch)
    last = record.num_blocks - 1
    grad, _ = record.site(f"blocks.{last}.out")
    for role in NON_LOSS:
        assert torch.all(grad[batch.roles == role] == 0), (t, role)
    assert torch.all(grad[batch.roles == Role.MASKED] > 0)
    zero = set(adapter_for(model).after_mixing())
    frame = record.sublayer_frame()
    context = frame[(frame.layer == record.num_blocks) & frame.role.isin(["context", "special"])]
    if len(context):  # (at t = 1 every word is masked: only the specials are left)
        assert (context[context.sublayer.isin(zero)].magnitude_sum == 0).all()
    for (depth, name, _, role), matrix in record.matrices.items():
        if depth == last and role in ("context", "special") and name in zero:
            assert torch.count_nonzero(matrix) == 0
    _assert_split_sums_to_autograd(model, batch, record, "sequence")


@pytest.mark.parametrize("policy", [MaskedDiffusion(seed=2, min_selected=1), SpanMasking(rate=0.4, seed=2),
                                    BertMasking(rate=0.4, seed=2)], ids=["diffusion t~U", "span 40%", "bert 40%"])
@pytest.mark.parametrize("reduction", ["batch", "sequence"])
def test_split_sums_to_autograd_under_each_objective(loaded, policy, reduction):
    batch = mask_batch(loaded.tokenizer, TEXTS, policy)
    record = _record(loaded.model, batch, reduction)
    _assert_split_sums_to_autograd(loaded.model, batch, record, reduction)


@pytest.mark.parametrize("policy", [BertMasking(rate=0.4, seed=3, shift=True),
                                    MaskedDiffusion(ratio=0.4, seed=3, shift=True)], ids=["bert", "diffusion"])
def test_shifted_zero_sits_at_the_positions_without_loss_whatever_their_input(loaded, policy):
    batch = mask_batch(loaded.tokenizer, TEXTS, policy)
    corrupted = batch.input_roles <= Role.KEPT
    no_loss_but_masked = corrupted & (batch.roles == Role.CONTEXT)
    clean_with_loss = (batch.input_roles == Role.CONTEXT) & (batch.roles <= Role.KEPT)
    assert no_loss_but_masked.any() and clean_with_loss.any()  # the two cases the shift separates
    record = _record(loaded.model, batch)
    grad, _ = record.site(f"blocks.{record.num_blocks - 1}.out")
    assert torch.all(grad[no_loss_but_masked] == 0)
    assert torch.all(grad[clean_with_loss] > 0)
    for role in NON_LOSS:
        assert torch.all(grad[batch.roles == role] == 0)
    zero = set(adapter_for(loaded.model).after_mixing())
    for (depth, name, _, role), matrix in record.matrices.items():
        if depth == record.num_blocks - 1 and role == "context" and name in zero:
            assert torch.count_nonzero(matrix) == 0
    _assert_split_sums_to_autograd(loaded.model, batch, record, "sequence")
