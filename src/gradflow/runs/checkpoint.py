"""Durable checkpoints of a corpus job: the aggregated state, written atomically, verified on load.

A checkpoint is one file ``<out>/.checkpoint/rank<r>/checkpoint-<k>.gfc``: a first line
``gradflow-checkpoint 1 sha256:<hex>`` and then a safetensors payload (tensors only, no pickle) whose
metadata holds the job's JSON state. The hash covers the payload, so a torn or corrupt file is
detected and refused; the previous checkpoint is kept until the next one is durable (temporary
file, flush, fsync, rename, directory fsync), and :func:`latest_checkpoint` falls back to it.

Test hook: the environment variable ``GRADFLOW_FAULT=<point>:<n>`` (read by :func:`fault` only)
kills the process with SIGKILL the n-th time the job passes ``<point>``: ``kill_in_checkpoint``
(half of a checkpoint file written), ``kill_after_checkpoint``, ``kill_after_parts`` (the tables'
parts closed, the checkpoint not yet written) or ``kill_at_batch`` (after a recorded batch); ``<point>:<n>@<r>``
kills only the process of torchrun rank r (``RANK``).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import warnings
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from gradflow.errors import UsageError

CHECKPOINT_DIR = ".checkpoint"
"""Hidden folder of a run directory that holds each process's checkpoints while the run is unfinished."""
FORMAT_LINE = b"gradflow-checkpoint 1 sha256:"
KEEP = 2
"""Checkpoints kept per process: the newest and the one before it."""
FAULT_ENV = "GRADFLOW_FAULT"
_passes: Counter = Counter()


def fault(point: str) -> None:
    """Test hook: SIGKILL this process the n-th time ``point`` is passed when ``GRADFLOW_FAULT=point:n``."""
    spec, _, rank = os.environ.get(FAULT_ENV, "").partition("@")
    if not spec.startswith(point + ":") or (rank and rank != os.environ.get("RANK", "0")):
        return
    _passes[point] += 1
    if _passes[point] == int(spec.split(":", 1)[1]):
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that a rename or a new file in it survives a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_write(path: Path, data: bytes, point: str | None = None) -> None:
    """Write ``data`` to ``path``: a temporary file, flush, fsync, rename, directory fsync.

    ``point``: a :func:`fault` point passed when half of the bytes are written (tests only).
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as handle:
            half = len(data) // 2
            handle.write(data[:half])
            if point is not None:
                handle.flush()
                fault(point)
            handle.write(data[half:])
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@dataclass
class Checkpoint:
    """One process's aggregated state: named float64/int64 tensors and a JSON-able ``state``."""

    state: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    path: Path | None = None

    def to_bytes(self) -> bytes:
        """The file's bytes: the format line with the payload's sha256, then the safetensors payload."""
        tensors = {k: v.contiguous() for k, v in self.tensors.items()}
        payload = save_tensors(tensors, metadata={"state": json.dumps(self.state, sort_keys=True)})
        return FORMAT_LINE + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload

    @classmethod
    def from_bytes(cls, data: bytes, path: Path | None = None) -> Checkpoint:
        """Parse and verify a checkpoint file's bytes; ValueError when torn, corrupt or not a checkpoint."""
        head, sep, payload = data.partition(b"\n")
        if not sep or not head.startswith(FORMAT_LINE):
            raise ValueError("not a gradflow checkpoint (bad first line)")
        if hashlib.sha256(payload).hexdigest().encode() != head[len(FORMAT_LINE):]:
            raise ValueError("checksum mismatch (torn or corrupt file)")
        try:
            tensors = load_tensors(payload)
            state = json.loads(_metadata(payload)["state"])
        except Exception as err:  # any parse failure means a corrupt file
            raise ValueError(f"unreadable payload ({err})") from err
        return cls(state, tensors, path)


def _metadata(payload: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors payload (8-byte little-endian header length, JSON header)."""
    size = int.from_bytes(payload[:8], "little")
    return json.loads(payload[8:8 + size])["__metadata__"]


def rank_dir(out: Path, rank: int) -> Path:
    """Folder of process ``rank``'s checkpoints in run directory ``out``."""
    return out / CHECKPOINT_DIR / f"rank{rank}"


def _numbered(folder: Path) -> list[tuple[int, Path]]:
    """(number, path) of the checkpoint files in ``folder``, newest first."""
    found = []
    for path in folder.glob("checkpoint-*.gfc") if folder.is_dir() else []:
        try:
            found.append((int(path.stem.split("-", 1)[1]), path))
        except ValueError:
            continue
    return sorted(found, reverse=True)


def save_checkpoint(folder: Path, checkpoint: Checkpoint) -> Path:
    """Write ``checkpoint`` durably as the next numbered file of ``folder``; keep the newest :data:`KEEP`."""
    folder.mkdir(parents=True, exist_ok=True)
    existing = _numbered(folder)
    number = existing[0][0] + 1 if existing else 1
    path = folder / f"checkpoint-{number:06d}.gfc"
    durable_write(path, checkpoint.to_bytes(), point="kill_in_checkpoint")
    for _, old in existing[KEEP - 1:]:
        old.unlink(missing_ok=True)
    checkpoint.path = path
    return path


def latest_checkpoint(folder: Path) -> Checkpoint | None:
    """The newest checkpoint of ``folder`` that verifies (a corrupt one is refused with a warning and the
    previous one used); None when there is none."""
    for _, path in _numbered(folder):
        try:
            return Checkpoint.from_bytes(path.read_bytes(), path)
        except (OSError, ValueError) as err:
            warnings.warn(f"checkpoint {path} refused: {err}; using the previous one", stacklevel=2)
    return None


def has_checkpoint(out: Path) -> bool:
    """True when run directory ``out`` holds a checkpoint file of any process."""
    folder = out / CHECKPOINT_DIR
    return folder.is_dir() and any(folder.glob("rank*/checkpoint-*.gfc"))


def differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``key: saved -> current`` for every fingerprint entry that differs (sorted by key)."""
    return [f"{key}: {saved.get(key)!r} -> {current.get(key)!r}" for key in sorted(set(saved) | set(current))
            if saved.get(key) != current.get(key)]


def check_fingerprint(saved: Mapping[str, Any], current: Mapping[str, Any], out: Path) -> None:
    """Raise :class:`UsageError` naming what differs when a resumed job's settings are not the checkpoint's."""
    diff = differences(saved, current)
    if not diff:
        return
    if "world_size" in saved and saved.get("world_size") != current.get("world_size"):
        raise UsageError(f"cannot resume {out}: it was checkpointed by {saved.get('world_size')} process(es) and "
                         f"this job has {current.get('world_size')}; resume with the same number of processes.")
    raise UsageError(f"cannot resume {out}: this command's settings differ from the checkpoint's "
                     f"({'; '.join(diff)}); repeat the original options, or pass --overwrite to start over.")


__all__ = ["CHECKPOINT_DIR", "FAULT_ENV", "KEEP", "Checkpoint", "check_fingerprint", "differences",
           "durable_write", "fault", "fsync_dir", "has_checkpoint", "latest_checkpoint", "rank_dir",
           "save_checkpoint"]
