"""Corpus readers, windowing and sharding.

``--texts`` may be a UTF-8 text file (one document per line; blank lines are skipped), a ``.jsonl``
file with a ``text`` field per line, a directory of ``.txt`` files (each read like a text file, in
sorted order), or ``-`` for standard input. Documents longer than the model's window are split
into consecutive windows, never dropped. Every window gets a corpus-wide ``sequence_index`` in
reading order *before* sharding, so masking (seeded by that index) is the same for any number of
processes.

Memory does not grow with a document's length: files are read in chunks and a line of
:data:`~gradflow.inputs.streaming.LONG_LINE_BYTES` or more (or a text of that many characters) is
tokenised in pieces, its windows identical to tokenising it whole (see
:mod:`gradflow.inputs.streaming`, which also names the tokenizers that take the whole-document path).
A long ``.jsonl`` record is not parsed whole either: its ``text`` field is decoded as it streams in
(:mod:`gradflow.inputs.jsonl_text`) and tokenised in pieces.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, count
from pathlib import Path
from typing import TypeVar

from gradflow.errors import CorpusError
from gradflow.inputs import streaming
from gradflow.inputs.jsonl_text import no_text_field, record_text
from gradflow.inputs.prompted import PromptFields, prompted_encoding, prompted_records
from gradflow.inputs.streaming import LongLine, file_chunks, piece_windows, read_lines, streamable, text_pieces

T = TypeVar("T")


@dataclass(frozen=True)
class Document:
    """One document: its text and where it came from (file and 1-based line).

    A line too long to hold (:class:`~gradflow.inputs.streaming.LongLine`) has ``text`` empty and its
    text in ``pieces``, to be read once, in order, before the next document is asked for.
    """

    index: int
    text: str
    source: str
    line: int
    pieces: Iterable[str] | None = field(default=None, compare=False, repr=False)
    prompt: str | None = None  # a prompt/response corpus (:mod:`gradflow.inputs.prompted`): ``text`` is the response

    @property
    def streamed(self) -> bool:
        """Whether the text is tokenised in pieces: a long line, or a text of LONG_LINE_BYTES characters or more."""
        return self.pieces is not None or len(self.text) >= streaming.LONG_LINE_BYTES

    def chunks(self) -> Iterable[str]:
        """The text in order: ``pieces`` for a long line, else ``text`` in slices."""
        return self.pieces if self.pieces is not None else text_pieces(self.text)


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
    truncated_responses: int = 0  # prompt/response corpora: responses cut to fit the window


def _nonblank(pieces: Iterable[str]) -> Iterable[str] | None:
    """The pieces of a long text, or None when it is whitespace only (read up to its first other character)."""
    pieces = iter(pieces)
    seen: list[str] = []
    for piece in pieces:
        seen.append(piece)
        if not piece.isspace():
            return chain(seen, pieces)
    return None


def _text_documents(lines: Iterable[tuple[int, str | LongLine]], source: str,
                    jsonl: bool) -> Iterator[tuple[str, str, int, Iterable[str] | None]]:
    for number, line in lines:
        if isinstance(line, LongLine):
            text = record_text(line, f"{source}, line {number}") if jsonl else line
            pieces = _nonblank(text)
            if pieces is not None:
                yield "", source, number, pieces
                if jsonl:
                    for _ in text:  # the rest of the record is checked before the next line is read
                        pass
            continue
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        if jsonl:
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as err:  # JSONDecodeError; also an int of over 4300 digits
                raise CorpusError(f"{source}, line {number}: not valid JSON ({getattr(err, 'msg', err)}). Each "
                                  "line of a .jsonl corpus must be an object with a \"text\" field.") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                strings = [k for k, v in record.items() if isinstance(v, str)] if isinstance(record, dict) else []
                raise no_text_field(f"{source}, line {number}", strings)
            text = record["text"]
            if not text.strip():
                continue
            yield text, source, number, None
        else:
            yield line, source, number, None


def default_texts() -> str:
    """Path of the committed public-domain SOTU sample shipped with the package (the default corpus)."""
    from importlib import resources

    return str(resources.files("gradflow") / "data" / "sotu_sample.txt")


def open_corpus(texts: str | Path | Sequence[str] | None,
                prompted: PromptFields | None = None) -> tuple[Iterator[Document], str]:
    """(documents, source name) of a corpus path, a list of strings (blank ones skipped) or None (the default).

    The source name is the path as given, or ``<N texts>`` for a list (for meta.json). ``prompted``: the
    path is a prompt/response ``.jsonl`` corpus with these fields (:mod:`gradflow.inputs.prompted`).
    """
    if texts is None:
        texts = default_texts()
    if isinstance(texts, (str, Path)):
        return read_documents(texts, prompted), str(texts)
    if prompted is not None:
        raise CorpusError("a prompt/response corpus is a .jsonl file: pass its path, not a list of texts.")
    docs = (Document(i, t, "<texts>", i + 1) for i, t in enumerate(texts) if t.strip())
    return docs, f"<{len(texts)} texts>"


def check_corpus_path(path: str | Path) -> None:
    """Raise CorpusError if ``path`` is neither ``-`` nor an existing file or directory."""
    if str(path) != "-" and not Path(path).exists():
        raise CorpusError(f"corpus {path} does not exist. Pass --texts with a UTF-8 text file (one document "
                          "per line), a .jsonl file with a \"text\" field, a directory of .txt files, or - "
                          "for standard input.")


def read_documents(path: str | Path, prompted: PromptFields | None = None) -> Iterator[Document]:
    """Stream the documents of a corpus (see module docstring for the accepted forms).

    Files are read in chunks; a line of ``LONG_LINE_BYTES`` or more comes as a document with
    ``pieces`` (see :class:`Document`), read as it is tokenised. ``prompted``: a prompt/response
    ``.jsonl`` file, each line a document whose ``prompt`` is set.
    """
    spec = str(path)
    if prompted is not None:
        return _prompted_documents(spec, prompted)
    return _documents(spec)


def _prompted_documents(spec: str, prompted: PromptFields) -> Iterator[Document]:
    if spec == "-" or Path(spec).suffix != ".jsonl" or not Path(spec).is_file():
        raise CorpusError(f"--prompt-field needs a .jsonl file of prompt/response records, got {spec}.")
    with open(spec, "rb") as handle:
        records = prompted_records(read_lines(file_chunks(handle), spec), spec, prompted)
        for index, (prompt, response, line) in enumerate(records):
            yield Document(index, response, spec, line, prompt=prompt)


def _documents(spec: str) -> Iterator[Document]:
    if spec == "-":
        sources: list[tuple[str, object, bool]] = [("<stdin>", sys.stdin.buffer, False)]
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
            lines = read_lines(file_chunks(handle or stream), source)
            for text, src, line, pieces in _text_documents(lines, source, jsonl):
                yield Document(index, text, src, line, pieces)
                index += 1
        finally:
            if handle is not None:
                handle.close()


def document_windows(tokenizer, document: Document, max_length: int) -> list[dict]:
    """Split one document into encodings of at most ``max_length`` tokens, special tokens included.

    Uses the fast tokenizer's overflow windows (no overlap), so every token lands in exactly one
    window. Each encoding has ``input_ids``, ``special_tokens_mask`` and ``word_ids``.
    """
    if document.prompt is not None:
        return [prompted_encoding(tokenizer, document.prompt, document.text, max_length,
                                  f"{document.source}, line {document.line}")]
    n_special = tokenizer.num_special_tokens_to_add(pair=False)
    if max_length - n_special < 1:
        raise CorpusError(f"max_length={max_length} leaves no room for tokens next to {n_special} special tokens")
    if not getattr(tokenizer, "is_fast", False):
        return slow_document_windows(tokenizer, document, max_length - n_special)
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


def slow_document_windows(tokenizer, document: Document, body: int) -> list[dict]:
    """:func:`document_windows` for a tokenizer without a fast (Rust) version (TAPAS, RoCBert): the
    document's pieces cut into consecutive runs of ``body`` tokens, each wrapped in the tokenizer's own
    special tokens, as the fast tokenizers' overflow windows are. ``word_ids`` are None (slow tokenizers
    do not give them), so word-level features are unavailable for these models."""
    ids = tokenizer(document.text, add_special_tokens=False, verbose=False)["input_ids"]
    out = []
    for start in range(0, len(ids), body):
        piece = ids[start : start + body]
        window = tokenizer.build_inputs_with_special_tokens(piece)
        # the template's own tokens only (an [UNK] in the text is a token, as in the fast tokenizers' mask)
        special = [bool(s) for s in tokenizer.get_special_tokens_mask(piece)]
        out.append({"input_ids": list(window), "special_tokens_mask": special, "word_ids": [None] * len(window)})
    return out


def long_document_windows(tokenizer, document: Document, max_length: int) -> Iterator[dict]:
    """The encodings :func:`document_windows` gives, made as the text streams in (bounded memory).

    For a tokenizer that cannot be streamed (:func:`gradflow.inputs.streaming.streamable`) the text
    is joined and tokenised whole.
    """
    if document.prompt is not None:
        return [prompted_encoding(tokenizer, document.prompt, document.text, max_length,
                                  f"{document.source}, line {document.line}")]
    n_special = tokenizer.num_special_tokens_to_add(pair=False)
    if max_length - n_special < 1:
        raise CorpusError(f"max_length={max_length} leaves no room for tokens next to {n_special} special tokens")
    template = streamable(tokenizer)
    if template is None:
        whole = Document(document.index, "".join(document.chunks()), document.source, document.line)
        return iter(document_windows(tokenizer, whole, max_length))
    return piece_windows(tokenizer, template, document.chunks(), max_length)


def iter_windows(tokenizer, documents: Iterable[Document], max_length: int, counts: CorpusCounts,
                 limit: int | None = None) -> Iterator[Window]:
    """Windows of every document in order, numbered corpus-wide; stops after ``limit`` windows.

    A long document (:attr:`Document.streamed`) is tokenised in pieces: to count it, its first two
    windows are made before the first is given; nothing past what ``limit`` needs is read.
    """
    sequence_index = 0
    for doc in documents:
        counts.documents += 1
        if doc.streamed:
            encodings = long_document_windows(tokenizer, doc, max_length)
        else:
            encodings = iter(document_windows(tokenizer, doc, max_length))
        first = next(encodings, None)
        if first is None:
            counts.skipped_empty_documents += 1
            continue
        second = next(encodings, None)
        if second is not None:
            counts.split_documents += 1
        ahead = [first] if second is None else [first, second]
        for w in count():
            if limit is not None and sequence_index >= limit:
                return  # checked before the next window is made: nothing past the limit is tokenised
            encoding = ahead.pop(0) if ahead else next(encodings, None)
            if encoding is None:
                break
            counts.windows += 1
            counts.truncated_responses += bool(encoding.pop("truncated", False))
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
