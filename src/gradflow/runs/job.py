"""The one corpus-job skeleton: length check, corpus, masked batches, role counts, and how a job stops.

Every corpus job (``gradflow record``, ``diagnose``, the batch of ``gradflow check``, the MLM
evaluation, ``repair``'s windows) goes through it::

    job = open_job(loaded, texts, policy, max_length, batch_size, start=start)  # refuses an over-long window
    tally = RoleTally()
    with job.running():                # an interrupt or error is kept on ``job``, not raised here
        for batch in job.batches():    # masked batches (B, T); ``job.counts`` fills in as the corpus is read
            ...                        # the job's own work on the batch
            tally.add(batch.roles)
    refusal = job.refusal(tally.sequences)
    if refusal is not None:
        raise refusal                  # bad input before anything was counted: nothing is written
    ...                                # write the (partial) results, meta.json from job.outcome(command, out)
    job.reraise()                      # then the interrupt or error goes on to the caller

The interrupt rule, the same for every job: Ctrl-C (SIGINT) ends the loop at the next batch boundary
(a second one at once, :mod:`gradflow.runs.interrupts`), and that or a ``KeyboardInterrupt`` raised in
the loop leaves ``complete`` false and ``error`` "interrupted (SIGINT)"; any other exception stops it
with ``error`` "<Type>: <message>". Either way the job writes what it has, then :meth:`CorpusJob.reraise` raises the
interrupt (as ``KeyboardInterrupt``) or the exception. The one exception: a :class:`GradflowError`
raised before any sequence was counted is a bad input, not a partial run, and is raised with nothing
written (:meth:`CorpusJob.refusal`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path

import torch

from gradflow.errors import CorpusError, GradflowError, UsageError
from gradflow.inputs.corpus import CorpusCounts, Document, Window, batches, iter_windows, open_corpus, shard
from gradflow.inputs.masking import MaskedBatch, MaskingPolicy
from gradflow.inputs.pipeline import mask_windows, masked_batches
from gradflow.inputs.prompted import PromptFields
from gradflow.models import LoadedModel
from gradflow.roles import LOSS_ROLES, TOKEN_ROLES, role_counts
from gradflow.runs.interrupts import StopRequest, stop_on_sigint
from gradflow.runs.meta import JobOutcome
from gradflow.runs.sharding import lockstep

INTERRUPTED = "interrupted (SIGINT)"
"""The ``error`` of meta.json when a job was interrupted."""


def check_head_shift(policy: MaskingPolicy, loaded: LoadedModel) -> None:
    """Refuse, in one sentence, a shifted objective on a model whose head is not shifted, and the reverse.

    The adapter says which head a model has (:attr:`gradflow.adapters.Adapter.shifted_head`); the generic
    adapter (``--adapter auto``) cannot tell, so either objective is taken there.
    """
    adapter = loaded.adapter
    if adapter.shifted_head is None or policy.shift == adapter.shifted_head:
        return
    if adapter.shifted_head:
        raise UsageError(f"{loaded.name} ({adapter.family}) was trained with a shifted head (the logits at position "
                         "p predict the token at p + 1): pass --shift (shift=True) so the loss sits where it does in "
                         "training.")
    raise UsageError(f"{loaded.name} ({adapter.family}) predicts each token at its own position, but the objective "
                     "is shifted (--shift): drop --shift, or record with --adapter auto if this checkpoint's head is "
                     "shifted after all.")


def check_max_length(max_length: int, loaded: LoadedModel, model: str | None = None) -> None:
    """Raise :class:`UsageError` when windows of ``max_length`` tokens are longer than ``loaded`` accepts.

    ``model``: the name the message gives (default ``loaded.name``).
    """
    limit = loaded.max_positions()
    if max_length > limit:
        raise UsageError(f"--max-length {max_length} is longer than the {limit} positions {model or loaded.name} "
                         f"accepts; pass --max-length {limit} or less.")


@dataclass
class RoleTally:
    """Sequences, batches and positions per token role (in :data:`TOKEN_ROLES` order) counted so far."""

    sequences: int = 0
    batches: int = 0
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOKEN_ROLES, 0))

    def add(self, roles: torch.Tensor) -> None:
        """Count one batch of (B, T) role codes: B sequences, B x T positions."""
        counts = role_counts(roles)  # (a checkpoint written before the ``prompt`` role has no count for it)
        self.tokens = {role: self.tokens.get(role, 0) + counts[role] for role in TOKEN_ROLES}
        self.sequences += int(roles.shape[0])
        self.batches += 1

    def merge(self, other: RoleTally) -> None:
        """Add another tally (another process's) to this one."""
        self.sequences += other.sequences
        self.batches += other.batches
        self.tokens = {role: self.tokens.get(role, 0) + other.tokens.get(role, 0) for role in TOKEN_ROLES}

    @property
    def loss_tokens(self) -> int:
        """Positions that carried the loss (masked + random + kept)."""
        return sum(self.tokens[r] for r in LOSS_ROLES)

    @property
    def real_tokens(self) -> int:
        """Positions counted, padding left out."""
        return sum(v for r, v in self.tokens.items() if r != "pad")


@dataclass
class CorpusJob:
    """One pass over a corpus: what it reads, how it windows and masks, and how it ended.

    ``documents`` is read once (lazily); ``source`` names the corpus for meta.json. ``limit`` stops
    after that many windows of the whole corpus; ``rank``/``world`` shard the windows between
    processes. ``start`` is the job's start (``time.time()``, seconds) for meta.json's ``wall_s``.
    ``resume_from``: the first window (corpus-wide sequence index) not yet done (a resumed job).
    ``idle``: the ranks run in step (a model sharded by FSDP2, :func:`gradflow.runs.sharding.lockstep`): batches
    are dealt whole (the one-process run's batch k to rank ``k % world``), and a rank out of batches runs ``idle``
    on a spare one (result dropped) while the others record; ``device``: where the ranks' flags are reduced.
    """

    tokenizer: object
    documents: Iterable[Document]
    source: str
    policy: MaskingPolicy
    max_length: int
    batch_size: int
    limit: int | None = None
    rank: int = 0
    world: int = 1
    start: float = field(default_factory=time.time)
    counts: CorpusCounts = field(default_factory=CorpusCounts)
    complete: bool = False
    error: str | None = None
    failure: Exception | None = None
    resume_from: int = 0
    stop: StopRequest = field(default_factory=StopRequest)
    canvas: int | None = None
    """A two-pass model's canvas length: batches of prompt and canvas (:mod:`gradflow.inputs.canvas`)."""
    idle: Callable[[MaskedBatch], None] | None = None
    device: str = "cpu"
    _spare: Window | None = field(default=None, repr=False)

    def batches(self) -> Iterator[MaskedBatch]:
        """This process's masked batches of at most ``batch_size`` windows of ``max_length`` tokens (B, T).

        With ``resume_from`` > 0 the corpus is read from its start and the windows numbered below it
        (done before a checkpoint) are read and discarded: the batches that follow are the ones an
        uninterrupted pass makes. An error reading the corpus (a file vanished or unreadable mid-run)
        is raised as :class:`CorpusError` naming the corpus.
        """
        if self.idle is not None:
            stream = lockstep(self._whole_batches(), self.idle, self._filler, self.stop, self.device)
            return self._reading(stream, own_stop=False)  # (a stop ends every rank at one step, in lockstep)
        if self.resume_from:
            windows = (w for w in self.windows() if w.sequence_index >= self.resume_from)
            groups = batches(shard(windows, self.rank, self.world), self.batch_size)
            stream = (mask_windows(self.tokenizer, g, self.policy, self.max_length, self.canvas) for g in groups)
        else:
            stream = masked_batches(self.tokenizer, self.documents, self.policy, self.max_length, self.batch_size,
                                    limit=self.limit, rank=self.rank, world_size=self.world, counts=self.counts,
                                    canvas=self.canvas)
        return self._reading(stream)

    def _whole_batches(self) -> Iterator[MaskedBatch]:
        """This rank's batches when batches are dealt whole (from ``resume_from`` on); the corpus' first window is
        kept as the spare a rank out of batches keeps in step with."""
        def dealt() -> Iterator[Window]:
            for window in self.windows():
                self._spare = self._spare or window
                index = window.sequence_index
                if index >= self.resume_from and (index // self.batch_size) % self.world == self.rank:
                    yield window

        for _, group in groupby(dealt(), key=lambda w: w.sequence_index // self.batch_size):
            yield mask_windows(self.tokenizer, list(group), self.policy, self.max_length, self.canvas)

    def _filler(self) -> MaskedBatch | None:
        """The spare batch (the corpus' first window) of a rank that never had one; None: no window was read."""
        return None if self._spare is None else mask_windows(self.tokenizer, [self._spare], self.policy,
                                                             self.max_length, self.canvas)

    def _reading(self, stream: Iterator[MaskedBatch], own_stop: bool = True) -> Iterator[MaskedBatch]:
        while not (own_stop and self.stop.requested):  # Ctrl-C inside running(): end at this batch boundary
            try:
                batch = next(stream)
            except StopIteration:
                return
            except OSError as err:
                raise CorpusError(f"could not read the corpus {self.source} mid-run ({err}); the progress "
                                  "checkpointed so far is kept: restore the file and rerun with --resume.") from err
            yield batch

    def windows(self) -> Iterator[Window]:
        """The corpus' windows of at most ``max_length`` tokens, unmasked and unsharded (up to ``limit``)."""
        return iter_windows(self.tokenizer, self.documents, self.max_length, self.counts, self.limit)

    @contextmanager
    def running(self) -> Iterator[None]:
        """Run the batch loop inside: ``complete`` when it ends normally; an interrupt or an error is kept
        on the job (``error``, ``failure``) instead of raised, so the caller can write what it has. A first
        SIGINT ends the batch loop at the next batch (:mod:`gradflow.runs.interrupts`); a second, at once."""
        try:
            with stop_on_sigint() as self.stop:
                yield
            if self.stop.requested:
                self.error = INTERRUPTED
            else:
                self.complete = True
        except KeyboardInterrupt:
            self.error = INTERRUPTED
        except Exception as err:  # noqa: BLE001 - kept, then raised by reraise() after the flush
            self.failure, self.error = err, f"{type(err).__name__}: {err}"

    def refusal(self, counted: int) -> GradflowError | None:
        """The error to raise at once, writing nothing: a GradflowError before any of ``counted`` sequences."""
        if isinstance(self.failure, GradflowError) and counted == 0:
            return self.failure
        return None

    def reraise(self) -> None:
        """After the partial results are written: raise the error, or ``KeyboardInterrupt`` for an interrupt."""
        if self.failure is not None:
            raise self.failure
        if self.error is not None:
            raise KeyboardInterrupt(self.error)

    def outcome(self, command: str | Sequence[str], out: str | Path) -> JobOutcome:
        """How the job ended, for :func:`gradflow.runs.meta.job_meta` (paths written relative to ``out``)."""
        return JobOutcome(self.complete, self.error, self.start, command, str(out))


def open_job(loaded: LoadedModel, texts: str | Path | Sequence[str] | None, policy: MaskingPolicy,
             max_length: int, batch_size: int, *, limit: int | None = None, rank: int = 0, world: int = 1,
             start: float | None = None, model: str | None = None, prompted: PromptFields | None = None,
             one_pass: str | None = None, canvas: int | None = None) -> CorpusJob:
    """Check ``max_length`` against the model (:func:`check_max_length`, naming ``model``) and open ``texts``.

    ``texts``: a corpus path, a list of strings or None (the committed sample); see
    :func:`gradflow.inputs.corpus.open_corpus` (``prompted``: a prompt/response ``.jsonl`` corpus, whose
    prompts are never masked). Nothing is read until the batches are iterated. ``one_pass``: the command, for a
    job that does not run two-pass models yet (refused in one sentence). ``canvas``: a two-pass model's canvas
    length C in place of its config's (``--canvas-length``; :func:`canvas_length`).
    """
    if one_pass is not None and loaded.adapter.two_pass is not None:
        raise UsageError(f"{one_pass} does not run two-pass models yet ({loaded.name}, {loaded.adapter.family}: a "
                         "prompt pass and a canvas pass through tied blocks); gradflow record does, and its "
                         "sublayers.csv and channels.csv hold the exact zeros.")
    check_max_length(max_length, loaded, model)
    check_head_shift(policy, loaded)
    documents, source = open_corpus(texts, prompted)
    return CorpusJob(loaded.tokenizer, documents, source, policy, max_length, batch_size, limit, rank, world,
                     time.time() if start is None else start,
                     canvas=canvas_length(loaded, canvas, max_length, prompted is not None))


def canvas_length(loaded: LoadedModel, asked: int | None = None, max_length: int | None = None,
                  prompted: bool = False) -> int | None:
    """The canvas length C of a two-pass model: ``asked`` (``--canvas-length``) or its config's; None for a one-pass
    model. Refused in one sentence (:class:`UsageError`): ``asked`` of a one-pass model, and on a plain corpus
    (not ``prompted``) an ``asked`` >= ``max_length``, which no window can hold (each keeps a prompt token)."""
    spec = loaded.adapter.two_pass
    if spec is None:
        if asked is not None:
            raise UsageError(f"--canvas-length applies to two-pass models (DiffusionGemma) only, and {loaded.name} "
                             f"({loaded.adapter.family}) runs one pass: drop --canvas-length.")
        return None
    if asked is not None:
        if not prompted and max_length is not None and asked >= max_length:
            fit = f"pass --canvas-length {max_length - 1} or less, or " if max_length > 1 else ""
            raise UsageError(f"--canvas-length {asked} leaves windows of --max-length {max_length} tokens no prompt "
                             f"(the split rule keeps each window's first token in the prompt, so a canvas holds at "
                             f"most {max_length - 1}): {fit}raise --max-length above {asked}.")
        return asked
    length = spec.default_canvas(loaded.model.config)
    if length is None:
        raise UsageError(f"{loaded.name} runs a prompt and a canvas through two passes, but its config gives no "
                         f"{spec.canvas_length}: set it in config.json or pass --canvas-length.")
    return length


def canvas_meta(canvas: int | None, given: bool) -> dict:
    """meta.json's ``two_pass`` of a job on a two-pass model: ``{canvas_length, canvas_length_from}`` (``given``: C
    came from ``--canvas-length``, not the model's config); of a one-pass model's, nothing."""
    if canvas is None:
        return {}
    return {"two_pass": {"canvas_length": canvas, "canvas_length_from": "--canvas-length" if given else "config"}}


__all__ = ["INTERRUPTED", "CorpusJob", "RoleTally", "canvas_length", "canvas_meta", "check_head_shift",
           "check_max_length", "open_job"]
