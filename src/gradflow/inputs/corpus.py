"""Corpus readers, windowing and sharding.

``--texts`` may be a UTF-8 text file (one document per line; blank lines are skipped), a ``.jsonl``
file with a ``text`` field per line, a directory of ``.txt`` files (each read like a text file, in
sorted order), or ``-`` for standard input. Documents longer than the model's window are split
into consecutive windows, never dropped. Every window gets a corpus-wide ``sequence_index`` in
reading order *before* sharding, so masking (seeded by that index) is the same for any number of
processes.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from gradflow.errors import CorpusError

T = TypeVar("T")


@dataclass(frozen=True)
class Document:
    """One document: its text and where it came from (file and 1-based line)."""

    index: int
    text: str
    source: str
    line: int


@dataclass(frozen=True)
class Window:
    """One model input: a slice of a document's tokens with the special tokens added.

    ``encoding`` holds ``input_ids``, ``special_tokens_mask`` and ``word_ids`` (lists of length T).
    """

    sequence_index: int
    document_index: int
    window_index: int
    encoding: dict


@dataclass
class CorpusCounts:
    """Running counts for meta.json."""

    documents: int = 0
    windows: int = 0
    split_documents: int = 0
    skipped_empty_documents: int = 0
    skipped_no_maskable: int = 0


def _lines(stream: io.BufferedReader | Iterable[bytes], source: str) -> Iterator[tuple[int, str]]:
    for number, raw in enumerate(stream, start=1):
        try:
            yield number, raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise CorpusError(
                f"{source}, line {number}: bytes that are not valid UTF-8 ({err.reason} at byte {err.start}). "
                "gradflow reads UTF-8 text only: convert the file (e.g. `iconv -f latin1 -t utf-8`) or "
                "remove the line."
            ) from None


def _text_documents(lines: Iterable[tuple[int, str]], source: str, jsonl: bool) -> Iterator[tuple[str, str, int]]:
    for number, line in lines:
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        if jsonl:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise CorpusError(f"{source}, line {number}: not valid JSON ({err.msg}). Each line of a .jsonl "
                                  "corpus must be an object with a \"text\" field.") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise CorpusError(f"{source}, line {number}: no string \"text\" field. Each line of a .jsonl "
                                  "corpus must be an object with a \"text\" field.")
            text = record["text"]
            if not text.strip():
                continue
            yield text, source, number
        else:
            yield line, source, number


def default_texts() -> str:
    """Path of the committed public-domain SOTU sample shipped with the package (the default corpus)."""
    from importlib import resources

    return str(resources.files("gradflow") / "data" / "sotu_sample.txt")


def open_corpus(texts: str | Path | Sequence[str] | None) -> tuple[Iterator[Document], str]:
    """(documents, source name) of a corpus path, a list of strings (blank ones skipped) or None (the default).

    The source name is the path as given, or ``<N texts>`` for a list (for meta.json).
    """
    if texts is None:
        texts = default_texts()
    if isinstance(texts, (str, Path)):
        return read_documents(texts), str(texts)
    docs = (Document(i, t, "<texts>", i + 1) for i, t in enumerate(texts) if t.strip())
    return docs, f"<{len(texts)} texts>"


def check_corpus_path(path: str | Path) -> None:
    """Raise CorpusError if ``path`` is neither ``-`` nor an existing file or directory."""
    if str(path) != "-" and not Path(path).exists():
        raise CorpusError(f"corpus {path} does not exist. Pass --texts with a UTF-8 text file (one document "
                          "per line), a .jsonl file with a \"text\" field, a directory of .txt files, or - "
                          "for standard input.")


def read_documents(path: str | Path) -> Iterator[Document]:
    """Stream the documents of a corpus (see module docstring for the accepted forms)."""
    spec = str(path)
    if spec == "-":
        sources: list[tuple[str, Iterable[bytes], bool]] = [("<stdin>", sys.stdin.buffer, False)]
    else:
        check_corpus_path(spec)
        p = Path(spec)
        if p.is_dir():
            files = sorted(f for f in p.rglob("*.txt") if f.is_file())
            if not files:
                raise CorpusError(f"corpus directory {spec} contains no .txt files.")
            sources = [(str(f), None, False) for f in files]
        else:
            sources = [(str(p), None, p.suffix == ".jsonl")]
    index = 0
    for source, stream, jsonl in sources:
        handle = open(source, "rb") if stream is None else None
        try:
            for text, src, line in _text_documents(_lines(handle or stream, source), source, jsonl):
                yield Document(index, text, src, line)
                index += 1
        finally:
            if handle is not None:
                handle.close()


def document_windows(tokenizer, document: Document, max_length: int) -> list[dict]:
    """Split one document into encodings of at most ``max_length`` tokens, special tokens included.

    Uses the fast tokenizer's overflow windows (no overlap), so every token lands in exactly one
    window. Each encoding has ``input_ids``, ``special_tokens_mask`` and ``word_ids``.
    """
    n_special = tokenizer.num_special_tokens_to_add(pair=False)
    if max_length - n_special < 1:
        raise CorpusError(f"max_length={max_length} leaves no room for tokens next to {n_special} special tokens")
    enc = tokenizer(document.text, add_special_tokens=True, truncation=True, max_length=max_length,
                    return_overflowing_tokens=True, stride=0, return_special_tokens_mask=True)
    out = []
    for i, ids in enumerate(enc["input_ids"]):
        special = [bool(s) for s in enc["special_tokens_mask"][i]]
        if all(special):
            continue
        try:
            words = enc.word_ids(i)
        except (ValueError, AttributeError):
            words = [None] * len(ids)
        out.append({"input_ids": list(ids), "special_tokens_mask": special, "word_ids": list(words)})
    return out


def iter_windows(tokenizer, documents: Iterable[Document], max_length: int, counts: CorpusCounts,
                 limit: int | None = None) -> Iterator[Window]:
    """Windows of every document in order, numbered corpus-wide; stops after ``limit`` windows."""
    sequence_index = 0
    for doc in documents:
        counts.documents += 1
        encodings = document_windows(tokenizer, doc, max_length)
        if not encodings:
            counts.skipped_empty_documents += 1
            continue
        if len(encodings) > 1:
            counts.split_documents += 1
        for w, encoding in enumerate(encodings):
            if limit is not None and sequence_index >= limit:
                return
            counts.windows += 1
            yield Window(sequence_index, doc.index, w, encoding)
            sequence_index += 1


def shard(windows: Iterable[Window], rank: int, world_size: int) -> Iterator[Window]:
    """The windows of one process: ``sequence_index % world_size == rank``."""
    for window in windows:
        if window.sequence_index % world_size == rank:
            yield window


def batches(windows: Iterable[T], batch_size: int) -> Iterator[list[T]]:
    """Consecutive groups of ``batch_size`` items (windows, or any other; the last may be shorter)."""
    batch: list[T] = []
    for window in windows:
        batch.append(window)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch
