"""Sparse training under the objectives beyond BERT's (issue 51): masked diffusion, span masking, shifted heads.

For a tiny BERT (a real WordPiece tokenizer), LLaDA and Dream (remote code, tests/models/remote_code), each batch
drawn by :func:`gradflow.inputs.masking.mask_batch`: the sparse loss (``SparseMLM.batch_loss``: the objective's
``loss_weights``, ``loss_norm`` and ``mean_over_sequences``) equals ``get_loss("mlm", "batch")`` of the dense
logits, and every parameter's gradient equals the dense model's (relative 1e-5, with the floor of
``assert_same_gradients`` for gradients zero by symmetry). Then the Trainer path (a diffusion collator, the fields
popped by ``compute_loss``) and GradFlowCallback recording during sparse training under the shifted objective.
"""

from __future__ import annotations

import pytest
import torch
from test_sparse_training import RTOL, assert_same_gradients, gradients

from gradflow.errors import SparseTrainingError
from gradflow.inputs.masking import BertMasking, encode, mask_batch
from gradflow.inputs.objectives import MaskedDiffusion, SpanMasking
from gradflow.losses import get_loss, weighted_cross_entropy
from gradflow.models import load_model
from gradflow.roles import Role
from gradflow.training import sparse_mlm
from models.remote_code.tiny_remote import build_dream_tiny, build_llada_tiny

TEXTS = ["The progress of public credit is witnessed by a considerable rise of American stock abroad.",
         "We must ensure that the laws are faithfully executed.",
         "It is a rise of credit.",
         "The laws of public credit must be executed abroad as we ensure a considerable progress."]
OBJECTIVES = {
    "diffusion-uniform": MaskedDiffusion(seed=1),
    "diffusion-grid": MaskedDiffusion(ratios=(0.05, 0.3, 0.6, 0.9), seed=2, min_selected=1),
    "span": SpanMasking(rate=0.3, seed=3),
    "bert-shifted": BertMasking(rate=0.3, seed=4, shift=True),
    "diffusion-shifted": MaskedDiffusion(seed=5, shift=True),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_mlm_dir) -> dict:
    """The tiny BERT and both remote-code checkpoints, in eval mode (no dropout), float32."""
    loaded = {"bert": load_model(str(tiny_mlm_dir)),
              "llada": load_model(str(build_llada_tiny(tmp_path_factory.mktemp("llada"))), trust_remote_code=True),
              "dream": load_model(str(build_dream_tiny(tmp_path_factory.mktemp("dream"))), trust_remote_code=True)}
    for lm in loaded.values():
        lm.model.eval()
    return loaded


def prompted(tokenizer, prompt_length: int = 4):
    """LLaDA's SFT batch: each text's first ``prompt_length`` tokens a prompt (never masked); mean over sequences."""
    encodings = [{**encode(tokenizer, text), "prompt_length": prompt_length} for text in TEXTS]
    return mask_batch(tokenizer, policy=MaskedDiffusion(seed=6, min_selected=1), encodings=encodings)


def assert_exact(model, batch, **options) -> torch.Tensor:
    """Sparse loss and every gradient = the dense model's under ``get_loss("mlm", "batch")``; returns the loss."""
    dense = get_loss("mlm", "batch")(model(**batch.model_inputs()).logits, batch)
    dense_grads = gradients(model, dense)
    sparse = sparse_mlm(model, **options).batch_loss(batch)
    assert abs(sparse.item() - dense.item()) <= RTOL * abs(dense.item()), (sparse.item(), dense.item())
    assert_same_gradients(gradients(model, sparse), dense_grads)
    return sparse


@pytest.mark.parametrize("family", ["bert", "llada", "dream"])
@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_sparse_loss_and_gradients_equal_the_dense_objective(models, family, objective):
    lm = models[family]
    batch = mask_batch(lm.tokenizer, TEXTS, OBJECTIVES[objective])
    weighted = objective.startswith("diffusion")
    assert (batch.loss_weights is not None) == weighted and batch.shifted == objective.endswith("shifted")
    loss = assert_exact(lm.model, batch)
    if weighted:  # the weighted loss differs from the plain mean: the weights reached it
        plain = sparse_mlm(lm.model)(batch.input_ids, batch.attention_mask, batch.labels).loss
        assert abs(plain.item() - loss.item()) > 1e-3


@pytest.mark.parametrize("family", ["bert", "llada", "dream"])
def test_sft_prompt_mean_over_sequences(models, family):
    lm = models[family]
    batch = prompted(lm.tokenizer)
    assert batch.mean_over_sequences and torch.all(batch.labels[:, :4] == -100)
    loss = assert_exact(lm.model, batch)
    pooled = sparse_mlm(lm.model)(batch.input_ids, batch.attention_mask, batch.labels, loss_weights=batch.loss_weights,
                                  loss_norm=batch.loss_norm).loss  # the pooled normaliser instead: another number
    assert abs(pooled.item() - loss.item()) > 1e-4


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_fixed_rows_per_sequence_under_diffusion(models, family):
    lm = models[family]
    batch = mask_batch(lm.tokenizer, TEXTS, MaskedDiffusion(seed=7, shift=family == "dream"))
    width = int((batch.labels != -100).sum(dim=1).max()) + 3
    assert_exact(lm.model, batch, rows_per_sequence=width)


def test_the_output_carries_the_weights_at_the_loss_positions(models):
    lm = models["llada"]
    batch = mask_batch(lm.tokenizer, TEXTS, MaskedDiffusion(ratios=(0.2, 0.5), seed=8))
    out = sparse_mlm(lm.model).batch_forward(batch)
    rows, cols = out.positions.unbind(1)
    assert torch.equal(out.weights, batch.loss_weights[rows, cols])
    assert torch.allclose(out.weights, (1 / batch.mask_ratio[rows]).float())
    dense = weighted_cross_entropy(lm.model(**batch.model_inputs()).logits, batch.labels, batch.loss_weights,
                                   batch.loss_norm)
    assert abs(out.loss.item() - dense.item()) <= RTOL * dense.item()


def test_refusals_under_the_new_objectives(models):
    lm = models["llada"]
    batch = mask_batch(lm.tokenizer, TEXTS, MaskedDiffusion(seed=9))
    sparse = sparse_mlm(lm.model)
    with pytest.raises(SparseTrainingError, match="together"):
        sparse(batch.input_ids, batch.attention_mask, batch.labels, loss_weights=batch.loss_weights)
    with pytest.raises(SparseTrainingError, match="do not match labels"):
        sparse(batch.input_ids, batch.attention_mask, batch.labels, loss_weights=batch.loss_weights[:, :-1],
               loss_norm=batch.loss_norm)
    for family in ("llada", "dream"):  # the base model gives no last hidden state: the head-only mode cannot run
        with pytest.raises(SparseTrainingError, match=r"block=False\) reads the base model's last hidden state.*"
                                                      r"block=True"):
            sparse_mlm(models[family].model, block=False)


class Interleaved(torch.nn.Module):
    """A rotary embedding of the other convention (pairs of neighbouring channels), which llada_subset must refuse."""

    def forward(self, q, k):
        def rotate(t):
            angle = torch.arange(t.shape[-2], dtype=t.dtype)[:, None] * 0.1
            even, odd = t[..., ::2], t[..., 1::2]
            return torch.stack((even * angle.cos() - odd * angle.sin(), even * angle.sin() + odd * angle.cos()),
                               dim=-1).flatten(-2)

        return rotate(q), rotate(k)


def test_llada_variants_the_sparse_block_does_not_reproduce_are_refused(models):
    import copy

    lm = models["llada"]
    batch = mask_batch(lm.tokenizer, TEXTS, MaskedDiffusion(seed=12))
    normed = copy.deepcopy(lm.model)
    normed.model.transformer.blocks[-1].q_norm = torch.nn.LayerNorm(32)  # attention_layer_norm's query norm
    with pytest.raises(SparseTrainingError, match="q_norm beyond LLaDA's Llama-block layout.*train densely"):
        sparse_mlm(normed).batch_loss(batch)
    rotated = copy.deepcopy(lm.model)
    rotated.model.transformer.blocks[-1].rotary_emb = Interleaved()
    with pytest.raises(SparseTrainingError, match="not the rotate-half rotation"):
        sparse_mlm(rotated).batch_loss(batch)
    assert "forward" not in vars(rotated.model.transformer.blocks[-1])  # the interception is undone


# ---------------------------------------------------------------------------------------- the Trainer
class Collator:
    """A diffusion collator (the user's): masks each batch of (index, text) pairs and hands the objective's fields
    to the trainer under the names compute_loss pops; keeps every batch it made."""

    def __init__(self, tokenizer, policy):
        self.tokenizer, self.policy, self.batches = tokenizer, policy, []

    def __call__(self, items):
        batch = mask_batch(self.tokenizer, [t for _, t in items], self.policy, indices=[i for i, _ in items])
        self.batches.append(batch)
        return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "labels": batch.labels,
                "loss_weights": batch.loss_weights, "loss_norm": batch.loss_norm,
                "mean_over_sequences": torch.tensor(batch.mean_over_sequences)}


def _trainer(cls, model, tokenizer, policy, out, steps=3, **kwargs):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(out), report_to=[], use_cpu=True, per_device_train_batch_size=2,
                             max_steps=steps, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", seed=0,
                             remove_unused_columns=False, save_strategy="no", logging_strategy="no")
    return cls(model=model, args=args, train_dataset=list(enumerate(TEXTS * 2)),
               data_collator=Collator(tokenizer, policy), **kwargs)


def no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every dropout off (p = 0): in train mode the dense and sparse steps then compute the same."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def _dense_trainer_class():
    from transformers import Trainer

    class DenseDiffusionTrainer(Trainer):
        """The reference: the dense logits and gradflow.losses.weighted_cross_entropy."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
            return weighted_cross_entropy(logits, inputs["labels"], inputs["loss_weights"], inputs["loss_norm"],
                                          mean_over_sequences=bool(inputs["mean_over_sequences"]))

    return DenseDiffusionTrainer


@pytest.mark.parametrize("family", ["bert", "llada"])
def test_trainer_steps_equal_the_dense_steps(models, family, tmp_path):
    """Three SGD steps of SparseMLMTrainer under t ~ U(eps, 1) land on the dense trainer's weights (a model copy)."""
    import copy

    from gradflow.training import SparseMLMTrainer

    lm = models[family]
    policy = MaskedDiffusion(seed=10)
    start = no_dropout(copy.deepcopy(lm.model))  # the Trainer trains in train mode
    dense = _trainer(_dense_trainer_class(), copy.deepcopy(start), lm.tokenizer, policy, tmp_path / "dense")
    sparse = _trainer(SparseMLMTrainer, copy.deepcopy(start), lm.tokenizer, policy, tmp_path / "sparse")
    dense.train()
    sparse.train()
    batches = dense.data_collator.batches
    assert [b.input_ids.tolist() for b in batches] == [b.input_ids.tolist() for b in sparse.data_collator.batches]
    moved = 0.0
    for (name, a), b, w0 in zip(dense.model.named_parameters(), sparse.model.parameters(), start.parameters()):
        step = float((a - w0).detach().norm())
        moved = max(moved, step)
        ulps = 4 * torch.finfo(torch.float32).eps * float(a.detach().abs().max())  # rounding of 3 weight updates
        assert float((a - b).detach().norm()) <= 1e-5 * max(step, 1e-3) + ulps, name
    assert moved > 1e-3  # the steps did move the weights
    inputs = Collator(lm.tokenizer, policy)([(0, TEXTS[0]), (1, TEXTS[1])])
    want = dense.compute_loss(sparse.model, dict(inputs))
    got = sparse.compute_loss(sparse.model, dict(inputs))
    assert abs(got.item() - want.item()) <= RTOL * want.item()
    accumulated = sparse.compute_loss(sparse.model, dict(inputs), num_items_in_batch=7)  # weighted: not per token
    assert abs(accumulated.item() - want.item() / sparse.args.gradient_accumulation_steps) <= RTOL * want.item()


def test_callback_records_during_sparse_training_under_the_shifted_objective(models, tmp_path):
    """Dream, masked diffusion shifted: the logged steps run densely for the recorder (the trained weights equal a
    run without the callback), the roles come from the shifted labels (= mask_batch's), the last block's output
    gradient is exactly zero at context (a masked input whose successor is not masked among it) and > 0 at masked."""
    import copy

    from gradflow.interventions.callback import GradFlowCallback, loss_side_roles
    from gradflow.training import SparseMLMTrainer

    lm = models["dream"]
    policy = MaskedDiffusion(seed=11, shift=True, min_selected=2)
    start = no_dropout(copy.deepcopy(lm.model))
    callback = GradFlowCallback(every=2, tokenizer=lm.tokenizer, log="none")
    trainer = _trainer(SparseMLMTrainer, copy.deepcopy(start), lm.tokenizer, policy, tmp_path / "cb",
                       callbacks=[callback])
    plain = _trainer(SparseMLMTrainer, copy.deepcopy(start), lm.tokenizer, policy, tmp_path / "plain")
    trainer.train()
    plain.train()
    for (name, a), b, w0 in zip(trainer.model.named_parameters(), plain.model.parameters(), start.parameters()):
        assert float((a - b).detach().norm()) <= 1e-5 * max(float((b - w0).detach().norm()), 1e-3), name
    batches = trainer.data_collator.batches
    assert callback.shift is True  # from Dream's adapter (shifted_head)
    for step, batch in ((1, batches[0]), (2, batches[1])):  # logged: step 1 (first) and 2 (every=2); not 3
        roles = loss_side_roles(batch.input_ids, batch.labels, batch.attention_mask, lm.tokenizer.mask_token_id,
                                tuple(lm.tokenizer.all_special_ids), shift=True)
        assert torch.equal(roles, batch.roles)
        rows = [r for r in callback.rows if r["step"] == step and r["group"] == "blocks.1"]
        count = {r["role"]: r["value"] for r in rows if r["quantity"] == "n_positions"}
        hidden = {r["role"]: r["value"] for r in rows if r["quantity"] == "hidden_grad_mean"}
        for role in ("masked", "context"):
            assert count[role] == int((batch.roles == Role[role.upper()]).sum()), (step, role)
        assert hidden["context"] == 0.0 and hidden["masked"] > 0
        lone = (batch.input_roles == Role.MASKED) & (batch.roles == Role.CONTEXT)
        assert lone.any()  # masked inputs whose successor is not masked: context, and zero
    assert {r["step"] for r in callback.rows} == {1, 2}
