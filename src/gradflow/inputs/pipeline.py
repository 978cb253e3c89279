"""The masked-batch pipeline shared by every corpus job: documents -> windows -> shard -> batches -> masking.

Windows are numbered corpus-wide in reading order *before* sharding and masking is seeded by that
number (see :mod:`gradflow.inputs.masking`), so a window's roles never depend on the batch size or
on the number of processes. Every corpus job (``record``, ``diagnose``, ``check``, the MLM
evaluation) reads its batches from :func:`masked_batches` through the one corpus-job skeleton,
:mod:`gradflow.runs.job`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from gradflow.inputs.canvas import canvas_batch, split_encoding
from gradflow.inputs.corpus import CorpusCounts, Document, Window, batches, iter_windows, shard
from gradflow.inputs.masking import MaskedBatch, MaskingPolicy, mask_batch


def mask_windows(tokenizer, windows: list[Window], policy: MaskingPolicy, max_length: int,
                 canvas: int | None = None) -> MaskedBatch:
    """Mask and pad one group of windows; rows keep the windows' order and sequence indices (B, T).

    ``canvas``: a two-pass model's canvas length C: each window is split into prompt and canvas first, and the batch
    is laid out as (B, P + C) (:mod:`gradflow.inputs.canvas`)."""
    encodings = [w.encoding for w in windows]
    if canvas is not None:
        encodings = [split_encoding(e, canvas, f"sequence {w.sequence_index}") for e, w in zip(encodings, windows)]
    batch = mask_batch(tokenizer, policy=policy, indices=[w.sequence_index for w in windows],
                       encodings=encodings, max_length=max_length)
    if canvas is None:
        return batch
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return canvas_batch(batch, [e["prompt_length"] for e in encodings], pad)


def masked_batches(tokenizer, documents: Iterable[Document], policy: MaskingPolicy, max_length: int,
                   batch_size: int, *, limit: int | None = None, rank: int = 0, world_size: int = 1,
                   counts: CorpusCounts | None = None, canvas: int | None = None) -> Iterator[MaskedBatch]:
    """Masked batches of at most ``batch_size`` windows of ``max_length`` tokens (special tokens included).

    ``limit`` stops after that many windows of the whole corpus (counted before sharding);
    ``rank``/``world_size`` keep the windows with ``sequence_index % world_size == rank``;
    ``counts`` (updated in place as the stream is read) gets the corpus counts for meta.json.
    Each batch's ``sequence_index`` (B,) names its windows; ``canvas``: see :func:`mask_windows`. Lazy: nothing is
    read until iterated.
    """
    counts = counts if counts is not None else CorpusCounts()
    windows = iter_windows(tokenizer, documents, max_length, counts, limit)
    for group in batches(shard(windows, rank, world_size), batch_size):
        yield mask_windows(tokenizer, group, policy, max_length, canvas)


__all__ = ["mask_windows", "masked_batches"]
