"""The masked-batch pipeline shared by every corpus job: documents -> windows -> shard -> batches -> masking.

Windows are numbered corpus-wide in reading order *before* sharding and masking is seeded by that
number (see :mod:`gradflow.inputs.masking`), so a window's roles never depend on the batch size or
on the number of processes. Every corpus job (``record``, ``diagnose``, ``check``, the MLM
evaluation) reads its batches from :func:`masked_batches` through the one corpus-job skeleton,
:mod:`gradflow.runs.job`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from gradflow.inputs.corpus import CorpusCounts, Document, Window, batches, iter_windows, shard
from gradflow.inputs.masking import MaskedBatch, MaskingPolicy, mask_batch


def mask_windows(tokenizer, windows: list[Window], policy: MaskingPolicy, max_length: int) -> MaskedBatch:
    """Mask and pad one group of windows; rows keep the windows' order and sequence indices (B, T)."""
    return mask_batch(tokenizer, policy=policy, indices=[w.sequence_index for w in windows],
                      encodings=[w.encoding for w in windows], max_length=max_length)


def masked_batches(tokenizer, documents: Iterable[Document], policy: MaskingPolicy, max_length: int,
                   batch_size: int, *, limit: int | None = None, rank: int = 0, world_size: int = 1,
                   counts: CorpusCounts | None = None) -> Iterator[MaskedBatch]:
    """Masked batches of at most ``batch_size`` windows of ``max_length`` tokens (special tokens included).

    ``limit`` stops after that many windows of the whole corpus (counted before sharding);
    ``rank``/``world_size`` keep the windows with ``sequence_index % world_size == rank``;
    ``counts`` (updated in place as the stream is read) gets the corpus counts for meta.json.
    Each batch's ``sequence_index`` (B,) names its windows. Lazy: nothing is read until iterated.
    """
    counts = counts if counts is not None else CorpusCounts()
    windows = iter_windows(tokenizer, documents, max_length, counts, limit)
    for group in batches(shard(windows, rank, world_size), batch_size):
        yield mask_windows(tokenizer, group, policy, max_length)


__all__ = ["mask_windows", "masked_batches"]
