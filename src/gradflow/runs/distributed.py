"""Several processes under torchrun: which device each process takes and which process-group backend.

torchrun sets ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK``; gradflow initialises the process group itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def process_device(device: str, world: int, local_rank: int) -> str:
    """This process's device: under torchrun (``world`` > 1) a bare ``cuda`` becomes ``cuda:<local_rank>``, one
    GPU per process on each node; an explicit index (``cuda:1``) or any other device is kept as given."""
    return f"cuda:{local_rank}" if world > 1 and device == "cuda" else device


def process_group_backend(device: str) -> str:
    """NCCL for processes on CUDA devices, gloo otherwise (CPU processes, also on a GPU machine);
    ``GRADFLOW_BACKEND=gloo`` forces gloo."""
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    return "nccl" if cuda and os.environ.get("GRADFLOW_BACKEND") != "gloo" else "gloo"


def init_distributed(device: str) -> tuple[int, int, str]:
    """(rank, world size, this process's device); initialises the process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = process_device(device, world, int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1 and device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.set_device(torch.device(device))
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend=process_group_backend(device))
    if world > 1:
        return torch.distributed.get_rank(), world, device
    return 0, 1, device


@contextmanager
def distributed_session(device: str) -> Iterator[tuple[int, int, str]]:
    """:func:`init_distributed` for the block inside, yielding (rank, world size, device); on leaving it
    (errors included) the process group it created is destroyed. Left to the interpreter's exit, gloo's
    threads can be torn down while running, and the process aborts with "terminate called without an
    active exception" after its work is done. A group someone else created is left to them."""
    created = not torch.distributed.is_initialized()
    rank, world, device = init_distributed(device)
    try:
        yield rank, world, device
        if created and world > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()  # no rank tears its group down while another's last collective runs
    finally:
        if created and world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


__all__ = ["distributed_session", "init_distributed", "process_device", "process_group_backend"]
