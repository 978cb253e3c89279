"""Word features at every site for probes, streamed to disk (float16 by default).

For each sentence the words are tokenised (a fast tokenizer's ``word_ids``), the model runs once
without gradients and every site's hidden state is hooked. A word's feature is its **first
sub-word**'s hidden state (``pooling="first"``) or the mean over its sub-words (``"mean"``).

Regimes: ``unmasked``: the sentence as is (every position a context channel: what fine-tuning
feeds the model); ``masked``: one copy of the sentence per word with that word's sub-words replaced
by the mask token, the feature read at the masked word (what pretraining trained the last block
on). Words cut off by ``max_length`` get no feature and are counted as ``dropped``.

Memory is bounded by one batch: features are appended to one raw file per (split, site) and read
back as ``np.memmap`` arrays ``(n_words, H)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gradflow.adapters.extra_inputs import token_inputs
from gradflow.errors import TaskError
from gradflow.hooks.sites import SiteLayer, model_device
from gradflow.inputs.corpus import batches
from gradflow.inputs.labelled import SPLIT_NAMES, LabelledSentences, LabelledSplits
from gradflow.models import LoadedModel

POOLINGS: tuple[str, ...] = ("first", "mean")
FEATURE_DTYPES: tuple[str, ...] = ("float16", "float32")
FLOAT16_MAX = 65504.0


@dataclass
class SplitFeatures:
    """One split's probed words: ``labels`` (N,) int, ``sentence`` (N,) int sentence index,
    ``word_types`` the N word strings, ``features`` site -> (N, H) memmap, ``dropped`` words without one,
    ``word`` (N,) int index of each word in its sentence."""

    labels: np.ndarray
    sentence: np.ndarray
    word_types: list[str]
    features: dict[str, np.ndarray] = field(default_factory=dict)
    dropped: int = 0
    word: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@dataclass(frozen=True)
class _Item:
    """One model input row: token ids, and per probed word (sentence, word index, positions)."""

    ids: list[int]
    words: list[tuple[int, int, tuple[int, ...]]]


def tokenised_words(tokenizer, sentences: LabelledSentences, max_length: int) -> Iterator[tuple[list[int], list[tuple[int, ...]]]]:
    """Per sentence: its token ids (special tokens included) and each word's positions (``()`` if cut off)."""
    if not getattr(tokenizer, "is_fast", False):
        raise TaskError(f"probes need a fast tokenizer (for word_ids); {type(tokenizer).__name__} is not one")
    for start in range(0, len(sentences), 256):
        chunk = [list(w) for w in sentences.words[start:start + 256]]
        enc = tokenizer(chunk, is_split_into_words=True, truncation=True, max_length=max_length)
        for i, words in enumerate(chunk):
            positions: list[list[int]] = [[] for _ in words]
            for pos, w in enumerate(enc.word_ids(i)):
                if w is not None:
                    positions[w].append(pos)
            yield list(enc["input_ids"][i]), [tuple(p) for p in positions]


def _items(tokenizer, sentences: LabelledSentences, max_length: int, masked: bool) -> Iterator[_Item]:
    """Model input rows: one per sentence (unmasked), or one per word with that word masked."""
    mask_id = tokenizer.mask_token_id
    if masked and mask_id is None:
        raise TaskError("the masked regime needs a tokenizer with a mask token; this one has none")
    for s, (ids, positions) in enumerate(tokenised_words(tokenizer, sentences, max_length)):
        if not masked:
            yield _Item(ids, [(s, w, p) for w, p in enumerate(positions)])
            continue
        for w, p in enumerate(positions):
            copy = list(ids)
            for pos in p:
                copy[pos] = mask_id
            yield _Item(copy, [(s, w, p)])


def _pooling_matrix(batch: list[_Item], width: int, pooling: str) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """(n_words, B * T) weights turning the batch's hidden states into word features, and each row's
    (sentence, word); words without positions are left out."""
    rows, keys = [], []
    for b, item in enumerate(batch):
        for s, w, positions in item.words:
            if not positions:
                continue
            row = torch.zeros(len(batch) * width)
            picked = positions[:1] if pooling == "first" else positions
            row[[b * width + p for p in picked]] = 1.0 / len(picked)
            rows.append(row)
            keys.append((s, w))
    return (torch.stack(rows) if rows else torch.zeros(0, len(batch) * width)), keys


def extract_split(loaded: LoadedModel, sentences: LabelledSentences, label_ids: dict[str, int], folder: Path,
                  split: str, *, regime: str = "unmasked", pooling: str = "first", max_length: int = 128,
                  batch_size: int = 32, mid: bool = False, dtype: str = "float16",
                  progress: Callable[[int], None] | None = None) -> SplitFeatures:
    """Features of every word of ``sentences`` at every site, appended to raw files under ``folder``."""
    if pooling not in POOLINGS:
        raise TaskError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")
    model, tokenizer = loaded.model, loaded.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sites = SiteLayer(model, loaded.adapter, mid=mid)
    files = {site: open(folder / f"{split}.{site}.bin", "wb") for site in sites.names}
    keys: list[tuple[int, int]] = []
    store: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad(), sites.hooks(lambda site, hidden: store.__setitem__(site, hidden.detach())):
            for batch in batches(_items(tokenizer, sentences, max_length, regime == "masked"), batch_size):
                width = max(len(item.ids) for item in batch)
                ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
                attention = torch.zeros((len(batch), width), dtype=torch.long)
                for b, item in enumerate(batch):
                    ids[b, : len(item.ids)] = torch.tensor(item.ids)
                    attention[b, : len(item.ids)] = 1
                device = model_device(model)
                extra = token_inputs(tokenizer, ids, attention)  # RoCBert's shape and pronunciation ids
                model(input_ids=ids.to(device), attention_mask=attention.to(device),
                      **{name: value.to(device) for name, value in extra.items()})
                weights, batch_keys = _pooling_matrix(batch, width, pooling)
                for site in sites.names:
                    hidden = store[site].float().cpu().reshape(len(batch) * width, -1)
                    files[site].write(_as_dtype(weights @ hidden, dtype, site).tobytes())
                keys.extend(batch_keys)
                store.clear()
                if progress is not None:
                    progress(sum(len(item.words) for item in batch))
    finally:
        for handle in files.values():
            handle.close()
    return _split_features(sentences, label_ids, folder, split, sites.names, keys, dtype)


def _as_dtype(features: torch.Tensor, dtype: str, site: str) -> np.ndarray:
    """(n, H) float32 -> numpy in ``dtype``; a value too large for float16 raises with the fix."""
    array = features.numpy()
    if dtype == "float16" and array.size and float(np.abs(array).max()) > FLOAT16_MAX:
        raise TaskError(f"hidden states at {site} exceed the float16 range ({FLOAT16_MAX:g}); "
                        "rerun with --feature-dtype float32")
    return array.astype(dtype)


def _split_features(sentences: LabelledSentences, label_ids: dict[str, int], folder: Path, split: str,
                    site_names: Sequence[str], keys: list[tuple[int, int]], dtype: str) -> SplitFeatures:
    labels = np.array([label_ids[sentences.labels[s][w]] for s, w in keys], dtype=np.int64)
    sentence = np.array([s for s, _ in keys], dtype=np.int64)
    types = [sentences.words[s][w] for s, w in keys]
    word = np.array([w for _, w in keys], dtype=np.int64)
    out = SplitFeatures(labels, sentence, types, dropped=sentences.num_words - len(keys), word=word)
    for site in site_names:
        path = folder / f"{split}.{site}.bin"
        n = len(keys)
        width = path.stat().st_size // (np.dtype(dtype).itemsize * n) if n else 0
        out.features[site] = np.memmap(path, dtype=dtype, mode="r", shape=(n, width)) if n else np.zeros((0, 0))
    return out


def extract_all(loaded: LoadedModel, task: LabelledSplits, folder: Path, progress: Callable[[int], None] | None = None,
                **options) -> dict[str, SplitFeatures]:
    """:func:`extract_split` for train, validation and test; raises if a split keeps no word."""
    label_ids = {label: i for i, label in enumerate(task.labels)}
    out = {}
    for split in SPLIT_NAMES:
        features = extract_split(loaded, task.split(split), label_ids, folder, split, progress=progress, **options)
        if features.labels.size == 0:
            raise TaskError(f"the {split} split of {task.name} has no word left to probe (all cut off or empty)")
        out[split] = features
    return out


__all__ = ["FEATURE_DTYPES", "POOLINGS", "SplitFeatures", "extract_all", "extract_split", "tokenised_words"]
