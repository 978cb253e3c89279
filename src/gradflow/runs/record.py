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

from gradflow.errors import CorpusError, GradflowError
from gradflow.hooks.recorder import BatchRecord, GradFlowRecorder, RecorderConfig
from gradflow.inputs.corpus import CorpusCounts, check_corpus_path, default_texts, read_documents
from gradflow.inputs.masking import BertMasking, MaskedBatch, TokenizerInfo
from gradflow.inputs.pipeline import masked_batches
from gradflow.models import DEFAULT_MODEL, LoadedModel, load_model
from gradflow.progress import progress_bar
from gradflow.provenance import portable_path
from gradflow.roles import LOSS_ROLES, TOKEN_ROLES, role_counts
from gradflow.runs.aggregate import (
    SiteAggregator,
    SublayerAggregator,
    record_is_finite,
    sequence_rows,
    sublayer_sequence_rows,
)
from gradflow.runs.files import (
    SUBLAYER_SEQUENCE_SCHEMA,
    SequenceWriter,
    merge_sequence_parts,
    prepare_output_dir,
    write_csv,
    write_meta,
)
from gradflow.runs.meta import JobInputs, JobOutcome, job_meta
from gradflow.schema import (
    CHANNEL_COLUMNS,
    CHANNELS_FILE,
    META_FILE,
    SEQUENCES_FILE,
    SUBLAYER_COLUMNS,
    SUBLAYER_SEQUENCES_FILE,
    SUBLAYERS_FILE,
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
class RecordStats:
    """Counts of a recording: sequences, batches, tokens per role, skipped non-finite batches, summed loss."""

    sequences: int = 0
    batches: int = 0
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOKEN_ROLES, 0))
    nonfinite_batches: int = 0
    nonfinite_sequences: int = 0
    loss_sum: float = 0.0

    def add(self, record: BatchRecord, sequences: int) -> None:
        """Count one recorded batch of ``sequences`` rows (its roles are (B, T) codes)."""
        for role, n in role_counts(record.roles).items():
            self.tokens[role] += n
        self.sequences += sequences
        self.batches += 1
        self.loss_sum += record.loss

    def skip(self, sequences: int) -> None:
        """Count one batch left out because its loss or a norm was not finite."""
        self.nonfinite_batches += 1
        self.nonfinite_sequences += sequences

    def merge(self, other: RecordStats) -> None:
        """Add another process's counts to these."""
        for name in ("sequences", "batches", "nonfinite_batches", "nonfinite_sequences", "loss_sum"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for role in TOKEN_ROLES:
            self.tokens[role] += other.tokens[role]

    @property
    def loss_tokens(self) -> int:
        """Positions that carried the loss (masked + random + kept)."""
        return sum(self.tokens[r] for r in LOSS_ROLES)

    @property
    def real_tokens(self) -> int:
        """Positions recorded, padding left out."""
        return sum(v for r, v in self.tokens.items() if r != "pad")

    @property
    def mean_loss(self) -> float | None:
        """Mean loss per recorded batch (None before the first batch)."""
        return self.loss_sum / self.batches if self.batches else None


@dataclass
class _Job:
    """State of one recording process: inputs, accumulators, counts and how it ended."""

    config: RecordConfig
    loaded: LoadedModel
    policy: BertMasking
    out: Path
    texts: str
    rank: int
    world: int
    num_layers: int
    sites: SiteAggregator
    subs: SublayerAggregator
    start: float
    counts: CorpusCounts = field(default_factory=CorpusCounts)
    stats: RecordStats = field(default_factory=RecordStats)
    complete: bool = False
    error: str | None = None

    def summary(self, meta: dict | None = None) -> RunSummary:
        """The run summary as this process sees it."""
        return RunSummary(self.out, self.complete, self.stats.sequences, self.stats.real_tokens,
                          time.time() - self.start, meta or {})


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
    _check_max_length(config, loaded, out)
    policy = BertMasking(rate=config.mask_rate, split=tuple(config.mask_split), whole_word=config.whole_word,
                         seed=config.seed)
    TokenizerInfo.from_tokenizer(loaded.tokenizer)
    recorder = GradFlowRecorder(loaded.model, RecorderConfig(sublayers=config.sublayers,
                                                             position_magnitudes=config.sublayers), loaded.adapter)
    job = _Job(config, loaded, policy, out, texts, rank, world, recorder.num_blocks,
               SiteAggregator(recorder.site_names, recorder.site_layers, recorder.site_points),
               SublayerAggregator(), start)
    failure = _stream(job, recorder)
    if isinstance(failure, GradflowError) and job.stats.sequences == 0:
        _discard(out)
        raise failure
    if job.complete and rank == 0 and world == 1:
        _check_nonempty(job)
    summary = _finish(job)
    if failure is not None:
        raise failure
    if job.error is not None:
        raise KeyboardInterrupt(job.error)
    return summary


def _check_max_length(config: RecordConfig, loaded: LoadedModel, out: Path) -> None:
    """Refuse a window longer than the model accepts (before anything is recorded)."""
    if config.max_length > loaded.max_positions():
        _discard(out)
        raise GradflowError(f"--max-length {config.max_length} is longer than the {loaded.max_positions()} positions "
                            f"{config.model} accepts; pass --max-length {loaded.max_positions()} or less.")


def _stream(job: _Job, recorder: GradFlowRecorder) -> BaseException | None:
    """Record this process's batches into ``job``; returns the error that stopped it early, if any.

    An interrupt sets ``job.error`` and returns None; partial results are flushed either way.
    """
    cfg = job.config
    writers = _writers(job)
    progress = _progress(cfg.quiet or job.rank != 0)
    failure: BaseException | None = None
    try:
        stream = masked_batches(job.loaded.tokenizer, read_documents(job.texts), job.policy, cfg.max_length,
                                cfg.batch_size, limit=cfg.limit, rank=job.rank, world_size=job.world,
                                counts=job.counts)
        with recorder:
            for batch in stream:
                if _record_batch(job, recorder, batch, writers):
                    progress.update(len(batch.sequence_index), int(batch.attention_mask.sum()))
        job.complete = True
    except KeyboardInterrupt:
        job.error = "interrupted (SIGINT)"
    except Exception as err:  # noqa: BLE001 - partial results are flushed by the caller, then it is re-raised
        failure, job.error = err, f"{type(err).__name__}: {err}"
    finally:
        progress.close()
        for writer, _ in writers:
            writer.close()
    return failure


def _part(job: _Job, name: str, rank: int) -> Path:
    """This run's file ``name`` or, with several processes, rank ``rank``'s part of it."""
    return job.out / (name.replace(".parquet", f".rank{rank}.parquet") if job.world > 1 else name)


def _writers(job: _Job) -> list[tuple[SequenceWriter, Callable[[BatchRecord], pd.DataFrame]]]:
    """The per-sequence tables of this process and the function that makes each one's rows of a record.

    ``sublayer_sequences.parquet`` is written whenever sublayers are recorded (see its schema entry).
    """
    writers = [(SequenceWriter(_part(job, SEQUENCES_FILE, job.rank)), sequence_rows)]
    if job.config.sublayers:
        writers.append((SequenceWriter(_part(job, SUBLAYER_SEQUENCES_FILE, job.rank), 50_000,
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
    job.stats.add(record, sequences)
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
    texts, counts = job.texts, job.counts
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
    if job.world > 1:
        _gather(job)
    if job.rank != 0:
        torch.distributed.barrier()
        return job.summary()
    if job.world > 1:
        merge_sequence_parts([_part(job, SEQUENCES_FILE, r) for r in range(job.world)], job.out / SEQUENCES_FILE)
        if job.config.sublayers:
            merge_sequence_parts([_part(job, SUBLAYER_SEQUENCES_FILE, r) for r in range(job.world)],
                                 job.out / SUBLAYER_SEQUENCES_FILE, SUBLAYER_SEQUENCE_SCHEMA)
    write_csv(job.sites.frame(), job.out / CHANNELS_FILE, CHANNEL_COLUMNS)
    write_csv(job.subs.frame(), job.out / SUBLAYERS_FILE, SUBLAYER_COLUMNS)
    meta = _meta(job)
    write_meta(job.out / META_FILE, meta)
    if job.world > 1:
        torch.distributed.barrier()
    return job.summary(meta)


def _gather(job: _Job) -> None:
    """Fold every process's accumulators and counts into rank 0's job (the others keep their own)."""
    gathered: list = [None] * job.world
    torch.distributed.all_gather_object(gathered, (job.sites, job.subs, asdict(job.counts), job.stats, job.complete))
    if job.rank != 0:
        return
    job.sites, job.subs = gathered[0][0], gathered[0][1]
    for other in gathered[1:]:
        job.sites.merge(other[0])
        job.subs.merge(other[1])
    job.stats = RecordStats()
    for other in gathered:
        job.stats.merge(other[3])
    job.complete = all(g[4] for g in gathered)
    job.counts = CorpusCounts(**gathered[0][2])  # every rank reads the whole document stream
    job.counts.windows = sum(g[2]["windows"] for g in gathered) // job.world


def _meta(job: _Job) -> dict:
    """meta.json of a record run: the common provenance block plus the recording's settings and counts."""
    cfg, loaded = job.config, job.loaded
    masking = {k: v for k, v in job.policy.describe().items() if k != "min_selected"}
    inputs = JobInputs(model=cfg.model, texts=job.texts, masking=masking, seed=cfg.seed, num_layers=job.num_layers)
    fields = {
        "attn_norm": loaded.adapter.attn_norm, "after_mixing_sublayers": list(loaded.adapter.after_mixing()),
        "tokenizer": _portable_tokenizer(loaded, job.out), "loss": cfg.loss, "reduction": cfg.reduction,
        "max_length": cfg.max_length, "batch_size": cfg.batch_size, "limit": cfg.limit, "device": cfg.device,
        "dtype": cfg.dtype, "world_size": job.world, "counts": _counts(job), "mean_loss": job.stats.mean_loss,
    }
    return job_meta(loaded, inputs, JobOutcome(job.complete, job.error, job.start, cfg.command, str(job.out)), fields)


def _portable_tokenizer(loaded: LoadedModel, out: Path) -> dict:
    """The tokenizer's name, vocabulary size and hash, its path portable."""
    info = loaded.tokenizer_info()
    return {**info, "name_or_path": portable_path(info["name_or_path"], out)}


def _counts(job: _Job) -> dict:
    """The ``counts`` block of meta.json."""
    counts, stats = job.counts, job.stats
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
