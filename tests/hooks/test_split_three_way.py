"""The three-way direct split: the weight gradient as ``G_big + G_second + G_rest`` (issue 50, item 3; issue 51).

When the role with the most rows after the largest has enough of them (``split_linear.SECOND_SHARE``), the
backward of :class:`gradflow.hooks.split_linear.RoleSplitLinear` computes its rows as their own product too: its
norm is then that product's, with no Gram matrices and no product beyond autograd's. These tests check that the
three products sum to the Linear's gradient and that each passed product is autograd's per-role product, that a
half-masked batch (a masked-diffusion ratio) takes the three-way split, and that its norms equal ``rec.record()``'s
direct products and its gradients the bare model's.
"""

from __future__ import annotations

import pytest
import torch

from gradflow import GradFlowRecorder, mlm_loss
from gradflow.hooks import split_linear
from gradflow.hooks.split_linear import RoleSplitLinear
from gradflow.roles import Role
from rounding import assert_within_rounding, matmul_bound
from test_recorder_direct_split import _captured, _grads, _norms, watch_splits
from tiny import tiny_batch, tiny_model

DTYPES = {"float32": (torch.float32, 1e-6), "bfloat16": (torch.bfloat16, 1e-2)}
"""dtype -> tolerance against float32 products of the same rows (bfloat16: each product rounded once)."""


@pytest.fixture
def seconds(monkeypatch):
    """The ``second`` row count of every split the backwards take while the test runs."""
    seen: list[int] = []

    def count(split) -> None:
        if split is not None:
            seen.append(split.second)

    watch_splits(monkeypatch, count)
    return seen


def _half_masked(b: int = 4, t: int = 24):
    """tiny_batch with every other context position masked: about half the rows masked (masked diffusion)."""
    batch = tiny_batch(b=b, t=t)
    flip = (batch.roles == Role.CONTEXT) & (torch.arange(t) % 2 == 1)
    batch.roles[flip] = Role.MASKED
    batch.input_ids[flip] = 4
    batch.labels[flip] = batch.original_ids[flip]
    return batch


@pytest.mark.parametrize("precision", list(DTYPES))
def test_the_three_products_sum_to_the_linear_gradient(precision):
    """Input, weight and bias gradients of the three-product backward equal nn.Linear's; ``finish`` gets
    ``G_big`` and ``G_second``, each the per-role product autograd's rows give, before they are summed."""
    dtype, tol = DTYPES[precision]
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(6, 5).to(dtype)
    x = torch.randn(3, 7, 6, generator=gen).to(dtype).requires_grad_(True)
    upstream = torch.randn(3, 7, 5, generator=gen).to(dtype)
    (linear(x) * upstream).sum().backward()
    want = (x.grad.clone(), linear.weight.grad.clone(), linear.bias.grad.clone())
    x.grad, linear.weight.grad, linear.bias.grad = None, None, None
    rows = torch.randperm(21, generator=gen)
    big, second, other = rows[:9].sort().values, rows[9:17].sort().values, rows[17:].sort().values
    seen = []
    split = split_linear.DirectSplit(big, torch.cat([other, second]), lambda *m: seen.append([p.clone() for p in m]),
                                     second=second.numel())
    out = RoleSplitLinear.apply(x, linear.weight, linear.bias, linear, lambda w: split, lambda m: True)
    (out * upstream).sum().backward()
    g2, x2 = upstream.reshape(-1, 5).float(), x.detach().reshape(-1, 6).float()
    for got, expected in zip((x.grad, linear.weight.grad, linear.bias.grad), want):
        assert got.dtype == expected.dtype
        if dtype == torch.float32 and got is linear.weight.grad:  # autograd's 21-term sums in another order
            assert_within_rounding(got, expected, matmul_bound(g2.T, x2), "weight")
            continue
        error = float((got.double() - expected.double()).norm())
        assert error <= tol * float(expected.double().norm()), (got, expected)
    assert len(seen) == 1 and len(seen[0]) == 2
    for product, idx in zip(seen[0], (big, second)):
        torch.testing.assert_close(product.float(), g2[idx].T @ x2[idx], rtol=tol, atol=tol)


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_a_half_masked_batch_takes_the_three_way_split(family, seconds):
    """Norms equal ``rec.record()``'s direct products (exact zeros exact); every gradient the bare model's."""
    model, batch = tiny_model(family), _half_masked()
    mlm_loss(model(**batch.model_inputs()).logits, batch).backward()
    bare = _grads(model)
    model.zero_grad(set_to_none=True)
    with GradFlowRecorder(model) as rec:
        direct = rec.record(batch)
        captured = _captured(rec, model, batch)
    assert seconds and max(seconds) > 0  # the masked role's rows were a product of their own
    a, b = _norms(direct), _norms(captured)
    assert torch.equal(a == 0, b == 0)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=0)
    recorded = _grads(model)
    assert bare.keys() == recorded.keys()
    for name, grad in bare.items():
        torch.testing.assert_close(recorded[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_below_the_share_the_roles_keep_their_gram(monkeypatch, seconds):
    """With the threshold out of reach no role is a product of its own (``split_linear.own_product``): no split
    is taken, the norms come from Gram matrices or products beside the backward, and they are the same."""
    model, batch = tiny_model("bert"), _half_masked()
    with GradFlowRecorder(model) as rec:
        three = _captured(rec, model, batch)
        assert max(seconds) > 0
        seconds.clear()
        monkeypatch.setattr(split_linear, "SECOND_SHARE", float("inf"))
        two = _captured(rec, model, batch)
    assert seconds == []
    a, b = _norms(two), _norms(three)
    assert torch.equal(a == 0, b == 0)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=0)
