"""Weight snapshots at log-spaced steps, for following a measure through pretraining.

``snapshot_steps(steps, n)`` picks ``n`` optimiser steps spaced evenly in log(step) from
``steps / 2**(n - 1)`` to ``steps`` (rounded, distinct, at least 1). At each, the loop writes the
model's weights (float32 safetensors, atomically) to ``<out>/snapshots/step-NNNNNN.safetensors``;
``<out>/snapshots/snapshots.csv`` lists step, tokens seen and the file's SHA-256. The snapshots are
not shipped; their hashes are what gets committed. A resumed run writes the snapshots it has not
reached yet, and rewriting one that exists gives the same bytes (resume is bit-identical).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from gradflow.models.zoo import sha256 as file_sha256

SNAPSHOT_DIR = "snapshots"
INDEX_NAME = "snapshots.csv"
INDEX_FIELDS = ("step", "tokens", "file", "sha256")


def snapshot_steps(steps: int, n: int) -> tuple[int, ...]:
    """``n`` distinct steps in [1, steps], evenly spaced in log(step), ending at ``steps``; () if n == 0."""
    if n < 0 or steps < 1:
        raise ValueError(f"snapshot_steps needs n >= 0 and steps >= 1, not n={n}, steps={steps}")
    if n == 0:
        return ()
    first = max(1.0, steps / 2 ** (n - 1))
    ratio = (steps / first) ** (1 / (n - 1)) if n > 1 else 1.0
    picked = sorted({min(steps, max(1, round(first * ratio ** i))) for i in range(n)} | {steps})
    return tuple(picked)


def write_snapshot(out: Path, model: torch.nn.Module, step: int, tokens: int) -> Path:
    """Save ``model``'s weights at ``step`` (float32, CPU) and record it in the index; return the file."""
    folder = out / SNAPSHOT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:06d}.safetensors"
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in model.state_dict().items()}
    seen: dict[int, str] = {}
    for name in list(tensors):  # tied weights (decoder = word embeddings) are stored once
        key = tensors[name].data_ptr()
        if key in seen:
            del tensors[name]
        else:
            seen[key] = name
    tmp = folder / f".{path.name}.tmp{os.getpid()}"
    # one metadata key: safetensors writes a map's keys in hash order, which would change the file's bytes
    save_file(tensors, str(tmp), metadata={"gradflow_snapshot": f"step={step} tokens={tokens}"})
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    rows = {row["step"]: row for row in read_index(out)}
    rows[str(step)] = {"step": str(step), "tokens": str(tokens), "file": path.name, "sha256": file_sha256(path)}
    index = folder / INDEX_NAME
    with open(index, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=INDEX_FIELDS)
        writer.writeheader()
        for key in sorted(rows, key=int):
            writer.writerow(rows[key])
    return path


def read_index(out: Path) -> list[dict[str, str]]:
    """The rows of ``<out>/snapshots/snapshots.csv`` (step, tokens, file, sha256), or [] when absent."""
    index = out / SNAPSHOT_DIR / INDEX_NAME
    if not index.exists():
        return []
    with open(index, newline="") as fh:
        return list(csv.DictReader(fh))
