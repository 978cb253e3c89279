"""The corpus-scale recording job behind ``gradflow record``: corpus in, run directory out.

One process or many (``torchrun`` / ``accelerate launch``: the corpus is sharded by sequence index,
accumulators are merged on rank 0, which alone writes the tables). Memory does not depend on the
corpus length: each batch is reduced to small accumulators before the next one is read.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from gradflow.adapters import block_modules
from gradflow.errors import CorpusError, RouterAuxLossError, UsageError
from gradflow.hooks.recorder import GradFlowRecorder, RecorderConfig
from gradflow.inputs.corpus import CorpusCounts, check_corpus_path, default_texts
from gradflow.inputs.masking import BertMasking, MaskedBatch, MaskedDiffusion, MaskingPolicy, TokenizerInfo
from gradflow.inputs.prompted import PromptFields
from gradflow.models import DEFAULT_MODEL, LoadedModel, load_model
from gradflow.provenance import portable_path
from gradflow.runs.aggregate import SiteAggregator, SublayerAggregator, record_is_finite
from gradflow.runs.check import weight_sharing
from gradflow.runs.checkpoint import CHECKPOINT_DIR, Checkpoint, fault, rank_dir, save_checkpoint
from gradflow.runs.distributed import distributed_session
from gradflow.runs.files import SequenceWriter, merge_sequence_parts, prepare_output_dir, write_csv, write_meta
from gradflow.runs.job import CorpusJob, canvas_meta, open_job
from gradflow.runs.meta import JobInputs, job_meta
from gradflow.runs.record_stats import RecordProgress, RecordStats, aux_setting, record_counts
from gradflow.runs.record_tables import DISCARD_PATTERNS, Rows, SequenceTable, open_writers, part_name, sequence_tables
from gradflow.runs.sharding import ShardPlan, check_sharding, shard_model
from gradflow.runs.resume import (
    DEFAULT_EVERY,
    DEFAULT_MINUTES,
    Cadence,
    check_resumable,
    disk_errors,
    open_resume,
    restore_aggregators,
    restore_fields,
    settings_fingerprint,
    state_tensors,
    stats_state,
)
from gradflow.schema import (CHANNEL_COLUMNS, CHANNELS_FILE, META_FILE, SUBLAYER_COLUMNS, SUBLAYERS_FILE,
                             WEIGHT_SHARING_META_KEY)


@dataclass
class RecordConfig:
    """Everything that defines a recording (all of it goes into meta.json).

    ``resume``: continue the unfinished run in ``out`` from its last checkpoint; checkpoints are written
    every ``checkpoint_every`` sequences or ``checkpoint_minutes`` minutes, whichever comes first.
    ``objective``: a masking policy (:class:`~gradflow.inputs.objectives.MaskedDiffusion`,
    :class:`~gradflow.inputs.objectives.SpanMasking`, a shifted :class:`BertMasking`, ...) in place of
    BERT masking by ``mask_rate``, ``mask_split`` and ``whole_word``; ``seed`` replaces its own seed.
    ``prompted``: ``texts`` is a prompt/response ``.jsonl`` corpus with these fields (supervised
    fine-tuning of a diffusion LM: the prompt is never masked; :mod:`gradflow.inputs.prompted`).
    """

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
    resume: bool = False
    checkpoint_every: int = DEFAULT_EVERY
    checkpoint_minutes: float = DEFAULT_MINUTES
    objective: MaskingPolicy | None = None
    prompted: PromptFields | None = None
    router_aux_loss: float | str | None = None  # the model's auxiliary router loss: "model" (its coefficient), a float
    shard: str = "none"  # "fsdp2": the model sharded across torchrun's ranks (gradflow.runs.sharding)
    canvas_length: int | None = None  # a two-pass model's canvas length C (None: its config's canvas_length)

    def policy(self) -> MaskingPolicy:
        """The masking policy of this recording, seeded by ``seed``."""
        if self.objective is not None:
            return replace(self.objective, seed=self.seed)
        return BertMasking(rate=self.mask_rate, split=tuple(self.mask_split), whole_word=self.whole_word,
                           seed=self.seed)


@dataclass
class RunSummary:
    """What a finished (or interrupted) run produced."""

    out: Path
    complete: bool
    sequences: int
    tokens: int
    wall_s: float
    meta: dict = field(default_factory=dict)
    checkpoint_s: float = 0.0  # time spent writing checkpoints (not in meta.json: a resumed run's is its own)


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
    next_index: int = 0  # the first window (corpus-wide index) not yet recorded
    fingerprint: dict = field(default_factory=dict)
    checkpointed: dict | None = None  # meta.json's "progress": what the last checkpoint holds
    checkpoint_s: float = 0.0
    sharding: ShardPlan | None = None

    def summary(self, meta: dict | None = None) -> RunSummary:
        """The run summary as this process sees it."""
        return RunSummary(self.out, self.corpus.complete, self.stats.sequences, self.stats.real_tokens,
                          time.time() - self.corpus.start, meta or {}, self.checkpoint_s)


def record_corpus(config: RecordConfig, loaded: LoadedModel | None = None) -> RunSummary:
    """Record gradient flow over a corpus and write the run directory (see :mod:`gradflow.schema`)."""
    start = time.time()
    with distributed_session(config.device) as (rank, world, device):
        return _record_corpus(config, loaded, start, rank, world, device)


def _record_corpus(config: RecordConfig, loaded: LoadedModel | None, start: float, rank: int, world: int,
                   device: str) -> RunSummary:
    """:func:`record_corpus` in this process (``rank`` of ``world``, on ``device``), started at ``start``."""
    out = Path(config.out)
    texts = config.texts or default_texts()
    check_corpus_path(texts)  # before anything is created, so a bad path leaves nothing behind
    check_sharding(config.shard, world, config.router_aux_loss)
    saved = open_resume(out, rank, world) if config.resume else None
    if rank == 0:  # (a resumed run's directory: only a killed run's half-written files go; the ranks wait below)
        prepare_output_dir(out, config.overwrite, resume=config.resume)
    if world > 1:
        torch.distributed.barrier()
    loaded = loaded or load_model(config.model, device, config.dtype, config.trust_remote_code, config.adapter,
                                  max_length=config.max_length)
    loaded, plan = shard_model(loaded, device, world) if config.shard == "fsdp2" else (loaded, None)
    policy = config.policy()
    try:
        corpus = open_job(loaded, texts, policy, config.max_length, config.batch_size, limit=config.limit,
                          rank=rank, world=world, start=start, model=config.model, prompted=config.prompted,
                          canvas=config.canvas_length)
    except UsageError:  # a window longer than the model accepts, a bad C: refused before anything is recorded
        if not config.resume:  # (a resumed run's directory is left as it is)
            _discard(out)
        raise
    TokenizerInfo.from_tokenizer(loaded.tokenizer)
    try:
        options = RecorderConfig(sublayers=config.sublayers, position_magnitudes=config.sublayers,
                                 router_aux_loss=config.router_aux_loss)
        recorder = GradFlowRecorder(loaded.model, options, loaded.adapter)
    except RouterAuxLossError:  # asked of a model without a known auxiliary router loss: nothing recorded
        if not config.resume:
            _discard(out)
        raise
    job = _Job(config, loaded, corpus, out, recorder.num_blocks,
               SiteAggregator(recorder.site_names, recorder.site_layers, recorder.site_points), SublayerAggregator())
    job.stats.aux_coef, job.sharding = recorder.aux_coef, plan
    if plan is not None:  # the ranks run every step together: FSDP2's gathers are collectives
        corpus.idle, corpus.device = lambda b: recorder.record(b, config.loss, config.reduction), device
    job.fingerprint = _fingerprint(job, texts)
    if saved is not None:
        _restore(job, saved, start)
    _stream(job, recorder)
    refusal = corpus.refusal(job.stats.sequences)
    if refusal is not None:
        if not config.resume:
            _discard(out)
        raise refusal
    if corpus.complete and rank == 0 and world == 1:
        _check_nonempty(job)
    try:
        summary = _finish(job)
    except OSError:
        if corpus.failure is None:
            raise
        summary = job.summary()  # the disk that failed the run fails the flush too: the checkpoint stands
    if corpus.complete and rank == 0:  # (rank 0's "complete" is every rank's, and the tables are written)
        shutil.rmtree(out / CHECKPOINT_DIR, ignore_errors=True)
        for partial in [p for n in (CHANNELS_FILE, SUBLAYERS_FILE, META_FILE) for p in out.glob(_ranked(n, "*"))]:
            partial.unlink(missing_ok=True)  # the processes' partial tables of an unfinished torchrun
    corpus.reraise()
    return summary


def _fingerprint(job: _Job, texts: str) -> dict:
    """What a resumed job must share with its checkpoint (see docs: model, tokenizer, corpus, masking, ...)."""
    cfg = job.config
    return settings_fingerprint(job.loaded, cfg.model, texts, job.corpus.policy, seed=cfg.seed,
                                max_length=cfg.max_length, batch_size=cfg.batch_size, limit=cfg.limit, loss=cfg.loss,
                                reduction=cfg.reduction, sublayers=cfg.sublayers, dtype=cfg.dtype,
                                world_size=job.corpus.world, **_prompted_meta(cfg), **aux_setting(cfg.router_aux_loss),
                                **({"shard": cfg.shard} if job.sharding else {}),
                                **({"canvas_length": job.corpus.canvas} if job.corpus.canvas else {}))


def _restore(job: _Job, saved: Checkpoint, start: float) -> None:
    """Continue from ``saved``: refuse other settings, then restore accumulators, counts, position and clock."""
    check_resumable(saved, job.fingerprint, job.out)
    restore_aggregators(saved, job.sites, job.subs)
    restore_fields(job.stats, saved.state["stats"])
    job.next_index = job.corpus.resume_from = int(saved.state["next_index"])
    job.corpus.start = start - float(saved.state["wall_s"])
    job.checkpointed = saved.state["progress"]


def _stream(job: _Job, recorder: GradFlowRecorder) -> None:
    """Record this process's batches into ``job`` (an interrupt or error is kept on ``job.corpus``),
    checkpointing on the job's cadence."""
    parts = job.checkpointed["parts"] if job.checkpointed else {}
    writers = _writers(job, parts)
    progress = RecordProgress(job.config.quiet or job.corpus.rank != 0)
    cadence = Cadence(job.config.checkpoint_every, job.config.checkpoint_minutes)
    try:
        with job.corpus.running(), recorder, disk_errors(job.out, lambda: job.checkpointed):
            for batch in job.corpus.batches():
                if _record_batch(job, recorder, batch, writers):
                    progress.update(len(batch.sequence_index), int(batch.attention_mask.sum()))
                job.next_index = int(batch.sequence_index.max()) + 1
                fault("kill_at_batch")
                if cadence.due(len(batch.sequence_index)):
                    _checkpoint(job, writers)
    finally:
        progress.close()
        for writer, _ in writers:
            try:
                writer.close(keep_parts=not job.corpus.complete)
            except OSError:
                if job.corpus.failure is None:
                    raise
                writer.abandon()


def _checkpoint(job: _Job, writers: list) -> None:
    """Close the tables' parts, then write the aggregated state durably (and, in one process, the tables
    and a meta.json with ``complete`` false and the progress)."""
    began = time.perf_counter()
    parts = {writer.path.name: writer.checkpoint() for writer, _ in writers}
    fault("kill_after_parts")
    tensors, keys = state_tensors(job.sites, job.subs)
    progress = {"sequences": job.stats.sequences, "windows": job.next_index, "parts": parts,
                "checkpoint_utc": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    state = {"job": "record", "fingerprint": job.fingerprint, "next_index": job.next_index,
             "stats": stats_state(job.stats), "wall_s": time.time() - job.corpus.start, "sublayer_keys": keys,
             "progress": progress}
    save_checkpoint(rank_dir(job.out, job.corpus.rank), Checkpoint(state, tensors))
    job.checkpointed = progress
    fault("kill_after_checkpoint")
    if job.corpus.world == 1:
        _write_tables(job)
    else:  # each process its own partial tables; rank 0's meta.json says the run is unfinished
        meta = _write_tables(job, job.corpus.rank)
        if job.corpus.rank == 0:
            write_meta(job.out / META_FILE, meta)
    job.checkpoint_s += time.perf_counter() - began


def _ranked(name: str, rank: int | str | None) -> str:
    """Process ``rank``'s partial copy of table ``name`` (``channels.rank1.csv``; ``"*"``: a glob); None: ``name``."""
    return name if rank is None else name.replace(".", f".rank{rank}.", 1)


def _writers(job: _Job, parts: dict[str, int]) -> list[tuple[SequenceWriter, Rows]]:
    """This process's per-sequence tables (:mod:`gradflow.runs.record_tables`) and each one's row function;
    ``parts``: each table's durable parts kept from the checkpoint a resumed job continues."""
    return open_writers(job.out, _tables(job), job.corpus.rank, job.corpus.world, parts)


def _tables(job: _Job) -> list[SequenceTable]:
    """The per-sequence tables this run writes: sublayer sums when recorded, each sequence's t under diffusion."""
    return sequence_tables(job.config.sublayers, isinstance(job.corpus.policy, MaskedDiffusion))


def _record_batch(job: _Job, recorder: GradFlowRecorder, batch: MaskedBatch,
                  writers: list[tuple[SequenceWriter, Rows]]) -> bool:
    """Record one batch and fold it into the job; False (and counted) when it is not finite."""
    record = recorder.record(batch, loss=job.config.loss, reduction=job.config.reduction)
    sequences = len(batch.sequence_index)
    if not record_is_finite(record):
        job.stats.skip(sequences)
        return False
    job.sites.add(record)
    job.subs.add(record)
    for writer, rows in writers:
        writer.add(rows(record, batch))
    job.stats.add_record(record)
    return True


def _discard(out: Path) -> None:
    """Remove what this run wrote (nothing was recorded, so nothing is lost)."""
    for path in [p for pattern in DISCARD_PATTERNS for p in out.glob(pattern)]:
        path.unlink(missing_ok=True)
    shutil.rmtree(out / CHECKPOINT_DIR, ignore_errors=True)
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
        for table in _tables(job):
            merge_sequence_parts([job.out / part_name(table.name, r, world) for r in range(world)],
                                 job.out / table.name, table.schema)
    meta = _write_tables(job)
    if world > 1:
        torch.distributed.barrier()
    return job.summary(meta)


def _write_tables(job: _Job, rank: int | None = None) -> dict:
    """channels.csv, sublayers.csv and meta.json from the accumulators as they stand; the meta. ``rank``: an
    unfinished process's own partial tables under torchrun, ``<name>.rank<r>.<ext>``."""
    write_csv(job.sites.frame(), job.out / _ranked(CHANNELS_FILE, rank), CHANNEL_COLUMNS)
    write_csv(job.subs.frame(), job.out / _ranked(SUBLAYERS_FILE, rank), SUBLAYER_COLUMNS)
    for name, frame, columns in job.stats.tables():  # mixtures of experts: experts.csv, router_aux.csv
        write_csv(frame, job.out / _ranked(name, rank), columns)
    meta = _meta(job)
    write_meta(job.out / _ranked(META_FILE, rank), meta)
    return meta


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
        "dtype": cfg.dtype, "world_size": corpus.world,
        "counts": record_counts(corpus.counts, job.stats, cfg.prompted is not None), "mean_loss": job.stats.mean_loss,
    }
    fields.update({**_prompted_meta(cfg), **canvas_meta(corpus.canvas, cfg.canvas_length is not None),
                   **job.stats.aux_meta(cfg.router_aux_loss),
                   **({"routers": list(loaded.adapter.router_names())} if loaded.adapter.experts else {}),
                   **({"sharding": job.sharding.describe()} if job.sharding else {})})
    if not corpus.complete and job.checkpointed:  # how far a --resume starts from
        fields["progress"] = {k: v for k, v in job.checkpointed.items() if k != "parts"}
    shared = weight_sharing(block_modules(loaded.adapter, loaded.model.base_model))
    if shared:  # rows of these layers are per application; the shared weight's gradient is their sum
        fields[WEIGHT_SHARING_META_KEY] = {"shared_layers": shared}
    return job_meta(loaded, inputs, corpus.outcome(cfg.command, job.out), fields)


def _prompted_meta(config: RecordConfig) -> dict:
    """``{"prompted": {prompt_field, response_field}}`` for a prompt/response corpus; else nothing (as before)."""
    return {} if config.prompted is None else {"prompted": config.prompted.describe()}


def _portable_tokenizer(loaded: LoadedModel, out: Path) -> dict:
    """The tokenizer's name, vocabulary size and hash, its path portable."""
    info = loaded.tokenizer_info()
    return {**info, "name_or_path": portable_path(info["name_or_path"], out)}
