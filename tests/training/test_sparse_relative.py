"""Sparse last block of DeBERTa (v1), DeBERTa-v2/v3 and ModernBERT (ModernVBERT): what the tiny-family test
(tests/training/test_sparse_training.py) leaves out.

Sequences longer than the relative window (DeBERTa's clamped and log-bucketed relative positions, ModernBERT's
sliding window), right- and left-padded rows, rows with 1 to 12 loss positions, fixed ``rows_per_sequence``,
the configuration variants of each family, and the refusals.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradflow.adapters import adapter_for, block_modules
from gradflow.adapters.subset_relative import deberta_v2_subset, modernbert_subset
from gradflow.errors import SparseTrainingError
from gradflow.training import sparse_mlm
from test_sparse_training import RTOL, assert_same_gradients, gradients
from tiny import VOCAB, tiny_batch, tiny_model

LONG = 40
"""Sequence length: beyond DeBERTa's max_relative_positions (16) and ModernBERT's window (|i - j| <= 4)."""


def long_batch(seed: int = 1, t: int = LONG) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) (4, t): row 1 right-padded, row 2 left-padded (its slots past the loss
    positions repeat position 0, a padding position), 1, 7, 3 and 12 loss positions per row."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (4, t), generator=gen)
    attention = torch.ones(4, t, dtype=torch.long)
    attention[1, -9:] = 0
    attention[2, :5] = 0
    labels = torch.full((4, t), -100)
    for row, count in enumerate((1, 7, 3, 12)):
        real = attention[row].nonzero().flatten()
        picked = real[torch.randperm(len(real), generator=gen)[:count]]
        labels[row, picked] = ids[row, picked]
    ids[attention == 0] = 0
    return ids, attention, labels


def assert_exact(model: nn.Module, batch: tuple[torch.Tensor, ...], **options: object) -> None:
    """Sparse loss and every parameter gradient equal the dense model's (RTOL, as in test_sparse_training)."""
    ids, attention, labels = batch
    dense_loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
    dense = gradients(model, dense_loss)
    out = sparse_mlm(model, **options)(ids, attention, labels)
    assert abs(out.loss.item() - dense_loss.item()) <= RTOL * abs(dense_loss.item()), (out.loss, dense_loss)
    assert_same_gradients(gradients(model, out.loss), dense)
    assert torch.equal(out.labels, labels[labels != -100])


DEBERTA_VARIANTS = {
    "v2-shared-buckets": ("deberta-v2", {}),
    "v2-own-projections": ("deberta-v2", dict(share_att_key=False, position_buckets=-1)),
    "v2-c2p-only": ("deberta-v2", dict(pos_att_type=["c2p"], share_att_key=False)),
    "v2-p2c-only-absolute": ("deberta-v2", dict(pos_att_type=["p2c"], position_biased_input=True)),
    "v2-conv-after-first": ("deberta-v2", dict(conv_kernel_size=3)),
    "v2-no-relative": ("deberta-v2", dict(relative_attention=False, position_biased_input=True)),
    "v1": ("deberta", {}),
    "v1-talking-heads-p2c": ("deberta", dict(talking_head=True, pos_att_type=["p2c"])),
    "v1-no-relative": ("deberta", dict(relative_attention=False)),
}


@pytest.mark.parametrize("variant", sorted(DEBERTA_VARIANTS))
def test_deberta_variants_on_long_padded_batches_equal_the_dense_model(variant: str) -> None:
    """40 positions with max_relative_positions 16 (clamped c2p/p2c indices; v2: log buckets of 8), padded rows."""
    family, overrides = DEBERTA_VARIANTS[variant]
    assert_exact(tiny_model(family, **overrides), long_batch())


@pytest.mark.parametrize("family", ["deberta-v2", "deberta", "modernbert", "modernvbert"])
def test_fixed_rows_per_sequence_equal_the_dense_model(family: str) -> None:
    assert_exact(tiny_model(family), long_batch(seed=2), rows_per_sequence=12)


@pytest.mark.parametrize("family", ["modernbert", "modernvbert"])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_modernbert_sliding_window_last_block_equals_the_dense_model(family: str, implementation: str) -> None:
    """The tiny model's last layer is a sliding-window one (|i - j| <= 4 of 40 positions): the boolean (sdpa) or
    additive (eager) window mask's selected rows."""
    model = tiny_model(family)
    text = getattr(model.config, "text_config", model.config)
    assert text.layer_types[2] == "sliding_attention" and text.sliding_window == 4
    model.set_attn_implementation(implementation)
    assert_exact(model, long_batch(seed=3))


def test_modernbert_global_last_block_and_position_ids() -> None:
    """A global-attention last layer (4 layers: layer 3 is global), per-row position ids (B, T): cos/sin per row."""
    model = tiny_model("modernbert", num_hidden_layers=4)
    assert model.config.layer_types[3] == "full_attention"
    ids, attention, labels = long_batch(seed=4)
    positions = (torch.arange(LONG)[None, :] + torch.tensor([[0], [3], [1], [7]])).clamp(max=63)
    dense_loss = model(input_ids=ids, attention_mask=attention, labels=labels, position_ids=positions).loss
    dense = gradients(model, dense_loss)
    out = sparse_mlm(model).loss(ids, attention, labels, position_ids=positions)
    assert abs(out.item() - dense_loss.item()) <= RTOL * dense_loss.item()
    assert_same_gradients(gradients(model, out), dense)


def test_queries_are_computed_at_the_loss_positions_only() -> None:
    """With a hook on Wqkv (any hook: the module is then called, not its weight rows) the fused projection runs
    on the (B, n) selected rows and on all (B, T) positions, and the result is still exact; DeBERTa-v2's
    query_proj runs on the selected rows and (share_att_key) on the 2 * 8 relative-position embeddings."""
    batch = long_batch(seed=5)
    most = int((batch[2] != -100).sum(dim=1).max())
    model = tiny_model("modernbert")
    last = block_modules(adapter_for(model), model.base_model)[-1]
    shapes: list[tuple[int, ...]] = []
    handle = last.attn.Wqkv.register_forward_hook(lambda m, a, out: shapes.append(tuple(a[0].shape[:2])))
    try:
        sparse_mlm(model).loss(*batch)
        assert shapes == [(4, most), (4, LONG)]
        assert_exact(model, batch)
    finally:
        handle.remove()
    model = tiny_model("deberta-v2")
    last = block_modules(adapter_for(model), model.base_model)[-1]
    shapes.clear()
    handle = last.attention.self.query_proj.register_forward_hook(lambda m, a, out: shapes.append(tuple(a[0].shape)))
    try:
        sparse_mlm(model).loss(*batch)
    finally:
        handle.remove()
    assert shapes == [(4, most, 32), (1, 16, 32)]


def test_refusals_say_why() -> None:
    batch = tiny_batch()
    inputs = (batch.input_ids, batch.attention_mask, batch.labels)
    model = tiny_model("modernbert")
    model.set_attn_implementation("flex_attention")  # its forward compiles a kernel: the subset is called alone
    with pytest.raises(SparseTrainingError, match="attn_implementation='flex_attention'.*'sdpa'.*block=False"):
        modernbert_subset(model.base_model.layers[-1], {}, torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(SparseTrainingError, match="ConvLayer.*one-layer model.*block=False"):
        sparse_mlm(tiny_model("deberta-v2", conv_kernel_size=3, num_hidden_layers=1)).loss(*inputs)
    with pytest.raises(SparseTrainingError, match="query_states.*enhanced mask decoder.*block=False"):
        model = tiny_model("deberta-v2")
        hidden = torch.zeros(1, 4, 32)
        deberta_v2_subset(model.base_model.encoder.layer[-1], {"hidden_states": hidden, "query_states": hidden},
                          torch.zeros(1, 1, dtype=torch.long))
    model = tiny_model("deberta-v2")
    model.base_model.encoder.layer[-1].attention.self.add_module("extra", nn.Linear(32, 32))
    with pytest.raises(SparseTrainingError, match="attention.self.extra beyond DeBERTa-v2's layout.*block=False"):
        sparse_mlm(model).loss(*inputs)
    model = tiny_model("deberta")
    model.base_model.encoder.layer[-1].attention.self.in_proj = nn.Linear(32, 96)
    with pytest.raises(SparseTrainingError, match="in_proj is a Linear with bias True.*block=False"):
        sparse_mlm(model).loss(*inputs)
    model = tiny_model("modernbert")
    model.base_model.layers[-1].mlp.add_module("gate_norm", nn.LayerNorm(48))
    with pytest.raises(SparseTrainingError, match="mlp.gate_norm beyond ModernBERT's layout"):
        sparse_mlm(model).loss(*inputs)


@pytest.mark.parametrize("family", ["deberta-v2", "modernbert"])
def test_bfloat16_autocast_stays_close_with_finite_gradients(family: str) -> None:
    """Under CPU bfloat16 autocast (the pretraining recipe's setting): the dense loss to bfloat16 precision, and
    finite gradients although row 2's padding slots repeat a padding position."""
    model = tiny_model(family)
    ids, attention, labels = long_batch(seed=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dense = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        sparse = sparse_mlm(model).loss(ids, attention, labels)
    assert abs(sparse.item() - dense.item()) <= 2e-2 * dense.item()
    assert all(bool(torch.isfinite(g).all()) for g in gradients(model, sparse).values())


def test_deberta_z_steps_are_refused() -> None:
    """A hand-set ``z_steps`` re-runs the last layer after the encoder: the sparse block would leave it out."""
    from gradflow.errors import SparseTrainingError
    from gradflow.training import sparse_mlm

    model = tiny_model("deberta-v2")
    model.base_model.z_steps = 2
    with pytest.raises(SparseTrainingError, match="z_steps = 2"):
        sparse_mlm(model)
    assert sparse_mlm(model, block=False).block is False
