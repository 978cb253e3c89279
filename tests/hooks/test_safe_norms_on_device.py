"""The recorder's accelerator path: safe_norm decides nothing on the host, the backward reads the host once a call.

On a GPU each ``float(...)`` or ``bool(...)`` of a tensor waits for the device; the H200 checklist
measured the full split at 7.5x a bare step. On an accelerator :func:`safe_norm` therefore chooses
between the plain float32 norm and the scaled one with ``torch.where``. These tests run that path on
the CPU (``_without_syncs`` forced) and compare it with the CPU path: the same bits wherever the plain
float32 norm is safe, float32 rounding elsewhere, exact zeros exactly where the elements are zero.
"""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradflow import GradFlowRecorder, RecorderConfig, mlm_loss
from gradflow.hooks import safe_norms
from gradflow.hooks.safe_norms import SAFE_MIN, _safe_norm_on_device, safe_norm, scaled_norm
from tiny import FAMILIES, tiny_batch, tiny_model

KEYS = ["layer", "sublayer", "param", "role"]


def _rows() -> torch.Tensor:
    """(12, 40) float32 rows of every kind: ordinary, tiny (squares underflow), subnormal, huge (squares
    overflow), one nonzero element among zeros, all zero, a NaN, an infinity."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(12, 40, generator=gen)
    rows = [base[0], base[1] * 1e3, base[2] * 1e-20, base[3] * 1e-30, base[4] * 1e-42, base[5] * 1e30,
            base[6] * 3e36, torch.zeros(40), torch.zeros(40), base[9], base[10], base[11]]
    rows[8][17] = 1e-44
    rows[9][3] = float("nan")
    rows[10][5] = float("inf")
    return torch.stack(rows)


def _assert_like_safe_norm(x: torch.Tensor, dim) -> None:
    on_device, on_cpu = _safe_norm_on_device(x, dim), safe_norm(x, dim)
    assert on_device.dtype == on_cpu.dtype == torch.float32 and on_device.shape == on_cpu.shape
    assert torch.equal(on_device.isnan(), on_cpu.isnan())
    plain = torch.linalg.vector_norm(x, dim=dim, dtype=torch.float32)
    safe = (plain >= SAFE_MIN) & ~plain.isinf()
    assert torch.equal(on_device[safe], on_cpu[safe])  # the plain float32 norm, bit for bit
    assert torch.equal(on_device == 0, on_cpu == 0)  # zero exactly where the elements are
    rest = ~safe & ~on_cpu.isnan()
    torch.testing.assert_close(on_device[rest], on_cpu[rest], rtol=2e-6, atol=0)


@pytest.mark.parametrize("dim", [-1, 1])
def test_rows_of_every_magnitude(dim):
    _assert_like_safe_norm(_rows(), dim)


def test_one_matrix_and_stacks_of_matrices():
    x = _rows()
    finite = x[torch.isfinite(x).all(dim=1)]
    for matrix in (finite[:2], finite[2:5], finite[5:7], torch.zeros(3, 40), finite):
        _assert_like_safe_norm(matrix, (-2, -1))
    stack = torch.stack([finite[i: i + 2] for i in range(0, 8, 2)])  # (4, 2, 40): each pair one matrix
    _assert_like_safe_norm(stack, (-2, -1))
    _assert_like_safe_norm(stack.transpose(1, 2), 1)  # a middle dimension


def test_scaled_norm_against_float64():
    x = _rows()[:9]
    exact = torch.linalg.vector_norm(x.double(), dim=-1)
    got = scaled_norm(x, -1)
    torch.testing.assert_close(got.double(), exact.float().double(), rtol=2e-6, atol=0)
    assert torch.equal(got == 0, exact == 0)


def _gradflow_line() -> str:
    """``file.py: source`` of the innermost gradflow frame calling in (``?`` when none)."""
    frames = [f for f in traceback.extract_stack() if "/gradflow/" in f.filename.replace("\\", "/")]
    return f"{frames[-1].filename.rsplit('/', 1)[-1]}: {frames[-1].line}" if frames else "?"


class _Syncs(TorchDispatchMode):
    """Counts, by gradflow source line, what waits for an accelerator: scalar reads and ``nonzero`` (seen by the
    dispatcher), and ``Tensor.cpu`` and ``Tensor.tolist`` (no-ops on the CPU, so counted by wrapping them)."""

    def __init__(self):
        super().__init__()
        self.lines = collections.Counter()

    def __enter__(self):
        self._saved = {name: getattr(torch.Tensor, name) for name in ("cpu", "tolist")}
        for name, method in self._saved.items():
            def counted(tensor, *args, _method=method, **kwargs):
                self.lines[_gradflow_line()] += 1
                return _method(tensor, *args, **kwargs)
            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("_local_scalar_dense", "nonzero", "masked_select"):
            self.lines[_gradflow_line()] += 1
        return func(*args, **(kwargs or {}))


def _record(model, batch, scale=1.0, **config):
    def loss(logits, b):
        return mlm_loss(logits, b) * scale

    with GradFlowRecorder(model, RecorderConfig(**config)) as rec:
        return rec.record(batch, loss=loss)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_recorder_on_the_device_path_gives_the_same_record(family, monkeypatch):
    model, batch = tiny_model(family), tiny_batch()
    plain = _record(model, batch)
    monkeypatch.setattr(safe_norms, "_without_syncs", lambda x: True)
    syncs = _Syncs()
    with syncs:
        device_path = _record(model, batch)
    # while the backward runs, only the one read of each Linear call's per-role counts waits for the device
    during = [line for line in syncs.lines if line.startswith(("safe_norms.py", "sublayer_stats.py"))]
    assert set(during) <= {"sublayer_stats.py: table = sums.T.tolist()  # one sync for every count of the call",
                           "sublayer_stats.py: n_contributing = _scatter_columns([contributes], codes)[:, 0].tolist()"
                           }, syncs.lines
    assert torch.equal(device_path.grad_norm, plain.grad_norm) and torch.equal(device_path.act_norm, plain.act_norm)
    a, b = plain.sublayer_frame().set_index(KEYS), device_path.sublayer_frame().set_index(KEYS)
    assert a.index.equals(b.index)
    assert (a.n_nonzero == b.n_nonzero).all()
    for column in ("magnitude_sum", "contribution_norm"):
        assert ((a[column] == 0) == (b[column] == 0)).all(), column
        torch.testing.assert_close(torch.tensor(b[column].to_numpy()), torch.tensor(a[column].to_numpy()),
                                   rtol=1e-6, atol=0)


@pytest.mark.parametrize("scale", [1e-18, 1e30])
def test_extreme_loss_scales_on_the_device_path(scale, monkeypatch):
    """Squares that underflow (1e-18) or overflow (1e30): the scaled norm matches the float64 recomputation."""
    model, batch = tiny_model("bert"), tiny_batch()
    plain = _record(model, batch, scale)
    monkeypatch.setattr(safe_norms, "_without_syncs", lambda x: True)
    device_path = _record(model, batch, scale)
    assert torch.equal(device_path.grad_norm > 0, plain.grad_norm > 0)
    torch.testing.assert_close(device_path.grad_norm, plain.grad_norm, rtol=2e-6, atol=0)
    a, b = plain.sublayer_frame().set_index(KEYS), device_path.sublayer_frame().set_index(KEYS)
    assert (a.n_nonzero == b.n_nonzero).all()
    for column in ("magnitude_sum", "contribution_norm"):
        assert ((a[column] == 0) == (b[column] == 0)).all(), column
        torch.testing.assert_close(torch.tensor(b[column].to_numpy()), torch.tensor(a[column].to_numpy()),
                                   rtol=1e-5, atol=0)
