"""``rec.record()`` runs a position-wise MLM head at the loss positions only: the same record as the dense head.

A named loss (``"mlm"``, ``"all-positions"``) takes the sparse path; a callable loss sees the (B, T, V) logits
and takes the dense one, so comparing the two checks the sparse path family by family.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from gradflow import GradFlowRecorder
from gradflow.losses import LOSSES, cross_entropy, cross_entropy_at_labels
from tiny import FAMILIES, tiny_batch, tiny_model


def _same(a, b) -> None:
    assert a.loss == pytest.approx(b.loss, rel=1e-6)
    torch.testing.assert_close(a.grad_norm, b.grad_norm, rtol=1e-5, atol=0)
    assert torch.equal(a.grad_norm == 0, b.grad_norm == 0)  # exact zeros stay exact
    na = torch.tensor(a.sublayer_frame().contribution_norm.values, dtype=torch.float64)
    nb = torch.tensor(b.sublayer_frame().contribution_norm.values, dtype=torch.float64)
    assert torch.equal(na == 0, nb == 0)
    # rounding noise of float32 sums (a contribution that cancels to ~1e-11) is judged against the largest norm
    torch.testing.assert_close(na, nb, rtol=1e-5, atol=1e-7 * float(nb.max()))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_sparse_head_gives_the_dense_record(family: str) -> None:
    model, batch = tiny_model(family), tiny_batch()
    with GradFlowRecorder(model) as rec:
        assert rec._position_wise_head() is not None or rec.adapter.head_mixes_positions
        sparse = rec.record(batch, "mlm")
        dense = rec.record(batch, partial(LOSSES["mlm"], reduction="batch"))
    _same(sparse, dense)


@pytest.mark.parametrize("loss", ["mlm", "all-positions"])
@pytest.mark.parametrize("reduction", ["batch", "sequence"])
def test_every_named_loss_and_reduction(loss: str, reduction: str) -> None:
    model, batch = tiny_model("bert"), tiny_batch()
    with GradFlowRecorder(model) as rec:
        sparse = rec.record(batch, loss, reduction)
        dense = rec.record(batch, partial(LOSSES[loss], reduction=reduction))
    _same(sparse, dense)


def test_cross_entropy_at_labels_equals_the_dense_cross_entropy() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 4, generator=gen, requires_grad=True)
    head = torch.nn.Linear(4, 7)
    labels = torch.full((3, 5), -100)
    labels[0, 1], labels[0, 3], labels[2, 4] = 2, 6, 0  # row 1 has no label
    for reduction in ("batch", "sequence"):
        dense = cross_entropy(head(hidden), labels, reduction)
        (want,) = torch.autograd.grad(dense, hidden)
        sparse = cross_entropy_at_labels(head, hidden, labels, reduction)
        (got,) = torch.autograd.grad(sparse, hidden)
        torch.testing.assert_close(sparse, dense, rtol=1e-6, atol=0)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
        assert torch.equal(got[labels == -100], torch.zeros_like(got[labels == -100]))  # exactly zero off the loss
    with pytest.raises(ValueError, match="unknown reduction"):
        cross_entropy_at_labels(head, hidden, labels, "mean")
