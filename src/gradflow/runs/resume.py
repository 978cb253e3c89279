"""What a recording's checkpoint holds and how a resumed job gets it back (see :mod:`gradflow.runs.checkpoint`).

The state is exact: the accumulators' float64/int64 arrays as tensors, the counts as JSON
(floats round-trip exactly), the sublayer keys in their insertion order (sums iterate in it). A job
restored from it and fed the batches that follow gives the same bytes as one that never stopped.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradflow.errors import RunError, UsageError
from gradflow.inputs.masking import MaskingPolicy
from gradflow.models import LoadedModel
from gradflow.provenance import is_local_input
from gradflow.runs.aggregate import SiteAggregator, SublayerAggregator
from gradflow.runs.checkpoint import CHECKPOINT_DIR, Checkpoint, check_fingerprint, latest_checkpoint, rank_dir
from gradflow.runs.meta import input_hash
from gradflow.schema import META_FILE, REPORTED_ROLES

SITE_ARRAYS = ("count", "grad_mean", "grad_m2", "act_mean", "act_m2", "grad_hist", "act_hist")
DEFAULT_EVERY = 1024
"""Default checkpoint interval in sequences (``--checkpoint-every``)."""
DEFAULT_MINUTES = 10.0
"""Default checkpoint interval in minutes (``--checkpoint-minutes``): whichever comes first."""


@dataclass
class Cadence:
    """When to checkpoint: every ``every`` sequences or ``minutes`` minutes, whichever comes first."""

    every: int = DEFAULT_EVERY
    minutes: float = DEFAULT_MINUTES
    sequences: int = 0
    last: float = 0.0

    def __post_init__(self) -> None:
        self.last = time.time()

    def due(self, sequences: int) -> bool:
        """Count ``sequences`` more; True (and the clock restarted) when a checkpoint is due."""
        self.sequences += sequences
        if self.sequences >= self.every or time.time() - self.last >= self.minutes * 60:
            self.sequences, self.last = 0, time.time()
            return True
        return False


def state_tensors(sites: SiteAggregator, subs: SublayerAggregator) -> tuple[dict[str, torch.Tensor], list]:
    """The accumulators as named tensors, and the sublayer keys in insertion order."""
    tensors = {f"sites.{name}": torch.from_numpy(np.ascontiguousarray(getattr(sites, name))) for name in SITE_ARRAYS}
    keys = list(subs.sums)
    sums = np.stack([subs.sums[k] for k in keys]) if keys else np.zeros((0, 6))
    tensors["subs.sums"] = torch.from_numpy(np.ascontiguousarray(sums, dtype=np.float64))
    return tensors, [list(k) for k in keys]


def restore_aggregators(checkpoint: Checkpoint, sites: SiteAggregator, subs: SublayerAggregator) -> None:
    """Load a checkpoint's accumulators into fresh ones (of the same model's sites)."""
    for name in SITE_ARRAYS:
        saved = _with_prompt_column(checkpoint.tensors[f"sites.{name}"].numpy().copy(), getattr(sites, name).shape)
        if saved.shape != getattr(sites, name).shape:
            raise UsageError(f"cannot resume from {checkpoint.path}: it has {saved.shape[0]} sites and this model "
                             f"{getattr(sites, name).shape[0]}; resume with the model it was recorded with.")
        setattr(sites, name, saved)
    sums = checkpoint.tensors["subs.sums"].numpy()
    subs.sums = {tuple(key): sums[i].copy() for i, key in enumerate(checkpoint.state["sublayer_keys"])}


def _with_prompt_column(saved: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A site array of a checkpoint written before the ``prompt`` role (one role column fewer) with a zero
    ``prompt`` column inserted: it had no prompt position. Any other array is returned as it is."""
    if saved.ndim < 2 or saved.shape[0] != shape[0] or saved.shape[1] != len(REPORTED_ROLES) - 1:
        return saved
    return np.insert(saved, REPORTED_ROLES.index("prompt"), 0, axis=1)


def restore_fields(target: Any, saved: dict[str, Any]) -> None:
    """Set a dataclass's fields (counts such as :class:`gradflow.runs.job.RoleTally`) from ``asdict`` output."""
    for item in fields(target):
        if item.name in saved:
            setattr(target, item.name, saved[item.name])


def plain(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples become lists), so saved and current fingerprints compare."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def settings_fingerprint(loaded: LoadedModel, model: str, texts: str | Sequence[str], policy: MaskingPolicy,
                         **settings: Any) -> dict[str, Any]:
    """What a resumed job must share with its checkpoint: the model (a local one by content hash), its config
    and tokenizer, the corpus (a local one by content hash, a list of texts by the hash of its strings), the
    masking, and the job's own ``settings`` (seed, max length, ...), as JSON gives them back."""
    if isinstance(texts, (str, Path)):
        corpus = input_hash(str(texts)) if is_local_input(texts) else str(texts)
    else:
        corpus = "sha256:" + hashlib.sha256(json.dumps(list(texts)).encode()).hexdigest()
    return plain({"model": input_hash(loaded.path) if is_local_input(loaded.path) else model,
                  "config_hash": loaded.config_hash, "tokenizer_hash": loaded.tokenizer_info()["hash"],
                  "texts_sha256": corpus, "masking": policy.describe(), **settings})


def split_state(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A flat ``state_dict()`` as (its tensors, the rest: JSON-able values), for a :class:`Checkpoint`."""
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in state.items() if k not in tensors}


def open_resume(out: Path, rank: int, world: int, job: str = "record") -> Checkpoint | None:
    """The checkpoint process ``rank`` of ``world`` resumes from: None when this process had written none yet
    while others had (it starts its shard over); :class:`UsageError` when the run has none at all, or when it
    was checkpointed by another number of processes. ``job``: the command, for the messages."""
    if not out.is_dir():
        raise UsageError(f"--resume: {out} does not exist; run without --resume to start a new recording there.")
    saved_ranks = sorted((out / CHECKPOINT_DIR).glob("rank*")) if (out / CHECKPOINT_DIR).is_dir() else []
    if not saved_ranks:
        meta = out / META_FILE
        try:
            done = meta.is_file() and json.loads(meta.read_text(encoding="utf-8")).get("complete") is True
        except (ValueError, AttributeError):
            done = False
        if done:
            raise UsageError(f"--resume: the run in {out} is complete; there is nothing to resume.")
        raise UsageError(f"--resume: {out} holds no checkpoint (the run stopped before its first one, or it is not "
                         f"a gradflow {job} run); pass --overwrite instead of --resume to start over.")
    ranks = [int(p.name[4:]) for p in saved_ranks if p.name[4:].isdigit()]
    if ranks and max(ranks) >= world:
        raise UsageError(f"cannot resume {out}: it was checkpointed by {max(ranks) + 1} process(es) and this job "
                         f"has {world}; resume with the same number of processes.")
    if not rank_dir(out, rank).is_dir():
        return None  # (a fewer-process checkpoint is refused by its fingerprint's world_size)
    checkpoint = latest_checkpoint(rank_dir(out, rank))
    if checkpoint is None:
        raise UsageError(f"--resume: no readable checkpoint in {rank_dir(out, rank)} (every one is torn or corrupt); "
                         "pass --overwrite instead of --resume to start over.")
    return checkpoint


def check_resumable(checkpoint: Checkpoint, fingerprint: dict[str, Any], out: Path, job: str = "record") -> None:
    """Refuse (one sentence, naming what differs) a job whose settings are not the checkpoint's, or a checkpoint
    of another command (``job``: ``record`` or ``diagnose``; a checkpoint without ``job`` is record's)."""
    saved = checkpoint.state.get("job", "record")
    if saved != job:
        raise UsageError(f"cannot resume {out} with gradflow {job}: its checkpoint was written by gradflow {saved}; "
                         f"run gradflow {saved} --resume there, or give gradflow {job} another --out.")
    check_fingerprint(checkpoint.state["fingerprint"], plain(fingerprint), out)


@contextmanager
def disk_errors(out: Path, checkpointed: Callable[[], dict | None]) -> Iterator[None]:
    """An OSError writing the run (a full disk) as :class:`RunError` naming ``out`` and what the last checkpoint
    holds (``checkpointed()``: its progress, None before the first)."""
    try:
        yield
    except OSError as err:
        last = checkpointed()
        done = (f"the last checkpoint ({last['sequences']} sequences) is intact" if last
                else "no checkpoint was written yet")
        raise RunError(f"could not write the run directory {out} ({err.strerror or err}); {done}: free space and "
                       "rerun the same command with --resume.") from err


def stats_state(stats: Any) -> dict[str, Any]:
    """A counts dataclass as JSON-able fields."""
    return asdict(stats)


__all__ = ["DEFAULT_EVERY", "DEFAULT_MINUTES", "SITE_ARRAYS", "Cadence", "check_resumable", "disk_errors",
           "open_resume", "plain", "restore_aggregators", "restore_fields", "settings_fingerprint", "split_state",
           "state_tensors", "stats_state"]
