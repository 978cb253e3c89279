"""Encoding task rows for a tokenizer, batching, and class weights.

Token tasks label the **first sub-word** of every word and give the other sub-words (and special
tokens) the label -100, which the loss ignores. Words cut off by ``max_length`` (or that a
tokenizer maps to no sub-word at all) get no prediction; scoring gives them the task's fallback
label (``O`` when the task has it) and counts them as ``dropped_words``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from gradflow.inputs.tasks import Task, TaskError

IGNORE = -100
CLASS_WEIGHT_SCHEMES = ("balanced",)


@dataclass
class Encoded:
    """One encoded example. ``labels``: per position (token task) or one id (sequence task);
    ``words``: for token tasks, the word index of each labelled position, in order."""

    input_ids: list[int]
    labels: list[int] | int
    num_words: int = 0
    words: tuple[int, ...] = ()


def encode(task: Task, tokenizer, rows: list[dict], max_length: int) -> list[Encoded]:
    """Encode rows of ``task`` (token or sequence) with ``tokenizer``."""
    if task.kind == "token":
        return encode_tokens(tokenizer, rows, task.label2id, max_length)
    return encode_texts(tokenizer, rows, task.label2id, max_length)


def encode_tokens(tokenizer, rows: list[dict], label2id: dict[str, int], max_length: int) -> list[Encoded]:
    """Pre-split words -> sub-words; the first sub-word of each word carries the word's label."""
    if not getattr(tokenizer, "is_fast", False):
        raise TaskError(f"token tasks need a fast tokenizer (for word_ids); {type(tokenizer).__name__} is not")
    if not rows:
        return []
    enc = tokenizer([r["tokens"] for r in rows], is_split_into_words=True, truncation=True, max_length=max_length)
    out = []
    for i, row in enumerate(rows):
        word_ids = enc.word_ids(i)
        labels, words = [], []
        for w in word_ids:
            if w is None or w in words:
                labels.append(IGNORE)
            else:
                words.append(w)
                labels.append(label2id[row["tags"][w]])
        out.append(Encoded(list(enc["input_ids"][i]), labels, len(row["tokens"]), tuple(words)))
    return out


def encode_texts(tokenizer, rows: list[dict], label2id: dict[str, int], max_length: int) -> list[Encoded]:
    """Texts -> token ids with special tokens; one label per example."""
    if not rows:
        return []
    enc = tokenizer([r["text"] for r in rows], truncation=True, max_length=max_length)
    return [Encoded(list(ids), label2id[row["label"]]) for ids, row in zip(enc["input_ids"], rows)]


def collate(examples: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of examples into ``input_ids``, ``attention_mask`` and ``labels`` tensors."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    token_level = isinstance(examples[0].labels, list)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long) if token_level else \
        torch.tensor([e.labels for e in examples], dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        mask[i, :n] = 1
        if token_level:
            labels[i, :n] = torch.tensor(e.labels)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def train_batches(n: int, batch_size: int, seed: int) -> Iterator[np.ndarray]:
    """Endless shuffled index batches: one seeded permutation per epoch, no partial batches."""
    if n == 0:
        raise TaskError("the training split is empty")
    rng = np.random.default_rng(seed)
    size = min(batch_size, n)
    while True:
        order = rng.permutation(n)
        for start in range(0, n - size + 1, size):
            yield order[start : start + size]


def eval_batches(examples: list[Encoded], batch_size: int) -> Iterator[list[int]]:
    """Index batches in order of length (little padding); callers restore the original order."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].input_ids))
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


def label_counts(examples: list[Encoded], num_labels: int) -> torch.Tensor:
    """How often each label is a training target (first sub-words, or examples)."""
    counts = torch.zeros(num_labels, dtype=torch.long)
    for e in examples:
        ids = [y for y in e.labels if y != IGNORE] if isinstance(e.labels, list) else [e.labels]
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=num_labels)
    return counts


def class_weights(spec: str | tuple[float, ...] | list[float] | None, counts: torch.Tensor) -> torch.Tensor | None:
    """Loss weights per label: ``None`` (unweighted), ``"balanced"`` (``n / (K * count_k)``; labels
    absent from training get 1) or explicit values, one per label."""
    if spec is None:
        return None
    k = counts.numel()
    if isinstance(spec, str):
        if spec not in CLASS_WEIGHT_SCHEMES:
            raise TaskError(f"unknown class-weight scheme {spec!r}; use {', '.join(CLASS_WEIGHT_SCHEMES)} "
                            "or one number per label")
        total = counts.sum().clamp_min(1).double()
        weights = torch.where(counts > 0, total / (k * counts.clamp_min(1).double()), torch.ones(k, dtype=torch.double))
        return weights.float()
    values = torch.tensor([float(v) for v in spec], dtype=torch.float32)
    if values.numel() != k or bool((values < 0).any()):
        raise TaskError(f"class weights need {k} non-negative numbers (one per label), got {list(spec)}")
    return values
