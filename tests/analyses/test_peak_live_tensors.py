"""benchmarks/peak_memory.py's PeakLiveTensors: the peak of the tensors a block creates, views and in-place results
of existing storages not counted, freed tensors subtracted."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from peak_memory import PeakLiveTensors  # noqa: E402  (benchmarks/ is not a package)

MIB = 2**20


def test_peak_counts_new_storages_until_freed():
    x = torch.zeros(MIB // 4)  # 1 MiB, created before: not counted
    with PeakLiveTensors() as live:
        a = x + 1  # 1 MiB
        b = torch.ones(2 * MIB // 4)  # 2 MiB: the peak holds a and b
        del a, b
        c = x.view(-1, 4).t()  # a view of x: nothing new
        x.add_(1)  # in place: nothing new
        d = torch.ones(MIB // 4)  # 1 MiB, after a and b were freed
    assert live.mib == 3.0
    assert c.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() and d.numel() == MIB // 4


def test_peak_sees_the_backward_pass():
    w = torch.randn(256, 256, requires_grad=True)
    inputs = torch.randn(512, 256)
    with PeakLiveTensors() as live:
        (inputs @ w).square().sum().backward()
    # the forward's (512, 256) product is held for the backward: at least that much at the peak
    assert live.mib >= 512 * 256 * 4 / MIB and w.grad is not None
