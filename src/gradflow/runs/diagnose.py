"""Representation diagnostics of every layer, per position role, streamed over a corpus.

Forward passes only (``torch.no_grad``). Hidden states are taken with forward hooks at the
recorder's sites (``embeddings.out``, ``blocks.{i}.mid``, ``blocks.{i}.out``) rather than from
``output_hidden_states``: for pre-LN models the last entry of ``hidden_states`` already includes
the final LayerNorm, and for factorised embeddings (ALBERT, ELECTRA) the first entry is after the
projection, so the hooks are what keeps these tables aligned with the gradient recordings.

Tables (one row per layer and role; ``layer`` 0 = embeddings, i + 1 = block i; ``loss`` = pooled
masked + random + kept):

- ``logit_lens``: the model's own MLM head (after the final norm of pre-LN models) applied to
  every layer's output; ``top1_original`` is the fraction of positions whose top-1 prediction is
  the original token, ``mean_log_prob_original`` its mean log-probability (nats).
- ``input_shift``: how separable the FFN inputs (``blocks.{i}.mid``) of loss and context
  positions are: cross-validated AUROC of a logistic-regression probe on a seeded uniform sample
  of at most ``max_per_group`` vectors per group (Hanley-McNeil standard error and 95% interval),
  and the Frechet distance between the two groups' Gaussians (means and covariances over *all*
  positions, streamed).
- ``anisotropy``: mean pairwise cosine of the hidden states of a role, from the running sum of
  unit vectors: ``(||sum u||^2 - n) / (n (n - 1))``.
- ``transformation``: per block, relative change ``||h_i - h_{i-1}|| / ||h_{i-1}||`` of each
  position's hidden state (mean and std); the last block (``last_block`` true) is the one whose
  context channels get no gradient.

State per layer is bounded (sums, a fixed-size sample, H x H moments), so memory does not grow
with the corpus. Resumable like ``gradflow record``: every ``checkpoint_every`` sequences or
``checkpoint_minutes`` minutes the accumulators' exact state (:meth:`Diagnostics.state_dict`) is written
durably (:mod:`gradflow.runs.checkpoint`) with a meta.json saying ``complete`` false and its ``progress``;
``resume=True`` continues from it, and the finished tables are byte-identical to an uninterrupted run's.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd
from torch import nn

from gradflow.adapters import Adapter, block_modules
from gradflow.errors import CorpusError, DiagnosticsError, UsageError
from gradflow.hooks.states import SiteStates, collect_states
from gradflow.inputs.corpus import default_texts
from gradflow.inputs.masking import BertMasking, MaskedBatch
from gradflow.models import LoadedModel
from gradflow.roles import Role
from gradflow.runs.checkpoint import CHECKPOINT_DIR, Checkpoint, fault, has_checkpoint, rank_dir, save_checkpoint
from gradflow.runs.files import write_csv, write_meta
from gradflow.runs.job import CorpusJob, RoleTally, open_job
from gradflow.runs.logit_lens import LogitLens, LogitLensAccumulator
from gradflow.runs.meta import JobInputs, job_meta
from gradflow.runs.representations import AnisotropyAccumulator, InputShiftAccumulator, TransformationAccumulator
from gradflow.runs.resume import (
    DEFAULT_EVERY,
    DEFAULT_MINUTES,
    Cadence,
    check_resumable,
    disk_errors,
    open_resume,
    restore_fields,
    settings_fingerprint,
    split_state,
    stats_state,
)
from gradflow.schema import DIAGNOSTIC_COLUMNS as TABLE_COLUMNS
from gradflow.schema import META_FILE

ACCUMULATORS = ("logit_lens", "input_shift", "anisotropy", "transformation")

# ----------------------------------------------------------------------------------------------
# All four over a stream of batches
# ----------------------------------------------------------------------------------------------

class Diagnostics:
    """The four accumulators of one model; ``add(states, batch)`` per batch, ``tables()`` at the end."""

    def __init__(self, model: nn.Module, adapter: Adapter, max_per_group: int = 2000, seed: int = 0):
        self.num_blocks = len(block_modules(adapter, model.base_model))
        self.lens = LogitLens(model, adapter)
        self.logit_lens = LogitLensAccumulator(self.lens)
        self.input_shift = InputShiftAccumulator(self.num_blocks, max_per_group, seed)
        self.anisotropy = AnisotropyAccumulator()
        self.transformation = TransformationAccumulator(self.num_blocks)

    def add(self, states: SiteStates, batch: MaskedBatch) -> None:
        """Fold one batch's states into every accumulator (resolves the lens on the first call)."""
        if self.lens.max_abs_diff is None:
            if states.logits is None:
                raise DiagnosticsError("the first batch must come with the model's logits to check the logit lens")
            self.lens.resolve(states.hidden[-1], states.logits, batch.roles.cpu() != Role.PAD)
        batch = batch.to("cpu")
        self.logit_lens.add(states, batch)
        self.input_shift.add(states, batch)
        self.anisotropy.add(states, batch)
        self.transformation.add(states, batch)

    def tables(self) -> dict[str, pd.DataFrame]:
        """Tidy tables keyed ``logit_lens``, ``input_shift``, ``anisotropy``, ``transformation``."""
        return {"logit_lens": self.logit_lens.frame(), "input_shift": self.input_shift.frame(),
                "anisotropy": self.anisotropy.frame(), "transformation": self.transformation.frame()}

    def state_dict(self) -> dict[str, Any]:
        """Every accumulator's exact state, flat (``<accumulator>.<key>``): tensors and JSON-able values."""
        return {f"{name}.{key}": value for name in ACCUMULATORS
                for key, value in getattr(self, name).state_dict().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (of the same model and settings)."""
        for name in ACCUMULATORS:
            prefix = f"{name}."
            getattr(self, name).load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})


@dataclass
class _Run:
    """One diagnose job: its settings, corpus pass, accumulators, counts and checkpoint state."""

    loaded: LoadedModel
    job: CorpusJob
    out: Path
    diag: Diagnostics
    settings: dict[str, Any]
    command: str
    tally: RoleTally = field(default_factory=RoleTally)
    next_index: int = 0  # the first window (corpus-wide index) not yet diagnosed
    fingerprint: dict = field(default_factory=dict)
    checkpointed: dict | None = None  # meta.json's "progress": what the last checkpoint holds


def diagnose_corpus(loaded: LoadedModel, texts: str | Path | Sequence[str] | None, out_dir: str | Path,
                    max_length: int = 128, batch_size: int = 8, limit: int | None = None, seed: int = 0, *,
                    max_per_group: int = 2000, command: str = "", resume: bool = False, overwrite: bool = False,
                    checkpoint_every: int = DEFAULT_EVERY,
                    checkpoint_minutes: float = DEFAULT_MINUTES) -> dict[str, pd.DataFrame]:
    """Stream a corpus through ``loaded`` and write the four diagnostics tables and meta.json.

    ``texts``: a corpus path (see :func:`gradflow.inputs.corpus.read_documents`), a list of strings, or
    None for the committed SOTU sample. Masking is BERT's (15%, 80/10/10) seeded by ``seed``;
    ``limit`` stops after that many windows. Writes ``<table>.csv`` for each of
    :data:`TABLE_COLUMNS` and ``meta.json`` into ``out_dir``; an interrupt or error mid-corpus writes the
    partial tables with ``complete`` false, then goes on (the rule of :mod:`gradflow.runs.job`).
    Checkpoints every ``checkpoint_every`` sequences or ``checkpoint_minutes`` minutes; ``resume``
    continues the unfinished job in ``out_dir`` (same settings, or :class:`UsageError` naming what differs);
    ``overwrite`` lets a new job start over in a directory holding an unfinished job's checkpoint.
    """
    start = time.time()
    job = open_job(loaded, texts, BertMasking(seed=seed), max_length, batch_size, limit=limit, start=start,
                   one_pass="gradflow diagnose")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DiagnosticsError(f"output path {out} exists and is a file; pass a directory.")
    saved = open_resume(out, 0, 1, job="diagnose") if resume else None
    if saved is None and has_checkpoint(out):
        if not overwrite:
            raise UsageError(f"{out} holds an unfinished run (its checkpoints); pass --resume to continue it, or "
                             "--overwrite to start over.")
        shutil.rmtree(out / CHECKPOINT_DIR)
    settings = {"seed": seed, "max_length": max_length, "batch_size": batch_size, "limit": limit,
                "max_per_group": max_per_group, "dtype": str(next(loaded.model.parameters()).dtype)}
    run = _Run(loaded, job, out, Diagnostics(loaded.model, loaded.adapter, max_per_group, seed), settings, command)
    run.fingerprint = settings_fingerprint(loaded, loaded.name, default_texts() if texts is None else texts,
                                           job.policy, **settings)
    if saved is not None:
        _restore(run, saved, start)
    _stream(run, Cadence(checkpoint_every, checkpoint_minutes))
    refusal = job.refusal(run.tally.sequences)
    if refusal is not None:
        raise refusal
    if job.complete and run.tally.sequences == 0:
        raise CorpusError(f"the corpus {job.source} has no text to diagnose (no non-blank document with a maskable "
                          "token).")
    tables = run.diag.tables()
    try:
        _write(out, tables, _meta(run))
    except OSError:
        if job.failure is None:
            raise  # (the disk that failed the run fails the flush too: the checkpoint stands)
    if job.complete:
        shutil.rmtree(out / CHECKPOINT_DIR, ignore_errors=True)
    job.reraise()
    return tables


def _restore(run: _Run, saved: Checkpoint, start: float) -> None:
    """Continue from ``saved``: refuse other settings, then restore accumulators, counts, position and clock."""
    check_resumable(saved, run.fingerprint, run.out, job="diagnose")
    run.diag.load_state_dict({**saved.state["accumulators"], **saved.tensors})
    restore_fields(run.tally, saved.state["tally"])
    run.next_index = run.job.resume_from = int(saved.state["next_index"])
    run.job.start = start - float(saved.state["wall_s"])
    run.checkpointed = saved.state["progress"]


def _stream(run: _Run, cadence: Cadence) -> None:
    """Diagnose the batches (an interrupt or error is kept on ``run.job``), checkpointing on ``cadence``."""
    loaded, job = run.loaded, run.job
    with job.running(), disk_errors(run.out, lambda: run.checkpointed):
        for batch in job.batches():
            states = collect_states(loaded.model, batch, loaded.adapter, keep_logits=run.tally.sequences == 0)
            run.diag.add(states, batch)
            run.tally.add(batch.roles)
            run.next_index = int(batch.sequence_index.max()) + 1
            fault("kill_at_batch")
            if cadence.due(len(batch.sequence_index)):
                _checkpoint(run)


def _checkpoint(run: _Run) -> None:
    """Write the accumulators' state durably, then a meta.json with ``complete`` false and the progress (the
    tables are written when the job ends: the input-shift probes are fitted once)."""
    tensors, accumulators = split_state(run.diag.state_dict())
    progress = {"sequences": run.tally.sequences, "windows": run.next_index,
                "checkpoint_utc": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    state = {"job": "diagnose", "fingerprint": run.fingerprint, "next_index": run.next_index,
             "tally": stats_state(run.tally), "wall_s": time.time() - run.job.start, "accumulators": accumulators,
             "progress": progress}
    save_checkpoint(rank_dir(run.out, 0), Checkpoint(state, tensors))
    run.checkpointed = progress
    fault("kill_after_checkpoint")
    write_meta(run.out / META_FILE, _meta(run))


def _meta(run: _Run) -> dict:
    """meta.json of a diagnose job: the provenance block plus its settings, the lens check and the counts."""
    job, diag, tally = run.job, run.diag, run.tally
    inputs = JobInputs(model=run.loaded.name, texts=job.source, masking=job.policy.describe(),
                       seed=run.settings["seed"], num_layers=diag.num_blocks)
    fields = {**{k: run.settings[k] for k in ("max_length", "batch_size", "limit", "max_per_group")},
              "logit_lens": {"final_norm": diag.lens.final_path, "max_abs_logit_diff": diag.lens.max_abs_diff},
              "counts": {"documents": job.counts.documents, "windows": job.counts.windows,
                         "sequences": tally.sequences, "tokens_per_role": tally.tokens}}
    if not job.complete and run.checkpointed:  # how far a --resume starts from
        fields["progress"] = run.checkpointed
    return job_meta(run.loaded, inputs, job.outcome(run.command, run.out), fields,
                    extra_versions={"scikit-learn": _sklearn_version()})


def _write(out: Path, tables: dict[str, pd.DataFrame], meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, frame in tables.items():
        write_csv(frame, out / f"{name}.csv", TABLE_COLUMNS[name])
    write_meta(out / META_FILE, meta)


def _sklearn_version() -> str:
    import sklearn

    return sklearn.__version__
