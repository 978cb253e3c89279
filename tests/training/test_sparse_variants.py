"""The sparse last block of YOSO, LUKE, ConvBERT, X-MOD, Nystromformer, ESMC, I-BERT and SqueezeBERT
(gradflow.adapters.subset_variants): what the family-wide test in tests/training/test_sparse_training.py does not cover.

Loss positions at the sequence ends (ConvBERT's span windows and the value convolutions reach past them),
rows with 0, 1 and 3 loss positions, a padded row, fixed ``rows_per_sequence``, the variants each family's
config allows (YOSO's value convolution, ConvBERT's grouped FFN and narrower spans, Nystromformer's wider value
convolution, X-MOD with a language per sequence) and the refusals with their reasons.
"""

from __future__ import annotations

import copy

import pytest
import torch

from gradflow.adapters import UnsupportedArchitectureError
from gradflow.adapters.subset_variants import ibert_subset, nystromformer_subset, xmod_subset, yoso_subset
from gradflow.errors import SparseTrainingError
from gradflow.training import sparse_mlm
from test_sparse_training import RTOL, assert_same_gradients, gradients
from tiny import tiny_batch, tiny_model

FAMILIES = ("yoso", "luke", "convbert", "xmod", "nystromformer", "esmc", "ibert", "squeezebert")

VARIANTS = {
    "yoso-conv": ("yoso", dict(conv_window=3)),
    "convbert-groups": ("convbert", dict(num_groups=2, conv_kernel_size=5)),
    "nystromformer-conv-5": ("nystromformer", dict(conv_kernel_size=5)),
    "luke-plain-attention": ("luke", dict(use_entity_aware_attention=False)),
}


def edge_batch():
    """4 rows of 14: loss positions at 1, 2 and 12 (next to both specials) in row 0, at 6 in row 1, none in
    row 2, and in row 3 (padded after position 9) at the last real token before its final special."""
    batch = tiny_batch(seed=5, b=4, t=14)
    labels = torch.full_like(batch.labels, -100)
    for row, positions in ((0, [1, 2, 12]), (1, [6]), (3, [8])):
        labels[row, positions] = batch.original_ids[row, positions]
    mask = torch.ones_like(batch.attention_mask)
    mask[3, 10:] = 0
    return batch.input_ids, mask, labels


def assert_exact(model: torch.nn.Module, input_ids, mask, labels, rows_per_sequence: int | None = None,
                 **inputs: torch.Tensor) -> None:
    loss = model(input_ids=input_ids, attention_mask=mask, labels=labels, **inputs).loss
    dense = gradients(model, loss)
    out = sparse_mlm(model, rows_per_sequence=rows_per_sequence)(input_ids, mask, labels, **inputs)
    assert abs(out.loss.item() - loss.item()) <= RTOL * abs(loss.item()), (out.loss.item(), loss.item())
    assert_same_gradients(gradients(model, out.loss), dense)
    assert out.logits.shape[0] == int((labels != -100).sum())


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_positions_at_the_ends_uneven_rows_and_padding(family: str) -> None:
    assert_exact(tiny_model(family), *edge_batch())


@pytest.mark.parametrize("family", FAMILIES)
def test_fixed_rows_per_sequence(family: str) -> None:
    assert_exact(tiny_model(family), *edge_batch(), rows_per_sequence=4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_variants(variant: str) -> None:
    family, overrides = VARIANTS[variant]
    model = tiny_model(family, **overrides)
    assert_exact(model, *edge_batch())


def test_xmod_language_per_sequence() -> None:
    """lang_ids (B,) pick each sequence's language adapter; the sparse block runs each row's own adapter."""
    model = tiny_model("xmod", languages=["en_XX", "de_DE"])
    input_ids, mask, labels = edge_batch()
    lang_ids = torch.tensor([0, 1, 0, 1])
    assert_exact(model, input_ids, mask, labels, lang_ids=lang_ids)
    other = sparse_mlm(model).loss(input_ids, mask, labels, lang_ids=1 - lang_ids)
    assert abs(other.item() - sparse_mlm(model).loss(input_ids, mask, labels, lang_ids=lang_ids).item()) > 1e-6


def _last_block_call(family: str, **overrides) -> tuple[torch.nn.Module, dict, torch.Tensor]:
    model = tiny_model(family, **overrides)  # blocks at encoder.layer; the adapter may refuse the config itself
    block = model.base_model.encoder.layer[-1]
    hidden = torch.randn(2, 12, 32)
    return block, {"hidden_states": hidden, "attention_mask": torch.ones(2, 12)}, torch.tensor([[3, 5], [1, 1]])


def test_refusals_say_why() -> None:
    """The configurations whose sparse last block would not be exact, or that the subset does not run."""
    block, call, index = _last_block_call("yoso", use_expectation=False)
    with pytest.raises(SparseTrainingError, match="use_expectation=False samples LSH hashes.*block=False"):
        yoso_subset(block, call, index)
    block, call, index = _last_block_call("nystromformer", num_landmarks=4, segment_means_seq_len=12)
    with pytest.raises(SparseTrainingError, match="num_landmarks=4 < segment_means_seq_len=12.*other positions' "
                                                  "queries"):
        nystromformer_subset(block, call, index)
    with pytest.raises(UnsupportedArchitectureError, match="num_landmarks=4 < segment_means_seq_len=12"):
        sparse_mlm(tiny_model("nystromformer", num_landmarks=4, segment_means_seq_len=12))
    block, call, index = _last_block_call("xmod", pre_norm=True)
    with pytest.raises(SparseTrainingError, match="pre_norm=True.*encoder's LayerNorm"):
        xmod_subset(block, {**call, "lang_ids": torch.zeros(2)}, index)
    block, call, index = _last_block_call("ibert", quant_mode=True)
    with pytest.raises(SparseTrainingError, match="quant_mode=True.*float model"):
        ibert_subset(block, call, index)


def test_luke_entity_inputs_are_refused() -> None:
    model = tiny_model("luke")
    input_ids, mask, labels = edge_batch()
    entities = {"entity_ids": torch.ones(4, 1, dtype=torch.long), "entity_position_ids": torch.full((4, 1, 1), 2)}
    with pytest.raises(SparseTrainingError, match="entity inputs.*words only.*block=False"):
        sparse_mlm(model).loss(input_ids, mask, labels, **entities)


def test_ibert_activation_ranges_in_training_mode() -> None:
    """In training mode I-BERT's QuantAct modules track activation ranges (buffers quant_mode=False never reads).
    The sparse block gives the dense loss and gradients; the last block's key and value ranges are the dense
    model's (every position), its query-side ranges come from the loss positions only."""
    model = tiny_model("ibert", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).train()
    sparse_model = copy.deepcopy(model)
    input_ids, mask, labels = edge_batch()
    dense_loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
    sparse_loss = sparse_mlm(sparse_model).loss(input_ids, mask, labels)
    assert abs(sparse_loss.item() - dense_loss.item()) <= RTOL * dense_loss.item()
    assert_same_gradients(gradients(sparse_model, sparse_loss), gradients(model, dense_loss))
    dense_att = model.base_model.encoder.layer[-1].attention.self
    sparse_att = sparse_model.base_model.encoder.layer[-1].attention.self
    for name in ("key_activation", "value_activation"):
        assert torch.allclose(getattr(sparse_att, name).x_max, getattr(dense_att, name).x_max, rtol=1e-6)
    assert not torch.allclose(sparse_att.query_activation.x_max, dense_att.query_activation.x_max)


def test_esmc_chains_mask_per_query_row() -> None:
    """ESMC's sequence_id (chain ids, -1 padding) builds a block-diagonal mask (B, 1, T, T): each selected query
    reads its own row of it (a loss position in the second chain attends to that chain only)."""
    model = tiny_model("esmc")
    input_ids, mask, labels = edge_batch()
    chains = torch.tensor([[0] * 7 + [1] * 7, [0] * 14, [0] * 5 + [1] * 9, [0] * 10 + [-1] * 4])
    assert_exact(model, input_ids, mask, labels, sequence_id=chains)
    single = sparse_mlm(model).loss(input_ids, mask, labels)
    assert abs(single.item() - sparse_mlm(model).loss(input_ids, mask, labels, sequence_id=chains).item()) > 1e-6
