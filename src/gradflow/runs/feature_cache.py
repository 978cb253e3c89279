"""An on-disk cache of probe word features, so runs that share sentences extract them once.

A probe sweep (training sizes x probe families x tasks) re-reads the same validation and test sentences
in every run. With ``gradflow probe --feature-cache DIR`` a split's features are written once under
``DIR/<key>/`` and read back as memmaps by every later run with the same key. The key is the SHA-256 of
everything the features depend on: the model's weights (:func:`model_digest`), the model's input rows
(token ids and each word's positions: the tokenizer's work, so another tokenizer gives another key), the
regime, pooling, ``max_length``, batch size, ``mid``, feature dtype, device type, torch version and thread
count (float32 sums can round differently at another thread count). A cached split is therefore
bit for bit what this run would extract on the same host.

An entry is complete once ``DIR/<key>/complete.json`` exists: it is written into a temporary folder and
renamed into place, so a run killed mid-split leaves no entry, and two runs extracting the same split at
once both finish (the second keeps the first's). Deleting ``DIR`` is always safe.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

COMPLETE = "complete.json"
KEYS_FILE = "keys.npy"


def model_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the model's state dict: every tensor's name, dtype, shape and bytes, in key order."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def feature_key(model_sha256: str, rows: list[tuple[list[int], list]], settings: dict) -> str:
    """The cache key of one split: ``rows`` are its input rows (token ids, per word (sentence, word,
    positions)), ``settings`` the extraction options (JSON-serialisable)."""
    environment = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    digest = hashlib.sha256(json.dumps({"model": model_sha256, "settings": settings, "environment": environment},
                                       sort_keys=True).encode())
    for ids, words in rows:
        digest.update(json.dumps([ids, words]).encode())
    return digest.hexdigest()


def cached(cache: Path, key: str) -> tuple[Path, list[tuple[int, int]]] | None:
    """(folder, each feature row's (sentence, word)) of a complete entry, or None."""
    folder = cache / key
    if not (folder / COMPLETE).is_file():
        return None
    keys = np.load(folder / KEYS_FILE)
    return folder, [(int(s), int(w)) for s, w in keys]


def start_entry(cache: Path, key: str) -> Path:
    """A fresh temporary folder (inside ``cache``) to extract one split into."""
    cache.mkdir(parents=True, exist_ok=True)
    folder = cache / f".partial-{key}-{os.getpid()}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    return folder


def finish_entry(cache: Path, key: str, partial: Path, keys: list[tuple[int, int]], sites: list[str]) -> Path:
    """Mark ``partial`` complete and move it to ``cache/key`` (keeping an entry another run finished first);
    returns the entry's folder."""
    np.save(partial / KEYS_FILE, np.asarray(keys, dtype=np.int64).reshape(-1, 2))
    (partial / COMPLETE).write_text(json.dumps({"words": len(keys), "sites": sites}) + "\n", encoding="utf-8")
    final = cache / key
    try:
        partial.rename(final)
    except OSError:  # another run completed the same entry meanwhile: identical bytes, keep it
        shutil.rmtree(partial, ignore_errors=True)
        if not (final / COMPLETE).is_file():
            raise
    return final


__all__ = ["cached", "feature_key", "finish_entry", "model_digest", "start_entry"]
