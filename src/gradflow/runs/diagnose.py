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
with the corpus.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from torch import nn

from gradflow.adapters import Adapter, block_modules
from gradflow.errors import CorpusError, DiagnosticsError
from gradflow.hooks.states import SiteStates, collect_states
from gradflow.inputs.masking import BertMasking, MaskedBatch
from gradflow.models import LoadedModel
from gradflow.roles import Role
from gradflow.runs.files import write_csv, write_meta
from gradflow.runs.job import RoleTally, open_job
from gradflow.runs.logit_lens import LogitLens, LogitLensAccumulator
from gradflow.runs.meta import JobInputs, job_meta
from gradflow.runs.representations import AnisotropyAccumulator, InputShiftAccumulator, TransformationAccumulator
from gradflow.schema import DIAGNOSTIC_COLUMNS as TABLE_COLUMNS
from gradflow.schema import META_FILE

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


def diagnose_corpus(loaded: LoadedModel, texts: str | Path | Sequence[str] | None, out_dir: str | Path,
                    max_length: int = 128, batch_size: int = 8, limit: int | None = None, seed: int = 0, *,
                    max_per_group: int = 2000, command: str = "") -> dict[str, pd.DataFrame]:
    """Stream a corpus through ``loaded`` and write the four diagnostics tables and meta.json.

    ``texts``: a corpus path (see :func:`gradflow.inputs.corpus.read_documents`), a list of strings, or
    None for the committed SOTU sample. Masking is BERT's (15%, 80/10/10) seeded by ``seed``;
    ``limit`` stops after that many windows. Writes ``<table>.csv`` for each of
    :data:`TABLE_COLUMNS` and ``meta.json`` into ``out_dir``; an interrupt or error mid-corpus writes the
    partial tables with ``complete`` false, then goes on (the rule of :mod:`gradflow.runs.job`).
    """
    job = open_job(loaded, texts, BertMasking(seed=seed), max_length, batch_size, limit=limit)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DiagnosticsError(f"output path {out} exists and is a file; pass a directory.")
    diag = Diagnostics(loaded.model, loaded.adapter, max_per_group, seed)
    tally = RoleTally()
    with job.running():
        for batch in job.batches():
            diag.add(collect_states(loaded.model, batch, loaded.adapter, keep_logits=tally.sequences == 0), batch)
            tally.add(batch.roles)
    refusal = job.refusal(tally.sequences)
    if refusal is not None:
        raise refusal
    if job.complete and tally.sequences == 0:
        raise CorpusError(f"the corpus {job.source} has no text to diagnose (no non-blank document with a maskable "
                          "token).")
    tables = diag.tables()
    inputs = JobInputs(model=loaded.name, texts=job.source, masking=job.policy.describe(), seed=seed,
                       num_layers=diag.num_blocks)
    fields = {"max_length": max_length, "batch_size": batch_size, "limit": limit, "max_per_group": max_per_group,
              "logit_lens": {"final_norm": diag.lens.final_path, "max_abs_logit_diff": diag.lens.max_abs_diff},
              "counts": {"documents": job.counts.documents, "windows": job.counts.windows,
                         "sequences": tally.sequences, "tokens_per_role": tally.tokens}}
    _write(out, tables, job_meta(loaded, inputs, job.outcome(command, out), fields,
                                 extra_versions={"scikit-learn": _sklearn_version()}))
    job.reraise()
    return tables


def _write(out: Path, tables: dict[str, pd.DataFrame], meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, frame in tables.items():
        write_csv(frame, out / f"{name}.csv", TABLE_COLUMNS[name])
    write_meta(out / META_FILE, meta)


def _sklearn_version() -> str:
    import sklearn

    return sklearn.__version__
