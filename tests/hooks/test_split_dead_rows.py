"""Rows without a contribution left out of the split's products, and per-role norms read from the host once.

In a model's last block past its attention (query, attention output, FFN) the context rows' gradient is exactly
zero, and padding rows have none in any block: their terms ``g_t x_t^T`` of the weight gradient are exact zeros.
The backward of :class:`gradflow.hooks.split_linear.RoleSplitLinear` leaves such whole roles out of ``G_rest``
(:func:`gradflow.hooks.split_linear.live_ranges`), unless a factor is non-finite or extreme (``0 * inf`` is NaN in
autograd's product). :func:`gradflow.hooks.safe_norms.role_norms` gives :func:`safe_norm`'s result for per-role
sums whose empty roles are known. These tests check both against autograd and :func:`safe_norm`.
"""

from __future__ import annotations

import math

import pytest
import torch

from gradflow import GradFlowRecorder, mlm_loss
from gradflow.hooks import split_linear
from gradflow.hooks.linear_inputs import RestRows
from gradflow.hooks.safe_norms import role_norms, safe_norm
from gradflow.hooks.split_linear import RoleSplitLinear, live_ranges
from gradflow.roles import NUM_ROLES, Role
from rounding import assert_within_rounding, matmul_bound
from test_recorder_direct_split import _captured, _grads, watch_splits
from tiny import tiny_batch, tiny_model


@pytest.fixture
def rest_rows(monkeypatch):
    """Per split the backwards take: (rows of ``rest`` multiplied into ``G_rest``, rows of ``rest`` in all)."""
    seen: list[tuple[int, int]] = []

    def count(split) -> None:
        if split is not None:
            total = split.rest.numel() - split.second
            seen.append((total if split.rest_live is None else sum(b - a for a, b in split.rest_live), total))

    watch_splits(monkeypatch, count)
    return seen


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_dead_rows_are_left_out_and_every_gradient_is_the_bare_models(family, rest_rows):
    model, batch = tiny_model(family), tiny_batch()  # padding in its last row
    mlm_loss(model(**batch.model_inputs()).logits, batch).backward()
    bare = _grads(model)
    model.zero_grad(set_to_none=True)
    with GradFlowRecorder(model) as rec:
        _captured(rec, model, batch)
    left_out = [total - used for used, total in rest_rows]
    assert max(left_out) > 0  # the last block's context rows, the padding
    assert all(used <= total for used, total in rest_rows)
    recorded = _grads(model)
    assert bare.keys() == recorded.keys()
    for name, grad in bare.items():
        torch.testing.assert_close(recorded[name], grad, rtol=1e-5, atol=1e-7, msg=name)
        assert torch.equal(recorded[name] == 0, grad == 0), name  # exact zeros where autograd's are


def _rest(counts: dict[int, int]) -> tuple[RestRows, tuple[int, ...]]:
    """A RestRows of roles with these row counts, in the given order (its ``starts``)."""
    starts, at = {}, 0
    for code, n in counts.items():
        starts[code], at = at, at + n
    all_counts = tuple(counts.get(code, 0) for code in range(NUM_ROLES))
    return RestRows(torch.arange(at), starts, torch.zeros(at, 2)), all_counts


def test_live_ranges_keep_every_role_with_a_contribution_or_an_extreme_factor():
    rest, counts = _rest({Role.RANDOM: 2, Role.SPECIAL: 3, Role.CONTEXT: 10})
    live = [0.0] * NUM_ROLES
    live[Role.RANDOM], live[Role.SPECIAL] = 1, 2
    unsafe = [False] * NUM_ROLES
    assert live_ranges(rest, counts, None, live, unsafe) == ((0, 5),)  # adjacent live roles: one product
    assert live_ranges(rest, counts, Role.CONTEXT, live, unsafe) is None  # the rest is every row but second's
    unsafe[Role.CONTEXT] = True  # a dead role with an inf input row: kept (0 * inf is NaN in autograd's product)
    assert live_ranges(rest, counts, None, live, unsafe) is None
    live[Role.RANDOM] = 0
    unsafe[Role.CONTEXT] = False
    assert live_ranges(rest, counts, None, live, unsafe) == ((2, 5),)
    live[Role.SPECIAL] = 0
    assert live_ranges(rest, counts, None, live, unsafe) == ()  # nothing to add to G_big


def test_the_backward_adds_only_the_live_ranges():
    """A split whose dead rows (zero gradient) are left out gives nn.Linear's weight gradient and the products
    over the live rows, to the rounding of their 12-term float32 sums (the CPU's kernel picks the order: not bit
    for bit); a NaN in a dead row's input would have reached autograd's, which is why :func:`live_ranges` keeps
    such rows (the test above)."""
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(6, 5)
    x = torch.randn(1, 12, 6, generator=gen, requires_grad=True)
    upstream = torch.randn(1, 12, 5, generator=gen)
    upstream[0, 4:9] = 0  # rows 4-8: no gradient
    (linear(x) * upstream).sum().backward()
    want = linear.weight.grad.clone()
    linear.weight.grad = None
    big, rest = torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6, 7, 8, 9, 10, 11])
    split = split_linear.DirectSplit(big, rest, lambda *m: None, rest_live=((5, 8),))  # rest rows 9-11
    out = RoleSplitLinear.apply(x, linear.weight, linear.bias, linear, lambda w: split, lambda m: True)
    (out * upstream).sum().backward()
    g2, x2 = upstream.reshape(-1, 5), x.detach().reshape(-1, 6)
    rounding = matmul_bound(g2.T, x2)  # the dead rows' terms are exact zeros: the same sums, another order
    assert_within_rounding(linear.weight.grad, want, rounding, "autograd's")
    live = torch.tensor([0, 1, 2, 3, 9, 10, 11])
    assert_within_rounding(linear.weight.grad, g2[live].T @ x2[live], rounding, "the live rows' product")


def _role_sums(scale: float) -> torch.Tensor:
    """(NUM_ROLES, 2, 16) float32 per-role sums: masked, context and special present; the rest empty (zero)."""
    sums = torch.zeros(NUM_ROLES, 2, 16)
    gen = torch.Generator().manual_seed(1)
    for code in (Role.MASKED, Role.CONTEXT, Role.SPECIAL):
        sums[code] = torch.randn(2, 16, generator=gen) * scale
    return sums


@pytest.mark.parametrize("scale", [1.0, 1e-20, 1e25, 1e-42])
def test_role_norms_are_safe_norms(scale):
    present = [int(Role.MASKED), int(Role.CONTEXT), int(Role.SPECIAL)]
    for sums in (_role_sums(scale), _role_sums(scale)[:, 0]):
        got, want = role_norms(sums, present), safe_norm(sums, dim=-1)
        assert torch.equal(got, want)
        assert bool((got[present] > 0).all()) and not bool(got[[Role.RANDOM, Role.KEPT, Role.PAD]].any())


def test_role_norms_of_a_present_role_summing_to_zero_or_nan():
    sums = _role_sums(1.0)
    present = [int(Role.MASKED), int(Role.CONTEXT), int(Role.SPECIAL)]
    sums[Role.CONTEXT, 1] = 0  # rows that cancel: zero, decided from the elements
    sums[Role.SPECIAL, 0, 3] = math.nan
    got = role_norms(sums, present)
    assert torch.equal(got.isnan(), safe_norm(sums, dim=-1).isnan())
    assert float(got[Role.CONTEXT, 1]) == 0.0 and math.isnan(float(got[Role.SPECIAL, 0]))
    assert torch.equal(got.nan_to_num(-1.0), safe_norm(sums, dim=-1).nan_to_num(-1.0))
