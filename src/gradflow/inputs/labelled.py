"""Word-labelled sentences for probes: CoNLL-style and jsonl files, checked line by line.

Formats (UTF-8):

- **CoNLL-style** (any suffix but ``.jsonl``): one ``word<TAB>label`` per line, a blank line between
  sentences; lines starting with ``# `` are comments. More than two columns: the first is the word,
  the last the label.
- **jsonl**: one sentence per line, ``{"tokens": [...], "labels": [...]}`` (``tags`` is accepted for
  ``labels``, as in the task files the project fetches), one label per word.

A malformed line raises :class:`~gradflow.errors.TaskError` naming the file and its line number.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gradflow.errors import TaskError

SPLIT_NAMES: tuple[str, ...] = ("train", "validation", "test")
"""The three splits of a probe task: fit, choose the regularisation, score."""
BUILTIN_PROBE_TASKS: dict[str, str] = {
    "brown-pos": "Brown corpus, 12 universal POS tags per word",
    "brown-propn": "Brown corpus, proper-noun BIO tags per word (O, B-PROPN, I-PROPN)",
}
"""Probe tasks built from the built-in task data (``gradflow tasks fetch``)."""


@dataclass(frozen=True)
class LabelledSentences:
    """Sentences of words with one label per word. ``words[i]`` and ``labels[i]`` have equal length."""

    words: tuple[tuple[str, ...], ...]
    labels: tuple[tuple[str, ...], ...]

    def __len__(self) -> int:
        return len(self.words)

    @property
    def num_words(self) -> int:
        return sum(len(w) for w in self.words)

    def head(self, limit: int | None) -> "LabelledSentences":
        """The first ``limit`` sentences (all when ``limit`` is None)."""
        return self if limit is None else LabelledSentences(self.words[:limit], self.labels[:limit])


@dataclass(frozen=True)
class LabelledSplits:
    """A probe task: its name, train / validation / test sentences and the label set (sorted, or the task's order)."""

    name: str
    train: LabelledSentences
    validation: LabelledSentences
    test: LabelledSentences
    labels: tuple[str, ...]
    source: str

    def split(self, name: str) -> LabelledSentences:
        return {"train": self.train, "validation": self.validation, "test": self.test}[name]


def read_conll(path: str | Path) -> LabelledSentences:
    """``word<TAB>label`` lines, blank lines between sentences (see the module docstring)."""
    path = Path(path)
    words: list[tuple[str, ...]] = []
    labels: list[tuple[str, ...]] = []
    current_w: list[str] = []
    current_l: list[str] = []
    for number, line in enumerate(_lines(path), start=1):
        text = line.rstrip("\n").rstrip("\r")
        if not text.strip():
            if current_w:
                words.append(tuple(current_w))
                labels.append(tuple(current_l))
                current_w, current_l = [], []
            continue
        if text.startswith("# "):
            continue
        columns = text.split("\t")
        if len(columns) < 2 or not columns[0].strip() or not columns[-1].strip():
            raise TaskError(f"{path}:{number}: expected 'word<TAB>label', got {text[:80]!r} "
                            "(separate the columns with one tab; a blank line ends a sentence)")
        current_w.append(columns[0].strip())
        current_l.append(columns[-1].strip())
    if current_w:
        words.append(tuple(current_w))
        labels.append(tuple(current_l))
    return LabelledSentences(tuple(words), tuple(labels))


def read_jsonl(path: str | Path) -> LabelledSentences:
    """One ``{"tokens": [...], "labels": [...]}`` object per line (``tags`` accepted for ``labels``)."""
    path = Path(path)
    words: list[tuple[str, ...]] = []
    labels: list[tuple[str, ...]] = []
    for number, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise TaskError(f"{path}:{number}: not a JSON object ({err.msg})") from None
        tokens = row.get("tokens") if isinstance(row, dict) else None
        tags = (row.get("labels", row.get("tags")) if isinstance(row, dict) else None)
        if not isinstance(tokens, list) or not isinstance(tags, list):
            raise TaskError(f"{path}:{number}: expected an object with a 'tokens' list and a 'labels' list")
        if len(tokens) != len(tags):
            raise TaskError(f"{path}:{number}: {len(tags)} labels for {len(tokens)} tokens (one label per word)")
        if tokens:
            words.append(tuple(str(t) for t in tokens))
            labels.append(tuple(str(t) for t in tags))
    return LabelledSentences(tuple(words), tuple(labels))


def read_labelled(path: str | Path) -> LabelledSentences:
    """A labelled file in either format (``.jsonl`` by suffix, else CoNLL-style)."""
    path = Path(path)
    return read_jsonl(path) if path.suffix == ".jsonl" else read_conll(path)


def split_sentences(sentences: LabelledSentences, seed: int,
                    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)) -> tuple[LabelledSentences, ...]:
    """Train / validation / test by a seeded permutation of whole sentences (no sentence is split)."""
    order = np.random.default_rng(seed).permutation(len(sentences))
    n_train = round(fractions[0] * len(order))
    n_val = round(fractions[1] * len(order))
    parts = (order[:n_train], order[n_train:n_train + n_val], order[n_train + n_val:])
    return tuple(LabelledSentences(tuple(sentences.words[i] for i in sorted(p)),
                                   tuple(sentences.labels[i] for i in sorted(p))) for p in parts)


def load_labelled(path: str | Path, seed: int = 0, name: str | None = None,
                  label_order: tuple[str, ...] | None = None) -> LabelledSplits:
    """A probe task from a directory with ``train``, ``validation`` and ``test`` files (``.jsonl``,
    ``.conll``, ``.tsv`` or ``.txt``) or from one file split 80/10/10 by sentence with ``seed``.

    Raises :class:`TaskError` on a malformed line, an empty split or fewer than 2 labels.
    """
    path = Path(path)
    if path.is_dir():
        splits = tuple(read_labelled(_split_file(path, split)) for split in SPLIT_NAMES)
        source = f"{path.name}/ (train, validation, test files)"
    elif path.is_file():
        splits = split_sentences(read_labelled(path), seed)
        source = f"{path.name} (split 80/10/10 by sentence, seed {seed})"
    else:
        raise TaskError(f"no labelled data at {path}: give a file of 'word<TAB>label' lines, a .jsonl file with "
                        "'tokens' and 'labels', or a directory with train, validation and test files")
    for split, sentences in zip(SPLIT_NAMES, splits):
        if len(sentences) == 0:
            raise TaskError(f"{path}: the {split} split has no sentences (a single file needs at least 10 sentences)")
    seen = sorted({label for part in splits for sentence in part.labels for label in sentence})
    labels = label_order if label_order is not None else tuple(seen)
    unknown = sorted(set(seen) - set(labels))
    if unknown:
        raise TaskError(f"{path}: labels {', '.join(unknown[:5])} are not in the task's label set {', '.join(labels)}")
    if len(labels) < 2:
        raise TaskError(f"{path}: a probe needs at least 2 distinct labels, found {len(labels)}")
    return LabelledSplits(name or path.stem, *splits, labels=labels, source=source)


def _split_file(folder: Path, split: str) -> Path:
    """The one file of ``split`` in ``folder`` (``split.jsonl``, ``.conll``, ``.tsv`` or ``.txt``)."""
    found = [folder / f"{split}{suffix}" for suffix in (".jsonl", ".conll", ".tsv", ".txt")
             if (folder / f"{split}{suffix}").is_file()]
    if len(found) != 1:
        raise TaskError(f"{folder}: expected exactly one {split} file ({split}.jsonl, .conll, .tsv or .txt), "
                        f"found {len(found)}")
    return found[0]


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise TaskError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise TaskError(f"cannot read {path}: {err.strerror}") from None


__all__ = ["BUILTIN_PROBE_TASKS", "SPLIT_NAMES", "LabelledSentences", "LabelledSplits", "load_labelled", "read_conll", "read_jsonl",
           "read_labelled", "split_sentences"]
