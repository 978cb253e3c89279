"""Peak memory of a block of code above what was in use when it began, for the benchmarks that measure one step in a
fresh process (``bench_recorder.py``, ``bench_experts.py``): CUDA's allocator peak on a GPU, else the process's peak
resident set (Linux: ``VmHWM`` of ``/proc/self/status``, its high-water mark reset through ``/proc/self/clear_refs``).

    with PeakMemory(device) as peak:
        step()
    print(peak.mib)
"""

from __future__ import annotations

import torch


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
