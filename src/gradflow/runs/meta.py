"""meta.json of every corpus job: one provenance block (model, corpus, masking, versions, outcome) + job fields.

Keys of the common block (see :data:`gradflow.schema.PROVENANCE_KEYS`): ``model``,
``model_path``, ``family``, ``model_type``, ``config_hash``, ``num_layers``, ``texts``,
``masking``, ``seed``, ``versions`` (python, torch, transformers, gradflow and any extras),
``command``, ``wall_s`` (seconds since the job started), ``complete`` and ``error``. Paths (model
directory, corpus, paths in the command) are portable, never a machine's absolute path: see
:func:`gradflow.provenance.portable_path`.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradflow.models import LoadedModel
from gradflow.provenance import content_hash, is_local_input, portable_command, portable_path, source_revision
from gradflow.version import __version__


@dataclass(frozen=True)
class JobInputs:
    """What a job read: the model name as given, the corpus source, the masking description and its seed."""

    model: str
    texts: str
    masking: dict[str, Any]
    seed: int
    num_layers: int


@dataclass(frozen=True)
class JobOutcome:
    """How a job ended: ``complete`` false with an ``error`` text when stopped early; ``start`` from time.time().

    ``command``: the command line, a string or an argument list (empty: this process's argv).
    """

    complete: bool
    error: str | None
    start: float
    command: str | Sequence[str] = ""
    out_dir: str = "."  # where the meta.json goes: paths in it are written relative to this


_HASHES: dict[str, str] = {}


def input_hash(path: str) -> str:
    """:func:`gradflow.provenance.content_hash` of an input, computed once per process (a job's periodic
    meta.json and its fingerprint do not hash a large model again, nor fail on a corpus removed mid-run)."""
    key = os.path.abspath(path)
    if key not in _HASHES:
        _HASHES[key] = content_hash(path)
    return _HASHES[key]


def versions(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Versions of python, torch, transformers and gradflow, gradflow's source revision (the git commit of a
    checkout, ``"unknown"`` for a wheel: see :func:`gradflow.provenance.source_revision`), plus ``extra``
    (e.g. ``{"scikit-learn": ...}``)."""
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "gradflow": __version__,
            "gradflow_revision": source_revision(), **(extra or {})}


def provenance(loaded: LoadedModel, inputs: JobInputs, outcome: JobOutcome,
               extra_versions: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The common meta.json block; ``command`` defaults to this process's argv, ``wall_s`` is measured now."""
    return {
        "complete": outcome.complete, "error": outcome.error, "model": portable_path(inputs.model, outcome.out_dir),
        "model_path": portable_path(loaded.path, outcome.out_dir),
        "family": loaded.adapter.family, "model_type": loaded.model.config.model_type,
        "config_hash": loaded.config_hash, "num_layers": inputs.num_layers,
        "texts": portable_path(inputs.texts, outcome.out_dir),
        "inputs_sha256": {name: input_hash(path) for name, path in (("model", loaded.path), ("texts", inputs.texts))
                          if isinstance(path, str) and is_local_input(path)},
        "masking": inputs.masking, "seed": inputs.seed, "versions": versions(extra_versions),
        "command": portable_command(outcome.command or sys.argv, outcome.out_dir),
        "wall_s": round(time.time() - outcome.start, 2),
    }


def job_meta(loaded: LoadedModel, inputs: JobInputs, outcome: JobOutcome, fields: Mapping[str, Any],
             extra_versions: Mapping[str, str] | None = None) -> dict[str, Any]:
    """meta.json of one job: the provenance block plus the job's own ``fields`` (which may not override it)."""
    common = provenance(loaded, inputs, outcome, extra_versions)
    clash = sorted(set(common) & set(fields))
    if clash:
        raise ValueError(f"job fields {', '.join(clash)} would override the provenance block")
    return {**common, **fields}


__all__ = ["JobInputs", "JobOutcome", "input_hash", "job_meta", "provenance", "versions"]
