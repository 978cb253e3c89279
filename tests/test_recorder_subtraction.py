"""The largest role's contribution from autograd's weight gradient (capture around ``loss.backward()``).

Under ``loss.backward()`` the recorder takes the role with the most rows (context) as the weight
gradient autograd computes anyway minus the other rows' product; these tests check that it is used,
that it equals the direct product of ``rec.record()``, and that it is refused where it would be wrong.
"""

from __future__ import annotations

import pytest
import torch

import gradflow.hooks.sublayer_stats as sublayer_stats
from gradflow import GradFlowRecorder, mlm_loss
from gradflow.hooks.sublayer_stats import EPS32, PROBE_TOL, subtracted_norm
from tiny import tiny_batch, tiny_model


@pytest.fixture
def outcomes(monkeypatch):
    """Counts of accepted and refused subtractions while the test runs."""
    seen = {"accepted": 0, "refused": 0}
    original = sublayer_stats.subtracted_norm

    def counting(*args):
        value = original(*args)
        seen["accepted" if value is not None else "refused"] += 1
        return value

    monkeypatch.setattr(sublayer_stats, "subtracted_norm", counting)
    return seen


def _norms(record):
    frame = record.sublayer_frame()
    return torch.tensor(frame.contribution_norm.values, dtype=torch.float64)


def _captured(rec, model, batch, extra=None):
    with rec.capture(batch.roles):
        loss = mlm_loss(model(**batch.model_inputs()).logits, batch)
        (loss if extra is None else loss + extra()).backward()
    return rec.result()


@pytest.mark.parametrize("family", ["bert", "modernbert", "esm"])
def test_subtraction_is_used_and_equals_the_direct_product(family, outcomes):
    model, batch = tiny_model(family), tiny_batch()
    with GradFlowRecorder(model) as rec:
        direct = rec.record(batch)
        assert outcomes == {"accepted": 0, "refused": 0}  # record(): no weight gradient, direct products
        captured = _captured(rec, model, batch)
    assert outcomes["accepted"] > 0
    a, b = _norms(direct), _norms(captured)
    assert torch.equal(a == 0, b == 0)  # exact zeros stay exact
    torch.testing.assert_close(b, a, rtol=1e-5, atol=0)


def test_a_penalty_on_the_weights_is_detected_and_refused(outcomes):
    model, batch = tiny_model("bert"), tiny_batch()
    weights = [p for name, p in model.named_parameters() if name.endswith("dense.weight") and ".layer." in name]
    with GradFlowRecorder(model) as rec:
        direct = rec.record(batch)
        penalised = _captured(rec, model, batch, lambda: 1e-3 * sum((w * w).sum() for w in weights))
    assert outcomes["refused"] > 0
    torch.testing.assert_close(_norms(penalised), _norms(direct), rtol=1e-5, atol=0)


def test_autograd_grad_inside_capture_falls_back_to_direct_products(outcomes):
    model, batch = tiny_model("roberta"), tiny_batch()
    with GradFlowRecorder(model) as rec:
        direct = rec.record(batch)
        with rec.capture(batch.roles):
            loss = mlm_loss(model(**batch.model_inputs()).logits, batch)
            torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad][:1], allow_unused=True)
        other = rec.result()
    torch.testing.assert_close(_norms(other), _norms(direct), rtol=1e-5, atol=0)


def test_subtracted_norm_refuses_inexact_or_foreign_gradients():
    gen = torch.Generator().manual_seed(0)
    g, x = torch.randn(40, 6, generator=gen), torch.randn(40, 5, generator=gen)
    rest = torch.arange(40) < 8  # rows 0..7: the other roles; 8..39: the big role
    probe = torch.randn(5, generator=gen)

    def norm(g, x, w):
        mag = g.norm(dim=1) * x.norm(dim=1)
        return subtracted_norm(w, g, g[rest], x[rest], mag, probe, x @ probe)

    want = float((g[~rest].double().T @ x[~rest].double()).norm())
    assert norm(g, x, g.T @ x) == pytest.approx(want, rel=1e-5)
    # something else added to the weight's gradient (a penalty, another use): refused
    assert norm(g, x, g.T @ x + 1e-3 * torch.ones(6, 5)) is None
    # the big role's rows cancel in pairs: its norm is rounding noise against its magnitudes, refused
    x[9::2], g[9::2] = -x[8::2], g[8::2]
    assert norm(g, x, g.T @ x) is None
    assert PROBE_TOL * EPS32 < 1e-5
