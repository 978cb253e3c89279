"""The corpus-scale recording job behind ``gradflow record``: corpus in, run directory out.

One process or many (``torchrun`` / ``accelerate launch``: the corpus is sharded by sequence index,
accumulators are merged on rank 0, which alone writes the tables). Memory does not depend on the
corpus length: each batch is reduced to small accumulators before the next one is read.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from gradflow import __version__
from gradflow.errors import CorpusError, GradflowError
from gradflow.hooks.recorder import GradFlowRecorder, RecorderConfig
from gradflow.inputs.corpus import CorpusCounts, batches, check_corpus_path, iter_windows, read_documents, shard
from gradflow.inputs.masking import BertMasking, TokenizerInfo, mask_batch
from gradflow.models import DEFAULT_MODEL, LoadedModel, load_model
from gradflow.roles import TOKEN_ROLES
from gradflow.runs.aggregate import SiteAggregator, SublayerAggregator, record_is_finite, sequence_rows
from gradflow.runs.files import SequenceWriter, merge_sequence_parts, prepare_output_dir, write_csv, write_meta
from gradflow.runs.schema import CHANNEL_COLUMNS, SUBLAYER_COLUMNS


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


def default_texts() -> str:
    """Path of the committed public-domain SOTU sample shipped with the package."""
    from importlib import resources

    return str(resources.files("gradflow") / "data" / "sotu_sample.txt")


def _dist() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and os.environ.get("GRADFLOW_BACKEND") != "gloo" else "gloo"
        torch.distributed.init_process_group(backend=backend)
    if world > 1:
        return torch.distributed.get_rank(), world
    return 0, 1


def record_corpus(config: RecordConfig, loaded: LoadedModel | None = None) -> RunSummary:
    """Record gradient flow over a corpus and write the run directory (see :mod:`gradflow.runs.files`)."""
    start = time.time()
    rank, world = _dist()
    out = Path(config.out)
    texts = config.texts or default_texts()
    check_corpus_path(texts)  # before anything is created, so a bad path leaves nothing behind
    if rank == 0:
        prepare_output_dir(out, config.overwrite)
    if world > 1:
        torch.distributed.barrier()
    loaded = loaded or load_model(config.model, config.device, config.dtype, config.trust_remote_code)
    if config.max_length > loaded.max_positions():
        _discard(out, world)
        raise GradflowError(f"--max-length {config.max_length} is longer than the {loaded.max_positions()} positions "
                            f"{config.model} accepts; pass --max-length {loaded.max_positions()} or less.")
    policy = BertMasking(rate=config.mask_rate, split=tuple(config.mask_split), whole_word=config.whole_word,
                         seed=config.seed)
    TokenizerInfo.from_tokenizer(loaded.tokenizer)
    recorder = GradFlowRecorder(loaded.model, RecorderConfig(sublayers=config.sublayers), loaded.adapter)
    sites = SiteAggregator(recorder.site_names, recorder.site_layers, recorder.site_points)
    subs = SublayerAggregator()
    counts = CorpusCounts()
    stats = {"sequences": 0, "batches": 0, "tokens": {r: 0 for r in TOKEN_ROLES}, "nonfinite_batches": 0,
             "nonfinite_sequences": 0, "loss_sum": 0.0}
    part = out / (f"sequences.rank{rank}.parquet" if world > 1 else "sequences.parquet")
    writer = SequenceWriter(part)
    complete, error = False, None
    bad_input: GradflowError | None = None
    crash: BaseException | None = None
    progress = _progress(config.quiet or rank != 0)
    try:
        windows = iter_windows(loaded.tokenizer, read_documents(texts), config.max_length, counts, config.limit)
        with recorder:
            for group in batches(shard(windows, rank, world), config.batch_size):
                batch = mask_batch(loaded.tokenizer, policy=policy, indices=[w.sequence_index for w in group],
                                   encodings=[w.encoding for w in group], max_length=config.max_length)
                record = recorder.record(batch, loss=config.loss, reduction=config.reduction)
                if not record_is_finite(record):
                    stats["nonfinite_batches"] += 1
                    stats["nonfinite_sequences"] += len(group)
                    continue
                sites.add(record)
                subs.add(record)
                writer.add(sequence_rows(record))
                roles = torch.bincount(record.roles.reshape(-1).long(), minlength=len(TOKEN_ROLES))
                for code, role in enumerate(TOKEN_ROLES):
                    stats["tokens"][role] += int(roles[code])
                stats["sequences"] += len(group)
                stats["batches"] += 1
                stats["loss_sum"] += record.loss
                progress.update(len(group), int(batch.attention_mask.sum()))
        complete = True
    except KeyboardInterrupt:
        error = "interrupted (SIGINT)"
    except GradflowError as err:
        bad_input, error = err, f"{type(err).__name__}: {err}"
    except Exception as err:  # noqa: BLE001 - partial results are flushed below, then it is re-raised
        crash, error = err, f"{type(err).__name__}: {err}"
    finally:
        progress.close()
        writer.close()
    if bad_input is not None and stats["sequences"] == 0:
        _discard(out, world)
        raise bad_input
    if complete and rank == 0 and world == 1:
        _check_nonempty(texts, counts, stats, out)
    summary = _finish(config, loaded, out, texts, rank, world, sites, subs, counts, stats, complete, error, start)
    if crash is not None:
        raise crash
    if bad_input is not None:
        raise bad_input
    if error is not None:
        raise KeyboardInterrupt(error)
    return summary


def _discard(out: Path, world: int) -> None:
    """Remove what this run wrote (nothing was recorded, so nothing is lost)."""
    for path in list(out.glob("sequences*.parquet")) + list(out.glob(".sequences*")):
        path.unlink(missing_ok=True)
    if out.exists() and not any(out.iterdir()):
        out.rmdir()


def _check_nonempty(texts: str, counts: CorpusCounts, stats: dict, out: Path) -> None:
    if counts.documents == 0:
        _discard(out, 1)
        raise CorpusError(f"the corpus {texts} is empty: it has no non-blank document. Pass a corpus with at "
                          "least one line of text.")
    loss_tokens = sum(stats["tokens"][r] for r in ("masked", "random", "kept"))
    if counts.windows == 0 or loss_tokens == 0:
        _discard(out, 1)
        raise CorpusError(f"nothing in {texts} can be masked: its {counts.documents} document(s) tokenize to no "
                          "maskable token (only special tokens, or text the tokenizer drops). Pass real text "
                          "in the model's language.")


def _finish(config, loaded, out, texts, rank, world, sites, subs, counts, stats, complete, error,
            start) -> RunSummary:
    """Merge across processes and write every table; partial runs are marked complete=false."""
    if world > 1:
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, (sites, subs, asdict(counts), stats, complete))
        if rank == 0:
            sites, subs = gathered[0][0], gathered[0][1]
            for other in gathered[1:]:
                sites.merge(other[0])
                subs.merge(other[1])
            stats = _sum_stats([g[3] for g in gathered])
            complete = all(g[4] for g in gathered)
            counts = CorpusCounts(**gathered[0][2])  # every rank reads the whole document stream
            counts.windows = sum(g[2]["windows"] for g in gathered) // world
    if rank != 0:
        torch.distributed.barrier()
        return RunSummary(out, complete, stats["sequences"], sum(stats["tokens"].values()), time.time() - start)
    if world > 1:
        merge_sequence_parts([out / f"sequences.rank{r}.parquet" for r in range(world)], out / "sequences.parquet")
    write_csv(sites.frame(), out / "channels.csv", CHANNEL_COLUMNS)
    write_csv(subs.frame(), out / "sublayers.csv", SUBLAYER_COLUMNS)
    meta = _meta(config, loaded, texts, world, counts, stats, complete, error, start)
    write_meta(out / "meta.json", meta)
    if world > 1:
        torch.distributed.barrier()
    tokens = sum(v for r, v in stats["tokens"].items() if r != "pad")
    return RunSummary(out, complete, stats["sequences"], tokens, time.time() - start, meta)


def _sum_stats(all_stats: list[dict]) -> dict:
    total = {"sequences": 0, "batches": 0, "tokens": {r: 0 for r in TOKEN_ROLES}, "nonfinite_batches": 0,
             "nonfinite_sequences": 0, "loss_sum": 0.0}
    for s in all_stats:
        for key in ("sequences", "batches", "nonfinite_batches", "nonfinite_sequences", "loss_sum"):
            total[key] += s[key]
        for role in TOKEN_ROLES:
            total["tokens"][role] += s["tokens"][role]
    return total


def _meta(config, loaded, texts, world, counts, stats, complete, error, start) -> dict:
    import transformers

    adapter = loaded.adapter
    return {
        "complete": complete,
        "error": error,
        "model": config.model,
        "model_path": loaded.path,
        "family": adapter.family,
        "model_type": loaded.model.config.model_type,
        "config_hash": loaded.config_hash,
        "num_layers": GradFlowRecorder(loaded.model, RecorderConfig(sublayers=False), adapter).num_blocks,
        "attn_norm": adapter.attn_norm,
        "after_mixing_sublayers": list(adapter.after_mixing()),
        "tokenizer": loaded.tokenizer_info(),
        "texts": texts,
        "masking": {"policy": "bert", "rate": config.mask_rate, "split": list(config.mask_split),
                    "whole_word": config.whole_word, "seed": config.seed},
        "seed": config.seed,
        "loss": config.loss,
        "reduction": config.reduction,
        "max_length": config.max_length,
        "batch_size": config.batch_size,
        "limit": config.limit,
        "device": config.device,
        "dtype": config.dtype,
        "world_size": world,
        "counts": {
            "documents": counts.documents, "windows": counts.windows, "split_documents": counts.split_documents,
            "sequences_recorded": stats["sequences"], "batches": stats["batches"], "tokens_per_role": stats["tokens"],
            "skipped": {"empty_documents": counts.skipped_empty_documents,
                        "nonfinite_batches": stats["nonfinite_batches"],
                        "nonfinite_sequences": stats["nonfinite_sequences"],
                        "reason_nonfinite": "loss or a recorded norm was NaN/inf; such batches are counted, never averaged in"},
        },
        "mean_loss": stats["loss_sum"] / stats["batches"] if stats["batches"] else None,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "gradflow": __version__},
        "command": config.command or " ".join(sys.argv),
        "wall_s": round(time.time() - start, 2),
    }


class _progress:
    """A tqdm bar with sequences, tokens and tokens/s (or nothing when quiet)."""

    def __init__(self, quiet: bool):
        self.bar = None
        self.tokens = 0
        self.start = time.time()
        if not quiet:
            from tqdm import tqdm

            self.bar = tqdm(unit="seq", desc="recording", dynamic_ncols=True)

    def update(self, sequences: int, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(sequences)
            rate = self.tokens / max(time.time() - self.start, 1e-9)
            self.bar.set_postfix(tokens=self.tokens, tok_s=f"{rate:.0f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
