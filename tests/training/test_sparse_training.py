"""Sparse MLM training (gradflow.training): the same loss and every parameter's gradient as the dense model.

Every family of the tiny table (tests/tiny.py), float32, eval mode (no dropout), one batch with every
role and a padded row: the sparse head alone everywhere, the sparse last block where the adapter has
one, and the refusal elsewhere.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gradflow.adapters import adapter_for, block_modules
from gradflow.adapters.subset import bert_layout, llama_subset
from gradflow.errors import GradflowError, SparseTrainingError
from gradflow.training import SparseMLM, loss_index, sparse_mlm
from tiny import FAMILIES, tiny_batch, tiny_model

BLOCK_FAMILIES = {"bert", "roberta", "xlm-roberta", "camembert", "electra", "ernie", "roformer", "data2vec-text",
                  "distilbert", "albert", "roberta-prelayernorm", "megatron-bert", "xlm-roberta-xl", "rembert",
                  "big_bird", "mpnet", "eurobert", "ultrabert", "esm", "gte", "nomic_bert",
                  "mobilebert", "longformer", "fnet",
                  "jina_embeddings_v3", "yoso", "luke", "convbert", "xmod", "nystromformer", "esmc", "ibert",
                  "squeezebert", "deberta-v2", "deberta", "modernbert", "modernvbert", "xlm", "flaubert",
                  "roc_bert", "tapas", "ultravbert"}
"""The families with a sparse last block (``Adapter.subset_block``); the others are refused."""

RTOL = 1e-5
NOISE = 1e-5
"""A gradient under this fraction of the largest is float32 rounding noise of one that is zero in exact arithmetic."""


def gradients(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named, grads)}


def assert_same_gradients(sparse: dict[str, torch.Tensor], dense: dict[str, torch.Tensor]) -> None:
    """Relative error <= RTOL per parameter. A gradient that is zero in exact arithmetic (attention key
    biases: softmax ignores a shift shared by a query's scores), or nearly so (the same bias rotated by rotary
    positions: a sum of nearly cancelling terms), is dominated by float32 rounding in both: such a parameter
    (dense norm under NOISE of the largest) must stay that small in the sparse model. (With a floor of 1e-6, a
    Dream key bias at 1.195e-6 of the largest failed the relative test by 1.25e-5 once in a full run.)"""
    assert sparse.keys() == dense.keys()
    largest = max(float(g.norm()) for g in dense.values())
    for name, g_dense in dense.items():
        norm = float(g_dense.norm())
        diff = float((sparse[name] - g_dense).norm())
        if norm < NOISE * largest:
            assert float(sparse[name].norm()) < NOISE * largest, name
        else:
            assert diff <= RTOL * norm, (name, diff / norm)


def dense_reference(model: torch.nn.Module, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels).loss
    return loss, gradients(model, loss)


@pytest.mark.parametrize("family", FAMILIES)
def test_sparse_head_and_block_equal_the_dense_model(family: str) -> None:
    """The head alone for every family; the last block too, or its refusal with the reason. A family of
    BLOCK_FAMILIES must not refuse; any other family either refuses or is exact too (never silently wrong)."""
    model = tiny_model(family)
    batch = tiny_batch()
    loss, dense = dense_reference(model, batch)
    for block in (False, True):
        try:
            out = sparse_mlm(model, block=block)(batch.input_ids, batch.attention_mask, batch.labels)
        except SparseTrainingError as err:
            assert block and family not in BLOCK_FAMILIES, err
            assert "not implemented for" in str(err) and "block=False" in str(err)
            continue
        assert abs(out.loss.item() - loss.item()) <= RTOL * abs(loss.item()), (block, out.loss.item(), loss.item())
        assert_same_gradients(gradients(model, out.loss), dense)
        assert out.logits.shape == (int((batch.labels != -100).sum()), model.config.vocab_size)
        assert torch.equal(out.labels, batch.labels[batch.labels != -100])  # row-major, as the dense loss reads them


@pytest.mark.parametrize(("family", "subset"), [("xmod", bert_layout()), ("nystromformer", bert_layout()),
                                                 ("esmc", llama_subset)])
def test_adapter_variants_with_extra_modules_are_refused(family: str, subset) -> None:
    """Variants whose adapter reuses another layout's subset function but whose block adds computation (X-MOD's
    language adapter after the FFN, Nystromformer's convolution over the values, ESMC's query and key norms:
    their own adapters have their own subset functions) are refused by the layout check, not computed wrongly."""
    model = tiny_model(family)
    batch = tiny_batch()
    with pytest.raises(SparseTrainingError, match="beyond .* layout.*block=False"):
        sparse_mlm(model, adapter=replace(adapter_for(model), subset_block=subset)).loss(
            batch.input_ids, batch.attention_mask, batch.labels)


def test_every_block_family_has_a_subset_block() -> None:
    assert BLOCK_FAMILIES == set(FAMILIES)  # every supported family of the tiny table
    assert all(adapter_for(tiny_model(f)).subset_block is not None for f in BLOCK_FAMILIES)


def test_albert_subsets_only_the_last_application_of_the_shared_layer() -> None:
    """ALBERT's one layer runs at every depth: the earlier applications stay dense (their outputs feed the
    next depth's keys and values), the last one is subset; the shared weights' gradient sums them all."""
    model = tiny_model("albert")
    blocks = block_modules(adapter_for(model), model.base_model)
    assert len(blocks) == 3 and all(b is blocks[0] for b in blocks)
    batch = tiny_batch()
    shapes = []
    handle = blocks[0].attention.query.register_forward_hook(lambda m, a, out: shapes.append(tuple(a[0].shape[:2])))
    try:
        sparse_mlm(model).loss(batch.input_ids, batch.attention_mask, batch.labels)
    finally:
        handle.remove()
    most = int((batch.labels != -100).sum(dim=1).max())
    assert shapes == [tuple(batch.input_ids.shape)] * 2 + [(batch.input_ids.shape[0], most)]


def test_forward_is_restored_even_when_the_subset_fails() -> None:
    model = tiny_model("bert")
    last = model.base_model.encoder.layer[-1]
    batch = tiny_batch()

    def broken(block, call, index):
        raise RuntimeError("boom")

    sparse = SparseMLM(model, replace(adapter_for(model), subset_block=broken), block=True, head=True)
    with pytest.raises(RuntimeError, match="boom"):
        sparse.loss(batch.input_ids, batch.attention_mask, batch.labels)
    assert "forward" not in vars(last)
    sparse_mlm(model).loss(batch.input_ids, batch.attention_mask, batch.labels)
    assert "forward" not in vars(last)
    dense = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert dense.shape[:2] == batch.input_ids.shape


def test_loss_index_pads_rows_and_keeps_row_major_order() -> None:
    labels = torch.full((3, 6), -100)
    labels[0, [1, 4]] = 7
    labels[2, 5] = 9
    where = loss_index(labels)
    assert where.index.tolist() == [[1, 4], [0, 0], [5, 0]]
    assert where.valid.tolist() == [[True, True], [False, False], [True, False]]


def test_refusals_say_why() -> None:
    model = tiny_model("bert")
    batch = tiny_batch()
    every = torch.where(batch.attention_mask.bool(), batch.original_ids, torch.full_like(batch.labels, -100))
    # every real position carries loss (masked diffusion at t near 1): nothing to skip, computed all the same
    dense = torch.nn.functional.cross_entropy(model(**batch.model_inputs()).logits[every != -100], every[every != -100])
    torch.testing.assert_close(sparse_mlm(model).loss(batch.input_ids, batch.attention_mask, every), dense,
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(SparseTrainingError, match="no loss position"):
        sparse_mlm(model).loss(batch.input_ids, batch.attention_mask, torch.full_like(batch.labels, -100))
    with pytest.raises(SparseTrainingError, match="differ in shape"):
        sparse_mlm(model).loss(batch.input_ids, batch.attention_mask, batch.labels[:, :-1])
    with pytest.raises(SparseTrainingError, match="head=True"):
        sparse_mlm(model, head=False)
    with pytest.raises(SparseTrainingError, match="no separate base model"):
        sparse_mlm(model.base_model, adapter=adapter_for(model))
    mixing = replace(adapter_for(model), head_mixes_positions="a convolution over neighbouring positions")
    with pytest.raises(SparseTrainingError, match="mixes positions \\(a convolution"):
        sparse_mlm(model, adapter=mixing)
    assert issubclass(SparseTrainingError, GradflowError)


def test_extra_inputs_and_every_role_with_token_types() -> None:
    """token_type_ids reach the embeddings in the sparse forward as in the dense one."""
    model = tiny_model("bert", type_vocab_size=2)
    batch = tiny_batch(seed=3, b=4, t=10)
    types = (torch.arange(10) >= 5).long().expand(4, -1)
    loss = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, token_type_ids=types,
                 labels=batch.labels).loss
    dense = gradients(model, loss)
    with sparse_mlm(model) as sparse:
        out = sparse.loss(batch.input_ids, batch.attention_mask, batch.labels, token_type_ids=types)
    assert abs(out.item() - loss.item()) <= RTOL * loss.item()
    assert_same_gradients(gradients(model, out), dense)


@pytest.mark.parametrize("family", ["roformer", "albert"])
def test_fixed_rows_per_sequence_equal_the_dense_model(family: str) -> None:
    """Constant shapes (the head at every one of B * width slots, padding slots outside the loss): same loss
    and gradients; a row with more loss positions than the width is refused."""
    model = tiny_model(family)
    batch = tiny_batch()
    loss, dense = dense_reference(model, batch)
    out = sparse_mlm(model, rows_per_sequence=5)(batch.input_ids, batch.attention_mask, batch.labels)
    assert abs(out.loss.item() - loss.item()) <= RTOL * loss.item()
    assert_same_gradients(gradients(model, out.loss), dense)
    assert out.logits.shape[0] == int((batch.labels != -100).sum())
    with pytest.raises(SparseTrainingError, match="more than rows_per_sequence=1"):
        sparse_mlm(model, rows_per_sequence=1).loss(batch.input_ids, batch.attention_mask, batch.labels)


def test_bfloat16_autocast_runs_and_stays_close() -> None:
    """Under CPU bfloat16 autocast (the recipe's setting) the sparse loss is the dense one to bfloat16 precision."""
    model = tiny_model("roformer")
    batch = tiny_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dense = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels).loss
        sparse = sparse_mlm(model).loss(batch.input_ids, batch.attention_mask, batch.labels)
    assert abs(sparse.item() - dense.item()) <= 2e-2 * dense.item()


def test_trainer_compute_loss_is_the_dense_loss(tmp_path) -> None:
    from transformers import TrainingArguments

    from gradflow.training import SparseMLMTrainer

    model = tiny_model("distilbert")
    batch = tiny_batch()
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=3)
    trainer = SparseMLMTrainer(model=model, args=args)
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "labels": batch.labels}
    dense = model(**inputs).loss
    assert torch.allclose(trainer.compute_loss(model, inputs), dense, rtol=RTOL, atol=0)
    n = int((batch.labels != -100).sum())
    summed = trainer.compute_loss(model, inputs, num_items_in_batch=2 * n)
    assert torch.allclose(summed, dense / 2, rtol=RTOL, atol=0)
    refused = tiny_model("bert")  # a model the sparse block refuses: a hand-registered adapter without one
    with pytest.raises(SparseTrainingError, match="not implemented for the bert family"):
        SparseMLMTrainer(model=refused, args=args, sparse_adapter=replace(adapter_for(refused), subset_block=None))
