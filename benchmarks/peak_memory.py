"""Peak memory of a block of code above what was in use when it began, for the benchmarks that measure one step in a
fresh process (``bench_recorder.py``, ``bench_experts.py``): CUDA's allocator peak on a GPU, else the process's peak
resident set (Linux: ``VmHWM`` of ``/proc/self/status``, its high-water mark reset through ``/proc/self/clear_refs``).

    with PeakMemory(device) as peak:
        step()
    print(peak.mib)

``PeakLiveTensors`` counts the tensors the body's operators create instead (deterministic; ``bench_experts.py``).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def status_mib(field: str) -> float:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) in MiB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakMemory:
    """``mib``: the peak memory of the ``with`` body above the memory in use at its start (MiB)."""

    def __init__(self, device: str) -> None:
        self.cuda = str(device).startswith("cuda")
        self.base = 0.0
        self.mib = float("nan")

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated() / 2**20
        else:
            with open("/proc/self/clear_refs", "w") as fh:  # reset the peak-RSS high-water mark (Linux)
                fh.write("5")
            self.base = status_mib("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.mib = torch.cuda.max_memory_allocated() / 2**20 - self.base
        else:
            self.mib = status_mib("VmHWM") - self.base


class PeakLiveTensors(TorchDispatchMode):
    """``mib``: the peak, over the ``with`` body, of the bytes held by tensors its operators created (each new
    storage counted from its creation until it is freed; views and in-place results of existing storages not
    counted). Deterministic, unlike a peak RSS (which moves by about 0.1 of a small step between fresh processes
    with the allocator's reuse of pages): the same step gives the same number on any run.

        with PeakLiveTensors() as live:
            step()
        print(live.mib)
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: set[int] = set()
        self.current = 0
        self.peak = 0
        self.mib = float("nan")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for tensor in _tensors(out):
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in inputs or key in self.live:
                continue
            self.live.add(key)
            self.current += size
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._freed, key, size)
        return out

    def _freed(self, key: int, size: int) -> None:
        if key in self.live:
            self.live.discard(key)
            self.current -= size

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.mib = self.peak / 2**20


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in a nest of tuples, lists and dicts."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []
