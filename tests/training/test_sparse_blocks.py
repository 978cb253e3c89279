"""The sparse last block of MobileBERT, Longformer, FNet and XLM/FlauBERT (gradflow.adapters.subset_blocks).

tests/training/test_sparse_training.py checks each family's loss and gradients on the tiny batch; here: padded batches
and rows with different numbers of loss positions, ``rows_per_sequence``, Longformer sequences longer than its
window and its global attention, MobileBERT's other bottleneck layouts, XLM/FlauBERT (``Adapter.subset_call``:
the call of the last depth's ``attentions`` is captured), and the refusals.
"""

from __future__ import annotations

import pytest
import torch

from gradflow.adapters import adapter_for, block_modules
from gradflow.adapters.subset_blocks import fnet_subset, longformer_subset, mobilebert_subset, xlm_subset
from gradflow.errors import SparseTrainingError
from gradflow.training import SparseMLM, sparse_mlm
from gradflow.training.sparse import call_arguments
from test_sparse_training import assert_same_gradients, gradients
from tiny import tiny_batch, tiny_model

RTOL = 1e-5


def ragged_batch(t: int = 20, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) (3, t): rows padded by 0, 3 and 7 positions, with 4, 1 and 2 loss
    positions (one of them at the last real position of its row)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 64, (3, t), generator=gen)
    mask = torch.ones(3, t, dtype=torch.long)
    mask[1, t - 3:] = 0
    mask[2, t - 7:] = 0
    ids[:, 0] = 2
    ids[mask == 0] = 1
    labels = torch.full((3, t), -100)
    for row, positions in enumerate(([1, 5, 9, t - 1], [t - 4], [2, 6])):
        labels[row, positions] = ids[row, positions]
        ids[row, positions] = 4
    return ids, mask, labels


def assert_exact(model: torch.nn.Module, sparse: SparseMLM, ids: torch.Tensor, mask: torch.Tensor,
                 labels: torch.Tensor, **inputs: object) -> None:
    """Sparse loss and every parameter gradient equal the dense model's (relative 1e-5)."""
    loss = model(input_ids=ids, attention_mask=mask, labels=labels, **inputs).loss
    dense = gradients(model, loss)
    out = sparse(ids, mask, labels, **inputs)
    assert abs(out.loss.item() - loss.item()) <= RTOL * abs(loss.item()), (out.loss.item(), loss.item())
    assert_same_gradients(gradients(model, out.loss), dense)


@pytest.mark.parametrize("family", ["mobilebert", "longformer", "fnet"])
@pytest.mark.parametrize("rows", [None, 5])
def test_padded_rows_with_different_loss_counts_equal_the_dense_model(family: str, rows: int | None) -> None:
    model = tiny_model(family)
    assert_exact(model, sparse_mlm(model, rows_per_sequence=rows), *ragged_batch())


@pytest.mark.parametrize("family", ["mobilebert", "longformer", "fnet"])
def test_training_mode_without_dropout_equals_the_dense_model(family: str) -> None:
    """Training mode (the dropout calls of the block's own modules, Longformer's attention dropout) with every
    dropout probability 0: the same numbers as the dense model in training mode."""
    model = tiny_model(family, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).train()
    assert_exact(model, sparse_mlm(model), *ragged_batch())


def test_mobilebert_extra_bottleneck_modules_are_refused() -> None:
    model = tiny_model("mobilebert")
    ids, mask, _ = ragged_batch(t=16)
    block, call, _ = block_call(model, ids, mask)
    block.bottleneck.add_module("gate", torch.nn.Linear(32, 32))
    with pytest.raises(SparseTrainingError, match="bottleneck.gate beyond MobileBERT's layout"):
        mobilebert_subset(block, call, torch.zeros(3, 1, dtype=torch.long))


def xlm_sparse(model: torch.nn.Module, rows: int | None = None) -> SparseMLM:
    """XLM/FlauBERT through ``sparse_mlm``: the adapter's ``subset_call`` captures the last depth's attention call."""
    return sparse_mlm(model, rows_per_sequence=rows)


@pytest.mark.parametrize("family", ["xlm", "flaubert"])
def test_xlm_last_depth_equals_the_dense_model(family: str) -> None:
    """XLM and FlauBERT: exact on the tiny batch and on a ragged one, with and without rows_per_sequence."""
    model = tiny_model(family)
    batch = tiny_batch()
    assert_exact(model, xlm_sparse(model), batch.input_ids, batch.attention_mask, batch.labels)
    assert_exact(model, xlm_sparse(model, rows=5), *ragged_batch())
    shapes = []
    last = model.base_model.attentions[-1]
    handle = last.q_lin.register_forward_hook(lambda m, a, out: shapes.append(tuple(a[0].shape[:2])))
    try:
        xlm_sparse(model).loss(batch.input_ids, batch.attention_mask, batch.labels)
    finally:
        handle.remove()
    most = int((batch.labels != -100).sum(dim=1).max())
    assert shapes == [(3, most)]  # the last depth's query at the loss positions only
    assert "forward" not in vars(last)


@pytest.mark.parametrize("family", ["xlm", "flaubert"])
def test_xlm_in_training_mode_is_exact_and_layerdrop_skips_are_refused(family: str) -> None:
    """Training mode with dropout 0 gives the dense numbers; a skipped last depth (layerdrop) is refused."""
    model = tiny_model(family, dropout=0.0, attention_dropout=0.0).train()
    ids, mask, labels = ragged_batch()
    assert adapter_for(model).subset_call == "attentions"
    assert_exact(model, sparse_mlm(model), ids, mask, labels)
    if family == "flaubert":
        model.config.layerdrop = model.base_model.layerdrop = 1.0  # every depth skipped in training mode
        with pytest.raises(SparseTrainingError, match="layerdrop"):
            sparse_mlm(model).loss(ids, mask, labels)


def test_xlm_refuses_causal_masks_and_caches() -> None:
    model = tiny_model("xlm")
    block = block_modules(adapter_for(model), model.base_model)[-1]
    hidden = torch.randn(2, 6, 32)
    index = torch.tensor([[1], [2]])
    with pytest.raises(SparseTrainingError, match="causal.*block=False"):
        xlm_subset(block, {"input": hidden, "mask": torch.ones(2, 6, 6)}, index)
    with pytest.raises(SparseTrainingError, match="cached keys or encoder states.*block=False"):
        xlm_subset(block, {"input": hidden, "mask": torch.ones(2, 6), "kv": hidden}, index)


def test_longformer_longer_than_its_window() -> None:
    """A one-sided window of 4 over 30 positions (padded to 32 by the model): the band masks most keys of each
    query, as in the model's sliding chunks; row 2 is padded past a whole window."""
    model = tiny_model("longformer")
    ids, mask, labels = ragged_batch(t=30)
    mask[2, 18:] = 0
    labels[2, 18:] = -100
    assert_exact(model, sparse_mlm(model), ids, mask, labels)


@pytest.mark.parametrize("global_at", [[0], [0, 5], [0, 5, 9, 17]])
def test_longformer_global_attention_equals_the_dense_model(global_at: list[int]) -> None:
    """Global positions (query_global over key_global/value_global everywhere; every row also attends them):
    not a loss position ([0]), one loss position in row 0 ([0, 5]), several (row 0's 5 and 9, row 1's 17)."""
    model = tiny_model("longformer")
    ids, mask, labels = ragged_batch(t=24)
    global_mask = torch.zeros_like(mask)
    global_mask[:, global_at] = 1
    global_mask *= mask
    assert_exact(model, sparse_mlm(model), ids, mask, labels, global_attention_mask=global_mask)
    grads = gradients(model, sparse_mlm(model).loss(ids, mask, labels, global_attention_mask=global_mask))
    last_global = grads["longformer.encoder.layer.2.attention.self.query_global.weight"]
    assert (float(last_global.norm()) == 0.0) == (global_at == [0])  # it forms only global rows


def block_call(model: torch.nn.Module, ids: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.nn.Module, dict, torch.Tensor]:
    """The last block, the arguments of its call and its dense output (B, T, H) (the block list read directly: the
    MobileBERT adapter refuses the layouts other than the published one for recording)."""
    block = model.base_model.encoder.layer[-1]
    seen: list[tuple[dict, torch.Tensor]] = []

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, out: object) -> None:
        seen.append((call_arguments(module.forward, args, kwargs), out[0] if isinstance(out, tuple) else out))

    handle = block.register_forward_hook(hook, with_kwargs=True)
    try:
        model.base_model(input_ids=ids, attention_mask=mask)
    finally:
        handle.remove()
    return block, *seen[0]


@pytest.mark.parametrize("layout", [dict(intra_bottleneck_size=16, true_hidden_size=16),  # the published: narrow
                                    dict(use_bottleneck_attention=True, intra_bottleneck_size=16,
                                         true_hidden_size=16),
                                    dict(key_query_shared_bottleneck=False),
                                    dict(use_bottleneck=False, num_feedforward_networks=1)])
def test_mobilebert_bottleneck_layouts(layout: dict) -> None:
    """Every bottleneck layout of MobileBERT's config: the subset block's rows are the block's own outputs there."""
    model = tiny_model("mobilebert", **layout)
    ids, mask, _ = ragged_batch()
    block, call, dense = block_call(model, ids, mask)
    index = torch.tensor([[1, 5, 19], [0, 16, 16], [2, 6, 12]])
    rows = mobilebert_subset(block, call, index)
    expected = dense.gather(1, index[..., None].expand(-1, -1, dense.shape[-1]))
    torch.testing.assert_close(rows, expected, rtol=1e-5, atol=1e-6)


def test_fnet_mixes_every_position_but_normalises_only_the_selected_ones() -> None:
    model = tiny_model("fnet")
    ids, mask, _ = ragged_batch()
    block, call, dense = block_call(model, ids, mask)
    index = torch.tensor([[3], [0], [19]])
    shapes = []
    handle = block.fourier.output.LayerNorm.register_forward_hook(lambda m, a, out: shapes.append(a[0].shape[:2]))
    try:
        rows = fnet_subset(block, call, index)
    finally:
        handle.remove()
    assert shapes == [(3, 1)]
    torch.testing.assert_close(rows, dense.gather(1, index[..., None].expand(-1, -1, 32)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("family", "subset", "extra"), [("mobilebert", mobilebert_subset, "attention.self"),
                                                         ("longformer", longformer_subset, "attention.self"),
                                                         ("fnet", fnet_subset, "fourier.output")])
def test_blocks_with_extra_modules_are_refused(family: str, subset, extra: str) -> None:
    model = tiny_model(family)
    ids, mask, _ = ragged_batch(t=16)
    block, call, _ = block_call(model, ids, mask)
    block.get_submodule(extra).add_module("adapter", torch.nn.Linear(32, 32))
    with pytest.raises(SparseTrainingError, match=f"{extra}.adapter beyond .* layout.*block=False"):
        subset(block, call, torch.zeros(3, 1, dtype=torch.long))


def test_longformer_refuses_a_mask_it_does_not_build() -> None:
    model = tiny_model("longformer")
    ids, mask, _ = ragged_batch(t=16)
    block, call, _ = block_call(model, ids, mask)
    call["attention_mask"] = call["attention_mask"] == 0
    with pytest.raises(SparseTrainingError, match=r"not the \(B, T\) float mask.*block=False"):
        longformer_subset(block, call, torch.zeros(3, 1, dtype=torch.long))


@pytest.mark.parametrize("family", ["mobilebert", "longformer", "fnet", "xlm"])
def test_bfloat16_autocast_stays_close(family: str) -> None:
    """CPU bfloat16 autocast (the recipe's setting): the masks cast to the queries' dtype, the loss the dense one
    to bfloat16 precision."""
    model = tiny_model(family)
    ids, mask, labels = ragged_batch(t=24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dense = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        sparse = (xlm_sparse(model) if family == "xlm" else sparse_mlm(model)).loss(ids, mask, labels)
    assert abs(sparse.item() - dense.item()) <= 2e-2 * dense.item()
