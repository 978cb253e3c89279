"""Atomic checkpoints of everything a bit-identical resume needs, loadable with ``weights_only=True``.

One file, ``<out>/checkpoint.pt``, replaced atomically (write to a temporary file in the same
folder, fsync, ``os.replace``). Its contents are only tensors, numbers, strings, lists and dicts:
model and optimiser state dicts, the scheduler's state dict (no lambdas), the step, the data
position, the Python / NumPy / torch CPU / CUDA RNG states, the loss curve so far and the run's
config. Nothing is unpickled beyond what ``torch.load(weights_only=True)`` allows.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

FORMAT = 1
CHECKPOINT_NAME = "checkpoint.pt"


def rng_state() -> dict[str, object]:
    """Python, NumPy (legacy global), torch CPU and CUDA generator states as tensors and numbers."""
    version, py_state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    state: dict[str, object] = {
        "python": {"version": version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def set_rng_state(state: dict[str, object]) -> None:
    """Restore what ``rng_state`` returned (CUDA states only where CUDA devices exist)."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state((npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"],
                         npst["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out: Path, payload: dict[str, object]) -> Path:
    """Write ``payload`` (plus format and RNG states) to ``out/checkpoint.pt`` atomically; return the path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / CHECKPOINT_NAME
    tmp = out / f".{CHECKPOINT_NAME}.tmp{os.getpid()}"
    full = {"format": FORMAT, "rng": rng_state(), **payload}
    with open(tmp, "wb") as fh:
        torch.save(full, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(out: Path, map_location: str | torch.device = "cpu") -> dict[str, object] | None:
    """The checkpoint in ``out`` loaded with ``weights_only=True``, or None when there is none."""
    path = out / CHECKPOINT_NAME
    if not path.exists():
        return None
    payload = torch.load(path, map_location=map_location, weights_only=True)
    if payload.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {payload.get('format')!r}, expected {FORMAT}")
    return payload
