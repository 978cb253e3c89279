"""Exact zeros and norms at extreme loss scales: zero is decided from elements, norms never underflow.

With the MLM loss scaled by 1e-18 every gradient is ~1e-18 times its usual size: its elements are
ordinary float32 numbers, but their float32 squares underflow. Nothing may then be reported as an
exact zero that is not one, and every norm must be 1e-18 times the unscaled one. At 1e+30 the
squares overflow instead.
"""

from __future__ import annotations

import pytest
import torch

from gradflow import GradFlowRecorder, RecorderConfig, mlm_loss
from gradflow.adapters import adapter_for, get_module
from tiny import tiny_batch, tiny_model

TINY, HUGE = 1e-18, 1e30
KEYS = ["layer", "sublayer", "param", "role"]


def _scaled(scale):
    def loss(logits, batch):
        return mlm_loss(logits, batch) * scale

    return loss


def _record(model, batch, scale, materialize):
    with GradFlowRecorder(model, RecorderConfig(materialize=materialize)) as rec:
        return rec.record(batch, loss=_scaled(scale))


@pytest.fixture(scope="module")
def bert():
    return tiny_model("bert"), tiny_batch()


@pytest.fixture(scope="module")
def runs(bert):
    """(plain, scaled by 1e-18) records, each materialised and not (the latter uses the Gram identity)."""
    model, batch = bert
    return {(scale, mat): _record(model, batch, scale, mat) for scale in (1.0, TINY) for mat in (True, False)}


@pytest.mark.parametrize("materialize", [True, False])
def test_tiny_gradients_are_not_reported_as_zero(runs, materialize):
    plain = runs[1.0, materialize].sublayer_frame().set_index(KEYS)
    scaled = runs[TINY, materialize].sublayer_frame().set_index(KEYS)
    assert scaled.index.equals(plain.index)
    # the per-position pattern of nonzero contributions does not depend on the loss scale
    assert (scaled.n_nonzero == plain.n_nonzero).all()
    live = plain.n_nonzero > 0
    assert live.sum() > 100
    assert (scaled.n_nonzero[live] > 0).all()
    assert (scaled.contribution_norm[live] > 0).all()
    assert (scaled.magnitude_sum[live] > 0).all()
    # per position too: a nonzero hidden-state gradient never has norm 0
    grad_plain, grad_scaled = runs[1.0, materialize].grad_norm, runs[TINY, materialize].grad_norm
    assert torch.equal(grad_scaled > 0, grad_plain > 0)


@pytest.mark.parametrize("materialize", [True, False])
def test_last_block_exact_zero_survives_the_scale(bert, runs, materialize):
    model, batch = bert
    record = runs[TINY, materialize]
    frame = record.sublayer_frame()
    last = frame[(frame.layer == record.num_blocks) & (frame.role == "context")]
    zero = set(adapter_for(model).after_mixing())
    assert {"attn.q", "attn.out", "ffn.in", "ffn.out", "ffn.norm"} <= zero
    for row in last.itertuples():
        if row.sublayer in zero:
            assert row.contribution_norm == 0.0 and row.magnitude_sum == 0.0 and row.n_nonzero == 0, row
    weights = last[last.param == "weight"].set_index("sublayer")
    for name in ("attn.k", "attn.v"):
        assert weights.loc[name, "contribution_norm"] > 0 and weights.loc[name, "n_nonzero"] > 0
    if materialize:
        for (depth, name, _, role), matrix in record.matrices.items():
            if depth == record.num_blocks - 1 and role == "context" and name in zero:
                assert torch.count_nonzero(matrix) == 0


def test_role_contributions_sum_to_the_scaled_autograd_grad(bert, runs):
    model, batch = bert
    record = runs[TINY, True]
    value = _scaled(TINY)(model(**batch.model_inputs()).logits, batch)
    adapter = adapter_for(model)
    blocks = GradFlowRecorder(model).blocks
    modules = [(d, name, get_module(b, spec.path), spec.chunk)
               for name, spec in adapter.sublayers.items() for d, b in enumerate(blocks)]
    params = [(d, name, param, getattr(m, param), chunk)
              for d, name, m, chunk in modules for param in ("weight", "bias")]
    refs = torch.autograd.grad(value, [p for *_, p, _ in params])
    # the key bias's true gradient is 0 (softmax is shift-invariant): judge it against the model's scale
    floor = 1e-3 * max(float(r.double().norm()) for r in refs)
    checked = 0
    for (depth, name, param, _, chunk), ref in zip(params, refs):
        if chunk is not None:
            i, n = chunk
            size = ref.shape[0] // n
            ref = ref[i * size:(i + 1) * size]
        total = sum(m for (d, s, p, _), m in record.matrices.items() if (d, s, p) == (depth, name, param))
        error = float((total.double() - ref.double()).norm())
        assert error <= 1e-5 * max(float(ref.double().norm()), floor), (depth, name, param)
        checked += 1
    assert checked == 3 * 16


@pytest.mark.parametrize("materialize", [True, False])
def test_scaled_norms_are_the_scaled_plain_norms(runs, materialize):
    plain = runs[1.0, materialize].sublayer_frame().set_index(KEYS)
    scaled = runs[TINY, materialize].sublayer_frame().set_index(KEYS)
    for column in ("contribution_norm", "magnitude_sum"):
        want = torch.tensor(plain[column].values, dtype=torch.float64) * TINY
        got = torch.tensor(scaled[column].values, dtype=torch.float64)
        # a role's rounding error is relative to the sum of its contributions' magnitudes
        slack = 1e-7 * TINY * torch.tensor(plain.magnitude_sum.values, dtype=torch.float64)
        assert torch.all((got - want).abs() <= 1e-5 * want + slack), column
    want = runs[1.0, materialize].grad_norm.double() * TINY
    torch.testing.assert_close(runs[TINY, materialize].grad_norm.double(), want, rtol=1e-5, atol=0)


def test_huge_gradients_do_not_overflow_the_norms(bert, runs):
    model, batch = bert
    plain = runs[1.0, False]
    huge = _record(model, batch, HUGE, False)
    assert torch.isfinite(huge.grad_norm).all()
    torch.testing.assert_close(huge.grad_norm.double(), plain.grad_norm.double() * HUGE, rtol=1e-5, atol=0)
    a, b = plain.sublayer_frame().set_index(KEYS), huge.sublayer_frame().set_index(KEYS)
    assert (a.n_nonzero == b.n_nonzero).all()
    for column in ("contribution_norm", "magnitude_sum"):
        got = torch.tensor(b[column].values, dtype=torch.float64)
        want = torch.tensor(a[column].values, dtype=torch.float64) * HUGE
        slack = 1e-7 * HUGE * torch.tensor(a.magnitude_sum.values, dtype=torch.float64)
        assert torch.isfinite(got).all(), column
        assert torch.all((got - want).abs() <= 1e-5 * want + slack), column


def test_unsafe_rows_flags_exactly_the_rows_outside_the_safe_range():
    from gradflow.hooks.safe_norms import SAFE_MAX, SAFE_MIN, flag_unsafe

    inf, nan = float("inf"), float("nan")
    g = torch.tensor([0.0, 1.0, SAFE_MIN, SAFE_MIN / 2, SAFE_MAX, SAFE_MAX * 2, inf, nan, 1.0, 1.0])
    x = torch.tensor([5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, SAFE_MIN / 4, 0.0])
    flagged = flag_unsafe(torch.stack([g, x, g * x])).any(dim=0)
    # zero is safe (it contributes nothing); the bounds are inclusive; tiny, huge, inf and NaN are not
    assert flagged.tolist() == [False, False, False, True, False, True, True, True, True, False]


def test_safe_norm_matches_the_float64_norm_of_rows_and_matrices():
    """A bert-base-sized matrix norm within 1e-6 of float64 (one sequential float32 reduction over 2.4M
    elements was 4e-5 off); rows that are exactly zero give exactly 0, tiny and huge rows their float64 norm."""
    from gradflow.hooks.safe_norms import safe_norm

    gen = torch.Generator().manual_seed(0)
    matrix = torch.randn(768, 3072, generator=gen)
    want = torch.linalg.vector_norm(matrix.double())
    assert abs(float(safe_norm(matrix, dim=(-2, -1))) - float(want)) <= 1e-6 * float(want)
    rows = torch.randn(6, 3072, generator=gen)
    rows[1] = 0.0
    rows[2] *= 1e-30
    rows[3] *= 1e30
    rows[4, 7] = float("nan")
    got = safe_norm(rows, dim=-1)
    want_rows = torch.linalg.vector_norm(rows.double(), dim=-1)
    assert got[1] == 0 and torch.isnan(got[4])
    for i in (0, 2, 3, 5):
        assert abs(float(got[i]) - float(want_rows[i])) <= 1e-6 * float(want_rows[i]), i
