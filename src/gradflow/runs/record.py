"""The corpus-scale recording job behind ``gradflow record``: corpus in, run directory out.

One process or many (``torchrun`` / ``accelerate launch``: the corpus is sharded by sequence index,
accumulators are merged on rank 0, which alone writes the tables). Memory does not depend on the
corpus length: each batch is reduced to small accumulators before the next one is read.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd
import torch

from gradflow.adapters import block_modules
from gradflow.errors import CorpusError, UsageError
from gradflow.hooks.recorder import BatchRecord, GradFlowRecorder, RecorderConfig
from gradflow.inputs.corpus import CorpusCounts, check_corpus_path, default_texts
from gradflow.inputs.masking import BertMasking, MaskedBatch, TokenizerInfo
from gradflow.models import DEFAULT_MODEL, LoadedModel, load_model
from gradflow.progress import progress_bar
from gradflow.provenance import portable_path
from gradflow.runs.aggregate import (
    SiteAggregator,
    SublayerAggregator,
    record_is_finite,
    sequence_rows,
    sublayer_sequence_rows,
)
from gradflow.runs.check import weight_sharing
from gradflow.runs.files import (
    SUBLAYER_SEQUENCE_SCHEMA,
    SequenceWriter,
    merge_sequence_parts,
    prepare_output_dir,
    write_csv,
    write_meta,
)
from gradflow.runs.job import CorpusJob, RoleTally, open_job
from gradflow.runs.meta import JobInputs, job_meta
from gradflow.schema import (
    CHANNEL_COLUMNS,
    CHANNELS_FILE,
    META_FILE,
    SEQUENCES_FILE,
    SUBLAYER_COLUMNS,
    SUBLAYER_SEQUENCES_FILE,
    SUBLAYERS_FILE,
    WEIGHT_SHARING_META_KEY,
)

NONFINITE_REASON = "loss or a recorded norm was NaN/inf; such batches are counted, never averaged in"


@dataclass
class RecordConfig:
    """Everything that defines a recording (all of it goes into meta.json)."""

    out: str
    model: str = DEFAULT_MODEL
    texts: str | None = None
    mask_rate: float = 0.15
    mask_split: tuple[float, float, float] = (0.8, 0.1, 0.1)
    whole_word: bool = False
    seed: int = 0
    max_length: int = 128
    batch_size: int = 8
    limit: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    loss: str = "mlm"
    reduction: str = "sequence"
    sublayers: bool = True
    overwrite: bool = False
    quiet: bool = False
    trust_remote_code: bool = False
    adapter: str = "registered"
    command: str = ""


@dataclass
class RunSummary:
    """What a finished (or interrupted) run produced."""

    out: Path
    complete: bool
    sequences: int
    tokens: int
    wall_s: float
    meta: dict = field(default_factory=dict)


@dataclass
class RecordStats(RoleTally):
    """Counts of a recording: the recorded batches' roles (:class:`RoleTally`), skipped non-finite batches,
    summed loss."""

    nonfinite_batches: int = 0
    nonfinite_sequences: int = 0
    loss_sum: float = 0.0

    def add_record(self, record: BatchRecord) -> None:
        """Count one recorded batch (its roles are (B, T) codes) and its loss."""
        self.add(record.roles)
        self.loss_sum += record.loss

    def skip(self, sequences: int) -> None:
        """Count one batch left out because its loss or a norm was not finite."""
        self.nonfinite_batches += 1
        self.nonfinite_sequences += sequences

    def merge(self, other: RecordStats) -> None:
        """Add another process's counts to these."""
        super().merge(other)
        for name in ("nonfinite_batches", "nonfinite_sequences", "loss_sum"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def mean_loss(self) -> float | None:
        """Mean loss per recorded batch (None before the first batch)."""
        return self.loss_sum / self.batches if self.batches else None


@dataclass
class _Job:
    """State of one recording process: inputs, the corpus pass (and how it ended), accumulators and counts."""

    config: RecordConfig
    loaded: LoadedModel
    corpus: CorpusJob
    out: Path
    num_layers: int
    sites: SiteAggregator
    subs: SublayerAggregator
    stats: RecordStats = field(default_factory=RecordStats)

    def summary(self, meta: dict | None = None) -> RunSummary:
        """The run summary as this process sees it."""
        return RunSummary(self.out, self.corpus.complete, self.stats.sequences, self.stats.real_tokens,
                          time.time() - self.corpus.start, meta or {})


def _dist() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and os.environ.get("GRADFLOW_BACKEND") != "gloo" else "gloo"
        torch.distributed.init_process_group(backend=backend)
    if world > 1:
        return torch.distributed.get_rank(), world
    return 0, 1


def record_corpus(config: RecordConfig, loaded: LoadedModel | None = None) -> RunSummary:
    """Record gradient flow over a corpus and write the run directory (see :mod:`gradflow.schema`)."""
    start = time.time()
    rank, world = _dist()
    out = Path(config.out)
    texts = config.texts or default_texts()
    check_corpus_path(texts)  # before anything is created, so a bad path leaves nothing behind
    if rank == 0:
        prepare_output_dir(out, config.overwrite)
    if world > 1:
        torch.distributed.barrier()
    loaded = loaded or load_model(config.model, config.device, config.dtype, config.trust_remote_code, config.adapter)
    policy = BertMasking(rate=config.mask_rate, split=tuple(config.mask_split), whole_word=config.whole_word,
                         seed=config.seed)
    try:
        corpus = open_job(loaded, texts, policy, config.max_length, config.batch_size, limit=config.limit,
                          rank=rank, world=world, start=start, model=config.model)
    except UsageError:  # a window longer than the model accepts: refused before anything is recorded
        _discard(out)
        raise
    TokenizerInfo.from_tokenizer(loaded.tokenizer)
    recorder = GradFlowRecorder(loaded.model, RecorderConfig(sublayers=config.sublayers,
                                                             position_magnitudes=config.sublayers), loaded.adapter)
    job = _Job(config, loaded, corpus, out, recorder.num_blocks,
               SiteAggregator(recorder.site_names, recorder.site_layers, recorder.site_points), SublayerAggregator())
    _stream(job, recorder)
    refusal = corpus.refusal(job.stats.sequences)
    if refusal is not None:
        _discard(out)
        raise refusal
    if corpus.complete and rank == 0 and world == 1:
        _check_nonempty(job)
    summary = _finish(job)
    corpus.reraise()
    return summary


def _stream(job: _Job, recorder: GradFlowRecorder) -> None:
    """Record this process's batches into ``job`` (an interrupt or error is kept on ``job.corpus``)."""
    writers = _writers(job)
    progress = _progress(job.config.quiet or job.corpus.rank != 0)
    try:
        with job.corpus.running(), recorder:
            for batch in job.corpus.batches():
                if _record_batch(job, recorder, batch, writers):
                    progress.update(len(batch.sequence_index), int(batch.attention_mask.sum()))
    finally:
        progress.close()
        for writer, _ in writers:
            writer.close()


def _part(job: _Job, name: str, rank: int) -> Path:
    """This run's file ``name`` or, with several processes, rank ``rank``'s part of it."""
    return job.out / (name.replace(".parquet", f".rank{rank}.parquet") if job.corpus.world > 1 else name)


def _writers(job: _Job) -> list[tuple[SequenceWriter, Callable[[BatchRecord], pd.DataFrame]]]:
    """The per-sequence tables of this process and the function that makes each one's rows of a record.

    ``sublayer_sequences.parquet`` is written whenever sublayers are recorded (see its schema entry).
    """
    writers = [(SequenceWriter(_part(job, SEQUENCES_FILE, job.corpus.rank)), sequence_rows)]
    if job.config.sublayers:
        writers.append((SequenceWriter(_part(job, SUBLAYER_SEQUENCES_FILE, job.corpus.rank), 50_000,
                                       SUBLAYER_SEQUENCE_SCHEMA), sublayer_sequence_rows))
    return writers


def _record_batch(job: _Job, recorder: GradFlowRecorder, batch: MaskedBatch,
                  writers: list[tuple[SequenceWriter, Callable[[BatchRecord], pd.DataFrame]]]) -> bool:
    """Record one batch and fold it into the job; False (and counted) when it is not finite."""
    record = recorder.record(batch, loss=job.config.loss, reduction=job.config.reduction)
    sequences = len(batch.sequence_index)
    if not record_is_finite(record):
        job.stats.skip(sequences)
        return False
    job.sites.add(record)
    job.subs.add(record)
    for writer, rows in writers:
        writer.add(rows(record))
    job.stats.add_record(record)
    return True


def _discard(out: Path) -> None:
    """Remove what this run wrote (nothing was recorded, so nothing is lost)."""
    for path in [p for pattern in ("sequences*.parquet", ".sequences*", "sublayer_sequences*.parquet",
                                   ".sublayer_sequences*") for p in out.glob(pattern)]:
        path.unlink(missing_ok=True)
    if out.exists() and not any(out.iterdir()):
        out.rmdir()


def _check_nonempty(job: _Job) -> None:
    """Refuse a corpus with no document, or with nothing the tokenizer leaves maskable."""
    texts, counts = job.corpus.source, job.corpus.counts
    if counts.documents == 0:
        _discard(job.out)
        raise CorpusError(f"the corpus {texts} is empty: it has no non-blank document. Pass a corpus with at "
                          "least one line of text.")
    if counts.windows == 0 or job.stats.loss_tokens == 0:
        _discard(job.out)
        raise CorpusError(f"nothing in {texts} can be masked: its {counts.documents} document(s) tokenize to no "
                          "maskable token (only special tokens, or text the tokenizer drops). Pass real text "
                          "in the model's language.")


def _finish(job: _Job) -> RunSummary:
    """Merge across processes and write every table; partial runs are marked complete=false."""
    world = job.corpus.world
    if world > 1:
        _gather(job)
    if job.corpus.rank != 0:
        torch.distributed.barrier()
        return job.summary()
    if world > 1:
        merge_sequence_parts([_part(job, SEQUENCES_FILE, r) for r in range(world)], job.out / SEQUENCES_FILE)
        if job.config.sublayers:
            merge_sequence_parts([_part(job, SUBLAYER_SEQUENCES_FILE, r) for r in range(world)],
                                 job.out / SUBLAYER_SEQUENCES_FILE, SUBLAYER_SEQUENCE_SCHEMA)
    write_csv(job.sites.frame(), job.out / CHANNELS_FILE, CHANNEL_COLUMNS)
    write_csv(job.subs.frame(), job.out / SUBLAYERS_FILE, SUBLAYER_COLUMNS)
    meta = _meta(job)
    write_meta(job.out / META_FILE, meta)
    if world > 1:
        torch.distributed.barrier()
    return job.summary(meta)


def _gather(job: _Job) -> None:
    """Fold every process's accumulators and counts into rank 0's job (the others keep their own)."""
    corpus = job.corpus
    gathered: list = [None] * corpus.world
    torch.distributed.all_gather_object(gathered, (job.sites, job.subs, asdict(corpus.counts), job.stats,
                                                   corpus.complete))
    if corpus.rank != 0:
        return
    job.sites, job.subs = gathered[0][0], gathered[0][1]
    for other in gathered[1:]:
        job.sites.merge(other[0])
        job.subs.merge(other[1])
    job.stats = RecordStats()
    for other in gathered:
        job.stats.merge(other[3])
    corpus.complete = all(g[4] for g in gathered)
    corpus.counts = CorpusCounts(**gathered[0][2])  # every rank reads the whole document stream
    corpus.counts.windows = sum(g[2]["windows"] for g in gathered) // corpus.world


def _meta(job: _Job) -> dict:
    """meta.json of a record run: the common provenance block plus the recording's settings and counts."""
    cfg, loaded, corpus = job.config, job.loaded, job.corpus
    masking = {k: v for k, v in corpus.policy.describe().items() if k != "min_selected"}
    inputs = JobInputs(model=cfg.model, texts=corpus.source, masking=masking, seed=cfg.seed, num_layers=job.num_layers)
    fields = {
        "attn_norm": loaded.adapter.attn_norm, "after_mixing_sublayers": list(loaded.adapter.after_mixing()),
        "tokenizer": _portable_tokenizer(loaded, job.out), "loss": cfg.loss, "reduction": cfg.reduction,
        "max_length": cfg.max_length, "batch_size": cfg.batch_size, "limit": cfg.limit, "device": cfg.device,
        "dtype": cfg.dtype, "world_size": corpus.world, "counts": _counts(job), "mean_loss": job.stats.mean_loss,
    }
    shared = weight_sharing(block_modules(loaded.adapter, loaded.model.base_model))
    if shared:  # rows of these layers are per application; the shared weight's gradient is their sum
        fields[WEIGHT_SHARING_META_KEY] = {"shared_layers": shared}
    return job_meta(loaded, inputs, corpus.outcome(cfg.command, job.out), fields)


def _portable_tokenizer(loaded: LoadedModel, out: Path) -> dict:
    """The tokenizer's name, vocabulary size and hash, its path portable."""
    info = loaded.tokenizer_info()
    return {**info, "name_or_path": portable_path(info["name_or_path"], out)}


def _counts(job: _Job) -> dict:
    """The ``counts`` block of meta.json."""
    counts, stats = job.corpus.counts, job.stats
    return {
        "documents": counts.documents, "windows": counts.windows, "split_documents": counts.split_documents,
        "sequences_recorded": stats.sequences, "batches": stats.batches, "tokens_per_role": stats.tokens,
        "skipped": {"empty_documents": counts.skipped_empty_documents,
                    "nonfinite_batches": stats.nonfinite_batches,
                    "nonfinite_sequences": stats.nonfinite_sequences, "reason_nonfinite": NONFINITE_REASON},
    }


class _progress:
    """A tqdm bar with sequences, tokens and tokens/s (or nothing when quiet). On a terminal it redraws
    up to 10 times a second; into a log file (stderr not a terminal) one line every 30 s and at the end."""

    def __init__(self, quiet: bool):
        self.bar = None
        self.tokens = 0
        self.start = time.time()
        if not quiet:
            self.bar = progress_bar(unit="seq", desc="recording", dynamic_ncols=True)

    def update(self, sequences: int, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(sequences)
            rate = self.tokens / max(time.time() - self.start, 1e-9)
            self.bar.set_postfix(tokens=self.tokens, tok_s=f"{rate:.0f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
