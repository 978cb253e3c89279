"""bfloat16 and float16 recording: the per-role split in the model's own dtype (issue 50, item 3).

A Linear whose weights and input are bfloat16 (or float16) goes through
:class:`gradflow.hooks.split_linear.RoleSplitLinear` as a float32 one does: under ``loss.backward()`` the
largest role's contribution is one of the two products the weight gradient is computed from, in the
dtype (float32 accumulation inside, rounded once). ``rec.record()`` takes that role's product in the dtype
too. These tests check, in both dtypes, that

- the split is used, and every norm, magnitude and count is within the dtype's tolerance of the float32
  products of the same (low-precision) rows, which ``RecorderConfig(materialize=True)`` computes;
- the materialised contributions sum to the weight gradients autograd computes in the dtype;
- the weight gradients the split leaves in ``.grad`` are the bare model's to the dtype's rounding;
- exact zeros stay exactly zero (the last block's context role after attention), and tiny nonzero
  contributions are never reported as zero (float16's products of tiny rows are recomputed in float32).

Tolerances of the split against the float32 products of the same rows, relative to the largest value of
each compared (layer, sublayer, parameter): bfloat16 1e-2 (its unit roundoff is 2^-8 = 3.9e-3; the largest
role's product and, on a CPU, the per-position norms are each rounded once to it), float16 2e-3 (2^-11 =
4.9e-4). Against autograd's own gradients in the dtype, ``tests/hooks/test_cuda.py``'s: 5e-2 and 1e-2.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

from gradflow import GradFlowRecorder, RecorderConfig, mlm_loss
from gradflow.adapters import adapter_for, get_module
from gradflow.hooks import safe_norms
from gradflow.hooks.split_linear import splits_weight
from gradflow.hooks.sublayer_stats import split_by_role
from test_recorder_direct_split import _captured, _grads, splits  # noqa: F401  (splits: a fixture)
from tiny import tiny_batch, tiny_model

DTYPES = {"bfloat16": (torch.bfloat16, 1e-2), "float16": (torch.float16, 2e-3)}
"""Reduced precision -> (dtype, tolerance of the split against the float32 products of the same rows)."""
AUTOGRAD_TOL = {"bfloat16": 5e-2, "float16": 1e-2}
"""Tolerance against autograd's own gradients in the dtype (``tests/hooks/test_cuda.py``'s): autograd's reductions
in the dtype (a LayerNorm's gain and bias sums, say) round differently from the float32 ones of the split."""
KEY = ["layer", "sublayer", "param", "role"]


def _scaled(scale: float):
    def loss(logits, batch):
        return mlm_loss(logits, batch) * scale

    return loss


SCALED = {"bfloat16": mlm_loss, "float16": _scaled(2.0 ** 10)}
"""The loss a training step in the dtype backpropagates (float16: scaled, as a GradScaler does)."""


def _low(family: str, precision: str) -> torch.nn.Module:
    return tiny_model(family).to(DTYPES[precision][0])


def _batch():
    return tiny_batch(b=4, t=24)  # 96 rows: context the largest role by far, as in a real batch


def _reference(model, batch, loss=mlm_loss, mode="record"):
    """Every role's own float32 product of the model's (low-precision) rows: the exact split of its data, from
    the same computation as ``mode``'s (``record()``'s head runs at the loss positions only: in a reduced
    precision another path rounds differently)."""
    float32_norms = mock.patch.object(safe_norms, "_plain_norm", _float32_norm)  # no norm in the dtype either
    with float32_norms, GradFlowRecorder(model, RecorderConfig(materialize=True)) as rec:
        if mode == "record":
            return rec.record(batch, loss=loss)
        with rec.capture(batch.roles):
            loss(model(**batch.model_inputs()).logits, batch).backward()
        return rec.result()


def _float32_norm(x: torch.Tensor, dim, native: bool) -> torch.Tensor:
    return torch.linalg.vector_norm(x, dim=dim, dtype=torch.float32)


def _assert_close(got, want, tol: float) -> None:
    """Sublayer frames: counts equal, norms and magnitudes within ``tol`` x each group's largest; zeros exact."""
    a, b = got.sublayer_frame().set_index(KEY).sort_index(), want.sublayer_frame().set_index(KEY).sort_index()
    assert a.index.equals(b.index)
    assert (a.n_positions == b.n_positions).all() and (a.n_nonzero == b.n_nonzero).all()
    for column in ("contribution_norm", "magnitude_sum"):
        x, y = a[column].to_numpy(np.float64), b[column].to_numpy(np.float64)
        np.testing.assert_array_equal(x == 0, y == 0)  # exact zeros stay exact, nonzeros stay nonzero
        largest = b[column].groupby(level=["layer", "sublayer", "param"]).transform("max").to_numpy(np.float64)
        assert np.all(np.abs(x - y) <= tol * largest), column


@pytest.mark.parametrize("precision", list(DTYPES))
@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_the_split_runs_in_the_dtype_within_its_tolerance(family, precision, splits):
    model, batch = _low(family, precision), _batch()
    want = _reference(model, batch)
    want_captured = _reference(model, batch, mode="capture")
    model.zero_grad(set_to_none=True)
    splits.update(split=0, plain=0)
    with GradFlowRecorder(model) as rec:
        recorded = rec.record(batch)  # the largest role's own product, in the dtype
        assert splits == {"split": 0, "plain": 0}
        captured = _captured(rec, model, batch)  # loss.backward(): the weight gradient's two products
    assert splits["split"] > 0
    tol = DTYPES[precision][1]
    _assert_close(recorded, want, tol)
    _assert_close(captured, want_captured, tol)
    for site in want.site_names:  # site norms are exact float32 norms of the dtype's values, in every mode
        assert torch.equal(recorded.site(site)[0] > 0, want.site(site)[0] > 0)
        torch.testing.assert_close(recorded.site(site)[0], want.site(site)[0], rtol=1e-6, atol=0)


@pytest.mark.parametrize("precision", list(DTYPES))
def test_role_contributions_sum_to_the_autograd_grad_in_the_dtype(precision):
    """The float32 contributions of the dtype's rows against the weight gradients the same backward computes
    in the dtype (a GradScaler's scale for float16, whose smallest normal is 6.1e-5)."""
    model, batch = _low("bert", precision), _batch()
    record = _reference(model, batch, SCALED[precision], mode="capture")  # .grad: autograd's, in the dtype
    adapter = adapter_for(model)
    blocks = GradFlowRecorder(model).blocks
    floor = 1e-3 * max(float(p.grad.float().norm()) for p in model.parameters() if p.grad is not None)
    tol, checked = AUTOGRAD_TOL[precision], 0
    for name, spec in adapter.sublayers.items():
        for depth, block in enumerate(blocks):
            module = get_module(block, spec.path)
            if not split_by_role(module, spec):
                continue
            for param in ("weight", "bias"):
                ref = getattr(module, param).grad.double()
                total = sum(m.double() for (d, s, p, _), m in record.matrices.items()
                            if (d, s, p) == (depth, name, param))
                assert float((total - ref).norm()) <= tol * max(float(ref.norm()), floor), (name, depth, param)
                checked += 1
    assert checked == 3 * 16


@pytest.mark.parametrize("precision", list(DTYPES))
def test_the_split_leaves_the_bare_weight_gradients(precision):
    """``W = round(G_big) + G_rest``, rounded: the bare model's gradient to about one unit in the last place."""
    model, batch, loss = _low("bert", precision), _batch(), SCALED[precision]
    loss(model(**batch.model_inputs()).logits, batch).backward()
    bare = _grads(model)
    model.zero_grad(set_to_none=True)
    with GradFlowRecorder(model) as rec:
        with rec.capture(batch.roles):
            loss(model(**batch.model_inputs()).logits, batch).backward()
        rec.result()
    recorded = _grads(model)
    assert bare.keys() == recorded.keys()
    tol = DTYPES[precision][1]
    for name, grad in bare.items():
        assert recorded[name].dtype == grad.dtype
        error = float((recorded[name].double() - grad.double()).norm())
        assert error <= tol * float(grad.double().norm()) + 1e-30, name


@pytest.mark.parametrize("mode", ["capture", "record"])
@pytest.mark.parametrize("precision", list(DTYPES))
@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_last_block_exact_zeros_stay_exact_in_the_dtype(family, precision, mode):
    model, batch = _low(family, precision), _batch()
    with GradFlowRecorder(model) as rec:
        record = _captured(rec, model, batch) if mode == "capture" else rec.record(batch)
    frame = record.sublayer_frame()
    last = frame[(frame.layer == record.num_blocks) & (frame.role == "context")]
    zero = set(adapter_for(model).after_mixing())
    assert {"attn.q", "attn.out", "ffn.out"} <= zero
    for row in last.itertuples():
        if row.sublayer in zero:
            assert row.contribution_norm == 0.0 and row.magnitude_sum == 0.0 and row.n_nonzero == 0, row
    weights = last[last.param == "weight"].set_index("sublayer")
    for name in ("attn.k", "attn.v"):
        if name in weights.index:  # ModernBERT's fused Wqkv serves q, k and v as row chunks of one module
            assert weights.loc[name, "contribution_norm"] > 0 and weights.loc[name, "n_nonzero"] > 0
    grad, _ = record.site(f"blocks.{record.num_blocks - 1}.out")
    assert torch.all(grad[batch.roles == 3] == 0)  # context


@pytest.mark.parametrize(("precision", "scale"), [("bfloat16", 1e-18), ("float16", 2.0 ** -10)])
def test_tiny_contributions_are_not_reported_as_zero(precision, scale, splits):
    """bfloat16 has float32's range: at 1e-18 every square underflows and the float64 pass takes over.
    float16's products of tiny rows fall below its smallest normal (6.1e-5) or flush to 0: their norms are
    recomputed from the float32 product, so they agree with the float32 split of the same rows."""
    model, batch = _low("bert", precision), _batch()

    def loss(logits, batch):
        return mlm_loss(logits, batch) * scale

    want = {mode: _reference(model, batch, loss, mode) for mode in ("record", "capture")}
    model.zero_grad(set_to_none=True)
    splits.update(split=0, plain=0)
    with GradFlowRecorder(model) as rec:
        recorded = rec.record(batch, loss=loss)
        with rec.capture(batch.roles):
            loss(model(**batch.model_inputs()).logits, batch).backward()
        captured = rec.result()
    assert splits["split"] > 0
    for got, mode in ((recorded, "record"), (captured, "capture")):
        frame = want[mode].sublayer_frame()
        live = frame.n_nonzero > 0
        assert live.sum() > 50 and (frame.contribution_norm[live] > 0).all()
        _assert_close(got, want[mode], DTYPES[precision][1])


def test_bfloat16_and_float16_calls_go_through_the_split():
    for dtype in (torch.bfloat16, torch.float16):
        linear = torch.nn.Linear(4, 3).to(dtype)
        x = torch.randn(2, 4, dtype=dtype)
        assert splits_weight(linear, x)
        assert not splits_weight(linear, x.float())  # an input of another dtype: the module's own forward
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not splits_weight(linear, x)
    assert not splits_weight(torch.nn.Linear(4, 3).double(), torch.randn(2, 4, dtype=torch.float64))
