"""Which device and process-group backend each torchrun process takes (no GPU needed: pure rules)."""

from __future__ import annotations

import pytest

from gradflow.runs.distributed import init_distributed, process_device, process_group_backend


@pytest.mark.parametrize(("device", "world", "local_rank", "expected"), [
    ("cuda", 4, 3, "cuda:3"),      # one GPU per process on each node
    ("cuda", 1, 0, "cuda"),        # a single process keeps what it was given
    ("cuda:1", 4, 3, "cuda:1"),    # an explicit index is the user's choice
    ("cpu", 4, 3, "cpu"),
    ("mps", 2, 1, "mps"),
])
def test_process_device(device, world, local_rank, expected):
    assert process_device(device, world, local_rank) == expected


def test_cpu_processes_use_gloo_even_where_cuda_is_available(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.delenv("GRADFLOW_BACKEND", raising=False)
    assert process_group_backend("cpu") == "gloo"
    assert process_group_backend("cuda:0") == "nccl"
    monkeypatch.setenv("GRADFLOW_BACKEND", "gloo")
    assert process_group_backend("cuda:0") == "gloo"


def test_no_cuda_means_gloo(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert process_group_backend("cuda") == "gloo"


def test_single_process_initialises_nothing(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed("cpu") == (0, 1, "cpu")
