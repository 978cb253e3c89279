"""Tokenizer, tokenised windows (cached), and a deterministic, checkpointable token stream.

The batch of step ``s`` (0-based) is a pure function of ``(seed, s)``: windows are visited in a
fresh permutation per epoch (``numpy`` PCG64 seeded with ``(seed, epoch)``), and the BERT
corruption of step ``s`` draws from a generator seeded with ``(seed, s)``. The data position a
checkpoint stores is therefore just the next step; resuming anywhere gives the same batches.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import BertTokenizerFast

from analyses.pretraining.pretrain import train_tokenizer, window_rows
from gradflow.models.zoo import sha256 as file_sha256

SELECT_P = 0.15  # BERT: 15% of the non-special tokens are selected ...
MASK_P, RANDOM_P = 0.8, 0.1  # ... of which 80% -> [MASK], 10% -> a random token, 10% kept
CORRUPT_STREAM, PERMUTE_STREAM, VALID_STREAM = 1, 2, 3  # separate seed-sequence branches


def get_tokenizer(corpus: Path, out: Path, vocab_size: int) -> BertTokenizerFast:
    """Train (once, on ``corpus/train.txt``) or reload the lower-cased WordPiece tokenizer in ``out``."""
    return train_tokenizer(corpus, out, vocab_size)


def encode_windows(tokenizer: BertTokenizerFast, path: Path, length: int, chunk: int = 2048) -> np.ndarray:
    """Documents (one per line) -> (N, length) int32 windows: [CLS] up to length-2 pieces [SEP], 0-padded.

    The same windows as ``pretrain.windows`` (pieces shorter than min(16, (length-2)//2) dropped),
    tokenised in batches.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    rows: list[list[int]] = []
    for start in range(0, len(lines), chunk):
        for ids in tokenizer(lines[start : start + chunk], add_special_tokens=False)["input_ids"]:
            rows += window_rows(tokenizer, ids, length)
    if not rows:
        raise ValueError(f"{path} gave no windows of {length} tokens")
    return np.asarray(rows, dtype=np.int32)


def load_windows(tokenizer: BertTokenizerFast, path: Path, length: int, cache_dir: Path) -> np.ndarray:
    """``encode_windows`` cached as ``.npy`` under ``cache_dir``, keyed by the text's and tokenizer's hashes."""
    tok_file = Path(tokenizer.name_or_path) / "tokenizer.json"
    tok_hash = file_sha256(tok_file) if tok_file.exists() else str(len(tokenizer))
    key = hashlib.sha256(f"{file_sha256(path)}:{tok_hash}:{length}".encode()).hexdigest()[:16]
    cache = cache_dir / f"windows-{path.stem}-{length}-{key}.npy"
    if cache.exists():
        return np.load(cache, allow_pickle=False)
    windows = encode_windows(tokenizer, path, length)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}.npy")
    np.save(tmp, windows, allow_pickle=False)
    os.replace(tmp, cache)
    return windows


@dataclass
class SpecialIds:
    """Token ids the corruption needs; ``vocab`` is the number of ids random replacements draw from."""

    cls: int
    sep: int
    pad: int
    mask: int
    vocab: int

    @classmethod
    def of(cls, tokenizer: BertTokenizerFast) -> SpecialIds:
        return cls(tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id,
                   tokenizer.mask_token_id, len(tokenizer))


@dataclass
class Batch:
    """One step's tensors (CPU). B windows of T tokens; C loss rows (fixed per run).

    input_ids, attention_mask: (B, T) int64; rows: (C,) int64 flat indices into B*T, -1 = unused
    row; targets: (C,) int64 original token ids, -100 at unused rows.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    rows: torch.Tensor
    targets: torch.Tensor

    def to(self, device: str | torch.device) -> Batch:
        return Batch(*(t.to(device, non_blocking=True) for t in
                       (self.input_ids, self.attention_mask, self.rows, self.targets)))

    def tokens(self) -> int:
        """Non-padding tokens in the batch."""
        return int(self.attention_mask.sum())


def corrupt(ids: np.ndarray, special: SpecialIds, rng: np.random.Generator,
            alltoken: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """BERT 15% / 80-10-10 corruption of (B, T) ids.

    Returns (inputs, labels, selected): labels hold the original id at the loss positions (the
    selected ones, or every non-special one for ``alltoken``) and -100 elsewhere.
    """
    is_special = (ids == special.cls) | (ids == special.sep) | (ids == special.pad)
    selected = (rng.random(ids.shape) < SELECT_P) & ~is_special
    action = rng.random(ids.shape)
    replacement = rng.integers(0, special.vocab, size=ids.shape)
    inputs = ids.astype(np.int64)
    inputs[selected & (action < MASK_P)] = special.mask
    random_pos = selected & (action >= MASK_P) & (action < MASK_P + RANDOM_P)
    inputs[random_pos] = replacement[random_pos]
    loss_at = ~is_special if alltoken else selected
    labels = np.where(loss_at, ids, -100).astype(np.int64)
    return inputs, labels, selected


def make_batch(ids: np.ndarray, inputs: np.ndarray, labels: np.ndarray, pad: int, capacity: int) -> Batch:
    """Gather the loss positions into ``capacity`` rows (padded with -1 or cut): fixed shapes per step."""
    flat = np.flatnonzero(labels.reshape(-1) != -100)[:capacity]
    rows = np.full(capacity, -1, dtype=np.int64)
    rows[: flat.size] = flat
    targets = np.full(capacity, -100, dtype=np.int64)
    targets[: flat.size] = labels.reshape(-1)[flat]
    return Batch(torch.from_numpy(inputs), torch.from_numpy((ids != pad).astype(np.int64)),
                 torch.from_numpy(rows), torch.from_numpy(targets))


class TokenStream:
    """Training batches as a pure function of (seed, step): no hidden state besides a cache.

    ``windows``: (N, T) token ids. Step ``s`` (0-based) takes the windows at positions
    ``s*B .. s*B+B-1`` of the concatenated per-epoch permutations.
    """

    def __init__(self, windows: np.ndarray, batch_size: int, seed: int, special: SpecialIds,
                 alltoken: bool, capacity: int) -> None:
        self.windows = windows
        self.batch_size = batch_size
        self.seed = seed
        self.special = special
        self.alltoken = alltoken
        self.capacity = capacity
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, PERMUTE_STREAM, epoch])
            self._perm = rng.permutation(len(self.windows))
            self._perm_epoch = epoch
        return self._perm

    def indices(self, step: int) -> np.ndarray:
        """(B,) window indices of 0-based ``step``."""
        n = len(self.windows)
        flat = np.arange(step * self.batch_size, (step + 1) * self.batch_size, dtype=np.int64)
        out = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(flat // n):
            here = flat // n == epoch
            out[here] = self._permutation(int(epoch))[flat[here] % n]
        return out

    def batch(self, step: int) -> Batch:
        """The corrupted batch of 0-based ``step`` (CPU tensors)."""
        ids = self.windows[self.indices(step)].astype(np.int64)
        rng = np.random.default_rng([self.seed, CORRUPT_STREAM, step])
        inputs, labels, _ = corrupt(ids, self.special, rng, self.alltoken)
        return make_batch(ids, inputs, labels, self.special.pad, self.capacity)

    def position(self, next_step: int) -> dict[str, int]:
        """The checkpointable data position before 0-based ``next_step`` (the rest is informative)."""
        consumed = next_step * self.batch_size
        return {"next_step": next_step, "windows_consumed": consumed, "epoch": consumed // len(self.windows),
                "train_windows": len(self.windows), "seed": self.seed}


def validation_batches(windows: np.ndarray, n_windows: int, seed: int, special: SpecialIds,
                       batch_size: int = 128) -> list[Batch]:
    """A fixed subset of ``n_windows`` validation windows with a fixed BERT masking (15% selected).

    Loss rows are every selected position (no capacity cut), so top-1 is over all of them.
    """
    rng = np.random.default_rng([seed, VALID_STREAM])
    chosen = np.sort(rng.permutation(len(windows))[:n_windows])
    out = []
    for start in range(0, len(chosen), batch_size):
        ids = windows[chosen[start : start + batch_size]].astype(np.int64)
        inputs, _, selected = corrupt(ids, special, rng, alltoken=False)
        labels = np.where(selected, ids, -100).astype(np.int64)
        out.append(make_batch(ids, inputs, labels, special.pad, int(selected.sum())))
    return out
