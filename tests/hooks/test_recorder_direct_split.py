"""The largest role's contribution as one of the two products of the weight gradient (``loss.backward()``).

Inside a capture, each Linear sublayer module whose weight gradient comes from it alone runs through
:class:`gradflow.hooks.split_linear.RoleSplitLinear`: its backward computes ``W = G_big + G_rest``, and
``||G_big||`` is the statistic. These tests check that the split is used, that its norms equal the direct
products of ``rec.record()``, that every gradient equals the bare model's, and that forwards are restored.
"""

from __future__ import annotations

import pytest
import torch

from gradflow import GradFlowRecorder, mlm_loss
from gradflow.hooks import split_linear
from gradflow.hooks.split_linear import RoleSplitLinear, split_linear_forwards, splits_weight
from rounding import assert_within_rounding, matmul_bound
from tiny import tiny_batch, tiny_model


def watch_splits(monkeypatch, seen) -> None:
    """Call ``seen(split)`` with every :class:`DirectSplit` (None: the plain product) the backwards of
    :class:`RoleSplitLinear` take while the test runs."""
    original = RoleSplitLinear.backward

    def watching(ctx, grad_out):
        taker = ctx.take_split

        def take(weight):
            split = taker(weight)
            seen(split)
            return split

        ctx.take_split = take
        return original(ctx, grad_out)

    monkeypatch.setattr(RoleSplitLinear, "backward", staticmethod(watching))


@pytest.fixture
def splits(monkeypatch):
    """How many weight gradients were computed as two products while the test runs."""
    seen = {"split": 0, "plain": 0}

    def count(split) -> None:
        seen["split" if split is not None else "plain"] += 1

    watch_splits(monkeypatch, count)
    return seen


def _norms(record):
    frame = record.sublayer_frame()
    return torch.tensor(frame.contribution_norm.values, dtype=torch.float64)


def _captured(rec, model, batch, extra=None):
    with rec.capture(batch.roles):
        loss = mlm_loss(model(**batch.model_inputs()).logits, batch)
        (loss if extra is None else loss + extra()).backward()
    return rec.result()


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["bert", "modernbert", "esm", "albert"])
def test_split_is_used_and_equals_the_direct_product(family, splits):
    model, batch = tiny_model(family), tiny_batch()
    with GradFlowRecorder(model) as rec:
        direct = rec.record(batch)
        assert splits == {"split": 0, "plain": 0}  # record(): no weight gradient is computed
        captured = _captured(rec, model, batch)
    if family != "albert":  # ALBERT's layer is shared across depths: its weights keep autograd's own product
        assert splits["split"] > 0
    a, b = _norms(direct), _norms(captured)
    assert torch.equal(a == 0, b == 0)  # exact zeros stay exact
    torch.testing.assert_close(b, a, rtol=1e-5, atol=0)


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_every_gradient_equals_the_bare_model(family):
    model, batch = tiny_model(family), tiny_batch()
    mlm_loss(model(**batch.model_inputs()).logits, batch).backward()
    bare = _grads(model)
    model.zero_grad(set_to_none=True)
    with GradFlowRecorder(model) as rec:
        _captured(rec, model, batch)
    recorded = _grads(model)
    assert bare.keys() == recorded.keys()
    for name, grad in bare.items():
        torch.testing.assert_close(recorded[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_penalty_on_the_weights_leaves_the_norms_and_adds_to_the_gradient(splits):
    model, batch = tiny_model("bert"), tiny_batch()
    weights = [p for name, p in model.named_parameters() if name.endswith("dense.weight") and ".layer." in name]
    penalty = lambda: 1e-3 * sum((w * w).sum() for w in weights)  # noqa: E731
    (mlm_loss(model(**batch.model_inputs()).logits, batch) + penalty()).backward()
    bare = _grads(model)
    model.zero_grad(set_to_none=True)
    with GradFlowRecorder(model) as rec:
        direct = rec.record(batch)
        penalised = _captured(rec, model, batch, penalty)
    assert splits["split"] > 0
    torch.testing.assert_close(_norms(penalised), _norms(direct), rtol=1e-5, atol=0)
    for name, grad in bare.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-5, atol=1e-7, msg=name)


def test_autograd_grad_inside_capture_falls_back_to_direct_products(splits):
    model, batch = tiny_model("roberta"), tiny_batch()
    with GradFlowRecorder(model) as rec:
        direct = rec.record(batch)
        with rec.capture(batch.roles):
            loss = mlm_loss(model(**batch.model_inputs()).logits, batch)
            torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad][:1], allow_unused=True)
        other = rec.result()
    assert splits["split"] == 0
    torch.testing.assert_close(_norms(other), _norms(direct), rtol=1e-5, atol=0)


def test_forwards_are_restored_after_the_recorder_and_after_an_error():
    model = tiny_model("bert")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    marker = linears[0].forward = lambda x: torch.zeros(())  # an instance-level forward set by someone else
    with GradFlowRecorder(model):
        assert any("forward" in m.__dict__ for m in linears[1:])
    assert linears[0].forward is marker
    assert not any("forward" in m.__dict__ for m in linears[1:])
    with pytest.raises(RuntimeError, match="boom"), split_linear_forwards(linears[1:3], lambda w: None, lambda m: True):
        assert all("forward" in m.__dict__ for m in linears[1:3])
        raise RuntimeError("boom")
    assert not any("forward" in m.__dict__ for m in linears[1:3])


def test_only_float32_calls_with_gradients_go_through_the_split():
    linear = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    assert splits_weight(linear, x)
    assert not splits_weight(linear, x.double())
    with torch.no_grad():
        assert not splits_weight(linear, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not splits_weight(linear, x)
    linear.weight.requires_grad_(False)
    assert not splits_weight(linear, x)


def test_the_split_backward_is_the_linear_backward():
    """Input, weight and bias gradients of the two-product backward equal nn.Linear's (random rows split)."""
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(6, 5)
    x = torch.randn(3, 7, 6, generator=gen, requires_grad=True)
    upstream = torch.randn(3, 7, 5, generator=gen)
    (linear(x) * upstream).sum().backward()
    want = (x.grad.clone(), linear.weight.grad.clone(), linear.bias.grad.clone())
    x.grad, linear.weight.grad, linear.bias.grad = None, None, None
    rows = torch.randperm(21, generator=gen)
    seen = []
    split = split_linear.DirectSplit(rows[:15].sort().values, rows[15:].sort().values, lambda m: seen.append(m.clone()))
    out = RoleSplitLinear.apply(x, linear.weight, linear.bias, linear, lambda w: split, lambda m: True)
    (out * upstream).sum().backward()
    g2, x2 = upstream.reshape(-1, 5), x.detach().reshape(-1, 6)
    for got, expected in zip((x.grad, linear.bias.grad), (want[0], want[2])):  # autograd's operations, same data
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # G_big + G_rest: autograd's 21-term sums in another order, equal to their float32 rounding on any CPU
    assert_within_rounding(linear.weight.grad, want[1], matmul_bound(g2.T, x2), "weight")
    big = split.big
    torch.testing.assert_close(seen[0], g2[big].T @ x2[big], rtol=1e-6, atol=1e-6)  # G_big before G_rest was added
    assert len(seen) == 1


def test_q_k_v_share_one_input_side_and_it_is_dropped_with_the_batch(monkeypatch):
    """BERT's q, k and v read one hidden state: its input side is computed once (4 inputs per block, not 6
    Linear calls), gives the statistics a fresh computation per module gives, and is not kept past the batch."""
    import gc
    import weakref

    from gradflow.hooks import linear_inputs

    model, batch = tiny_model("bert"), tiny_batch()
    made: list[weakref.ref] = []
    original = linear_inputs.InputRows.of.__func__

    def counting(cls, x, *args):
        rows = original(cls, x, *args)
        made.append(weakref.ref(rows))
        return rows

    with GradFlowRecorder(model) as rec:
        monkeypatch.setattr(linear_inputs.InputRows, "of", classmethod(counting))
        shared = _captured(rec, model, batch)
        gc.collect()
        assert len(made) == 4 * rec.num_blocks
        assert all(ref() is None for ref in made)  # the slot was emptied when the capture ended
        model.zero_grad(set_to_none=True)
        monkeypatch.setattr(linear_inputs.InputSlot, "get", lambda self, x, *args: linear_inputs.InputRows.of(x, *args))
        fresh = _captured(rec, model, batch)
    assert len(made) == 10 * rec.num_blocks  # without the slot: one per Linear call (6 per block)
    a, b = _norms(fresh), _norms(shared)
    assert torch.equal(a == 0, b == 0)
    torch.testing.assert_close(b, a, rtol=1e-6, atol=0)
