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

Speed: the forward stops once every site is stored (:func:`site_states`), so the MLM head, which a probe
never reads, does not run (about a third of a 6-block model's forward with an 8,192-word vocabulary), and
first-sub-word features are gathered rows (:func:`pool_words`). Both leave every feature bit for bit
what the whole forward and a pooling matmul give (tested for every supported family).
"""

from __future__ import annotations

import shutil
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
from gradflow.runs.feature_cache import cached, feature_key, finish_entry, model_digest, start_entry

POOLINGS: tuple[str, ...] = ("first", "mean")
FEATURE_DTYPES: tuple[str, ...] = ("float16", "float32")
FLOAT16_MAX = 65504.0
CACHED_SPLIT = "features"  # file prefix inside a feature-cache entry (one split each)


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


@dataclass(frozen=True)
class WordPooling:
    """How a batch's hidden states, flattened to (B * T, H), become word features: ``rows`` (n_words,) the
    flat row of each word's first sub-word, ``weights`` (n_words, B * T) the mean over its sub-words (None
    for ``first`` pooling), ``keys`` each word's (sentence, word). Words without positions are left out."""

    rows: torch.Tensor
    weights: torch.Tensor | None
    keys: list[tuple[int, int]]


def word_pooling(batch: list[_Item], width: int, pooling: str) -> WordPooling:
    """The :class:`WordPooling` of ``batch`` padded to ``width`` positions."""
    rows, spans, keys = [], [], []
    for b, item in enumerate(batch):
        for s, w, positions in item.words:
            if positions:
                rows.append(b * width + positions[0])
                spans.append([b * width + p for p in positions])
                keys.append((s, w))
    weights = None
    if pooling == "mean":
        weights = torch.zeros(len(keys), len(batch) * width)
        for i, flat in enumerate(spans):
            weights[i, flat] = 1.0 / len(flat)
    return WordPooling(torch.tensor(rows, dtype=torch.long), weights, keys)


def pool_words(hidden: torch.Tensor, pooling: WordPooling) -> torch.Tensor:
    """(B * T, H) hidden states -> (n_words, H) word features: the first sub-word's row, gathered (exactly
    what a 0/1 pooling matmul gives), or the mean over the sub-words."""
    if pooling.weights is None:
        return hidden.index_select(0, pooling.rows)
    return pooling.weights @ hidden


class _SitesStored(Exception):
    """Raised by the site hook once every site of the forward is stored: nothing after it is needed."""


def site_states(model: torch.nn.Module, sites: SiteLayer, inputs: dict[str, torch.Tensor],
                stop_early: bool = True) -> dict[str, torch.Tensor]:
    """Site name -> (B, T, H) hidden state of one forward of ``model`` on ``inputs``, without gradients.

    ``stop_early``: end the forward as soon as every site is stored, so the layers after the last site
    (an MLM head) do not run; the stored states are the same tensors either way."""
    store: dict[str, torch.Tensor] = {}

    def keep(site: str, hidden: torch.Tensor) -> None:
        store[site] = hidden.detach()
        if stop_early and len(store) == len(sites.names):
            raise _SitesStored

    with torch.no_grad(), sites.hooks(keep):
        try:
            model(**inputs)
        except _SitesStored:
            pass
    missing = [name for name in sites.names if name not in store]
    if missing:
        raise TaskError(f"the forward reported no hidden state at {', '.join(missing)}: the model's adapter "
                        "names modules this forward does not run")
    return store


def extract_split(loaded: LoadedModel, sentences: LabelledSentences, label_ids: dict[str, int], folder: Path,
                  split: str, *, regime: str = "unmasked", pooling: str = "first", max_length: int = 128,
                  batch_size: int = 32, mid: bool = False, dtype: str = "float16",
                  progress: Callable[[int], None] | None = None, cache: Path | None = None,
                  model_sha256: str | None = None) -> SplitFeatures:
    """Features of every word of ``sentences`` at every site, appended to raw files under ``folder``.

    ``cache``: a feature cache folder (:mod:`gradflow.runs.feature_cache`): the split is read from it when an
    entry with the same key exists, else extracted into it (``folder`` is then not used); ``model_sha256``:
    the model's :func:`~gradflow.runs.feature_cache.model_digest`, computed when not given."""
    if pooling not in POOLINGS:
        raise TaskError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")
    model, tokenizer = loaded.model, loaded.tokenizer
    sites = SiteLayer(model, loaded.adapter, mid=mid)
    items = list(_items(tokenizer, sentences, max_length, regime == "masked"))
    if cache is None:
        keys = _extract(loaded, sites, items, folder, split, pooling, batch_size, dtype, progress)
        return _split_features(sentences, label_ids, folder, split, sites.names, keys, dtype)
    settings = {"regime": regime, "pooling": pooling, "max_length": max_length, "batch_size": batch_size, "mid": mid,
                "dtype": dtype, "device": model_device(model).type, "sites": list(sites.names)}
    key = feature_key(model_sha256 or model_digest(model), [(item.ids, item.words) for item in items], settings)
    hit = cached(cache, key)
    if hit is not None:
        entry, keys = hit
        if progress is not None:
            progress(sum(len(item.words) for item in items))
    else:
        partial = start_entry(cache, key)
        try:
            keys = _extract(loaded, sites, items, partial, CACHED_SPLIT, pooling, batch_size, dtype, progress)
            entry = finish_entry(cache, key, partial, keys, list(sites.names))
        finally:
            shutil.rmtree(partial, ignore_errors=True)  # gone after the rename; left only by an error
    return _split_features(sentences, label_ids, entry, CACHED_SPLIT, sites.names, keys, dtype)


def _extract(loaded: LoadedModel, sites: SiteLayer, items: list[_Item], folder: Path, split: str, pooling: str,
             batch_size: int, dtype: str, progress: Callable[[int], None] | None) -> list[tuple[int, int]]:
    """Run the model over ``items`` and append each site's word features to ``folder/<split>.<site>.bin``;
    returns each feature row's (sentence, word)."""
    model, tokenizer = loaded.model, loaded.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    files = {site: open(folder / f"{split}.{site}.bin", "wb") for site in sites.names}
    keys: list[tuple[int, int]] = []
    device = model_device(model)
    try:
        for batch in batches(items, batch_size):
            width = max(len(item.ids) for item in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for b, item in enumerate(batch):
                ids[b, : len(item.ids)] = torch.tensor(item.ids)
                attention[b, : len(item.ids)] = 1
            extra = token_inputs(tokenizer, ids, attention)  # RoCBert's shape and pronunciation ids
            inputs = {"input_ids": ids, "attention_mask": attention, **extra}
            store = site_states(model, sites, {name: value.to(device) for name, value in inputs.items()})
            words = word_pooling(batch, width, pooling)
            for site in sites.names:
                hidden = store[site].float().cpu().reshape(len(batch) * width, -1)
                files[site].write(_as_dtype(pool_words(hidden, words), dtype, site).tobytes())
            keys.extend(words.keys)
            if progress is not None:
                progress(sum(len(item.words) for item in batch))
    finally:
        for handle in files.values():
            handle.close()
    return keys


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
    if options.get("cache") is not None and options.get("model_sha256") is None:
        options["model_sha256"] = model_digest(loaded.model)  # once for the three splits
    out = {}
    for split in SPLIT_NAMES:
        features = extract_split(loaded, task.split(split), label_ids, folder, split, progress=progress, **options)
        if features.labels.size == 0:
            raise TaskError(f"the {split} split of {task.name} has no word left to probe (all cut off or empty)")
        out[split] = features
    return out


__all__ = ["FEATURE_DTYPES", "POOLINGS", "SplitFeatures", "WordPooling", "extract_all", "extract_split", "pool_words",
           "site_states", "tokenised_words", "word_pooling"]
