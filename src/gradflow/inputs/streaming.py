"""Long documents in bounded pieces: lines read in byte chunks, text tokenised piece by piece.

The corpus readers (:mod:`gradflow.inputs.corpus`) read files in chunks of :data:`READ_BYTES`,
split them on newlines themselves and decode UTF-8 incrementally, so a line of any length is never
held whole: a line of :data:`LONG_LINE_BYTES` or more comes out as a :class:`LongLine`, an iterator
of its text in pieces. Such a document is tokenised in pieces of about :data:`PIECE_CHARS`
characters and its windows come out as the text streams in, identical to tokenising it whole:

- a piece is cut only at a space that follows a non-space character (the start of a whitespace
  run), never inside a word, and the unfinished tail is carried into the next piece;
- every cut is checked before it is used: the word after the cut, tokenised on its own, must give
  the same tokens (ids, special-token flags, word ids shifted by the words before the cut) as in
  its context, and no token may straddle the cut. A cut that fails the check is not used (an
  earlier one is tried, else the piece grows), so normalisers that look across whitespace,
  SentencePiece's leading "▁" and byte-level BPE's "Ġ" are caught where they would differ;
- word ids continue across pieces (each piece's are offset by the words before it).

Tokenizers that cannot be streamed take the whole-document path (the text is joined, then
tokenised whole, as for a short line): slow (Python) tokenizers, left truncation, special tokens
that are not a fixed prefix and suffix, and any tokenizer that fails :func:`streamable`'s check on
a probe text cut at every space (e.g. a SentencePiece conversion whose normaliser prepends "▁" to
every piece). Text without spaces (e.g. Chinese) cannot be cut: its piece grows (doubling) until a
safe cut comes, up to the whole line.
"""

from __future__ import annotations

import codecs
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from gradflow.errors import CorpusError

READ_BYTES = 1 << 20
"""Bytes read from a file at a time."""
LONG_LINE_BYTES = 1 << 16
"""A line at least this long (bytes; a text at least this many characters) is streamed."""
PIECE_CHARS = 1 << 16
"""Characters tokenised at a time in a streamed document (cut at the last safe space after this)."""
CUT_TRIES = 4
"""Cuts tried (latest first) before a piece is left to grow."""
PROBE_TEXT = ("The  Congress\tof the United States, in 1787; naïve café's “quoted” text — 12,345.67 % "
              "don't STOP!! a-b_c (x) [MASK] <s> </s> x\u3000y 日本語 Ünïcödé \u00a0 ok   end. ")


def utf8_error(source: str, number: int, err: UnicodeDecodeError, start: int) -> CorpusError:
    """The CorpusError for bytes of line ``number`` that are not UTF-8 (``start``: byte offset in the line)."""
    return CorpusError(
        f"{source}, line {number}: bytes that are not valid UTF-8 ({err.reason} at byte {start}). "
        "gradflow reads UTF-8 text only: convert the file (e.g. `iconv -f latin1 -t utf-8`) or remove the line.")


def file_chunks(handle) -> Iterator[bytes]:
    """Chunks of at most :data:`READ_BYTES` from a binary file (``read1`` where it exists: no waiting on a pipe)."""
    read = getattr(handle, "read1", None) or handle.read
    while chunk := read(READ_BYTES):
        yield chunk


class _Bytes:
    """A byte stream over chunks with a read position (lines are cut from it without copying the rest)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self.buf = b""
        self.pos = 0

    def fill(self) -> bool:
        """Load the next non-empty chunk when the current one is used up; False at the end."""
        while self.pos >= len(self.buf):
            chunk = next(self._chunks, None)
            if chunk is None:
                return False
            self.buf, self.pos = bytes(chunk), 0
        return True

    def until_newline(self, room: int) -> tuple[bytes, bool]:
        """Up to ``room`` bytes of the current chunk, stopping after a newline; (bytes, newline seen)."""
        end = self.buf.find(b"\n", self.pos, self.pos + room)
        stop = min(len(self.buf), self.pos + room) if end < 0 else end + 1
        data, self.pos = self.buf[self.pos:stop], stop
        return data, end >= 0


class LongLine:
    """The text of one long line, as decoded pieces (trailing ``\\r``/``\\n`` removed); read once, in order."""

    def __init__(self, stream: _Bytes, head: list[bytes], ended: bool, source: str, number: int) -> None:
        self._stream, self._head, self._ended = stream, head, ended
        self.source, self.number = source, number
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._fed = 0
        self._pieces = self._read()

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def __next__(self) -> str:
        return next(self._pieces)

    def _decode(self, data: bytes, final: bool) -> str:
        pending = len(self._decoder.getstate()[0])
        try:
            text = self._decoder.decode(data, final)
        except UnicodeDecodeError as err:
            raise utf8_error(self.source, self.number, err, self._fed - pending + err.start) from None
        self._fed += len(data)
        return text

    def _raw(self) -> Iterator[bytes]:
        yield from self._head
        self._head = []
        while not self._ended and self._stream.fill():
            data, self._ended = self._stream.until_newline(READ_BYTES)
            yield data
        self._ended = True

    def _read(self) -> Iterator[str]:
        held = ""
        for data in self._raw():
            text = held + self._decode(data, False)
            out = text.rstrip("\r\n")
            held = text[len(out):]
            if out:
                yield out
        out = (held + self._decode(b"", True)).rstrip("\r\n")
        if out:
            yield out

    def drain(self) -> None:
        """Read the rest of the line (unread pieces are decoded, checked and dropped)."""
        for _ in self._pieces:
            pass


def read_lines(chunks: Iterable[bytes], source: str) -> Iterator[tuple[int, str | LongLine]]:
    """(1-based line number, line) of a byte stream; a line of :data:`LONG_LINE_BYTES` or more is a LongLine.

    A short line is decoded whole, with its newline, as a file's line iterator gives it. A LongLine
    must be read before the next line is asked for; what was not read of it is skipped then.
    """
    stream = _Bytes(chunks)
    number = 0
    while stream.fill():
        number += 1
        head: list[bytes] = []
        size, ended = 0, False
        while not ended and size < LONG_LINE_BYTES and stream.fill():
            data, ended = stream.until_newline(LONG_LINE_BYTES - size)
            head.append(data)
            size += len(data)
        if ended or size < LONG_LINE_BYTES:
            raw = b"".join(head)
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise utf8_error(source, number, err, err.start) from None
            continue
        line = LongLine(stream, head, False, source, number)
        yield number, line
        line.drain()


def text_pieces(text: str, size: int | None = None) -> Iterator[str]:
    """A string in slices of ``size`` (default :data:`PIECE_CHARS`) characters (an in-memory long text, streamed)."""
    step = size or PIECE_CHARS
    for start in range(0, len(text), step):
        yield text[start:start + step]


@dataclass
class Tokens:
    """Content tokens (no special tokens added): ids, special-token flags, word ids; offsets while cutting."""

    ids: list[int]
    special: list[bool]
    words: list[int | None]
    starts: list[int]
    ends: list[int]

    def shifted(self, stop: int, by: int) -> tuple[list[int], list[bool], list[int | None]]:
        """(ids, special, words) of the first ``stop`` tokens with word ids offset by ``by``."""
        words = [None if w is None else w + by for w in self.words[:stop]]
        return self.ids[:stop], self.special[:stop], words


def encode(tokenizer, text: str) -> Tokens:
    """Tokenise ``text`` without special tokens, with offsets (the piece call: no truncation, no warning)."""
    enc = tokenizer(text, add_special_tokens=False, return_special_tokens_mask=True, return_offsets_mapping=True,
                    verbose=False)
    offsets = enc["offset_mapping"]
    return Tokens(list(enc["input_ids"]), [bool(s) for s in enc["special_tokens_mask"]], list(enc.word_ids()),
                  [a for a, _ in offsets], [b for _, b in offsets])


def _cuts(text: str) -> Iterator[int]:
    """Positions of spaces that follow a non-space character, latest first."""
    i = text.rfind(" ")
    while i > 0:
        if not text[i - 1].isspace():
            yield i
        i = text.rfind(" ", 0, i)


def _checked_cut(tokenizer, text: str, full: Tokens, cut: int, after: int) -> int | None:
    """Tokens before ``cut`` if cutting ``text`` there is safe (checked on the word(s) up to ``after``), else None."""
    k = next((i for i, s in enumerate(full.starts) if s >= cut), None)
    if not k or full.words[k] is None or any(e > cut for e in full.ends[:k]):
        return None
    m = next((i for i in range(k, len(full.starts)) if full.starts[i] >= after), len(full.starts))
    probe = encode(tokenizer, text[cut:after])
    base = full.words[k]
    same = (full.ids[k:m] == probe.ids and full.special[k:m] == probe.special
            and [None if w is None else w - base for w in full.words[k:m]] == probe.words)
    before_ok = all(w is None or w < base for w in full.words[:k])
    return k if same and before_ok else None


def _commit(tokenizer, text: str) -> tuple[Tokens, int, int, int] | None:
    """(tokens of ``text``, tokens kept, cut, words kept) at the latest safe cut, or None."""
    cuts = _cuts(text)
    after = next(cuts, None)
    if after is None:
        return None
    full = encode(tokenizer, text)
    for _, cut in zip(range(CUT_TRIES), cuts):
        k = _checked_cut(tokenizer, text, full, cut, after)
        if k is not None:
            return full, k, cut, full.words[k]
    return None


def content_tokens(tokenizer, pieces: Iterable[str],
                   piece_chars: int | None = None) -> Iterator[tuple[list[int], list[bool], list[int | None]]]:
    """(ids, special flags, word ids) of a text given in pieces, as tokenising it whole gives them, in parts.

    ``piece_chars`` (default :data:`PIECE_CHARS`) is the size at which the text gathered is cut."""
    step = piece_chars or PIECE_CHARS
    parts: list[str] = []
    size, base, target = 0, 0, step
    slices = (piece[i:i + step] for piece in pieces for i in range(0, len(piece), step))
    for piece in slices:
        parts.append(piece)
        size += len(piece)
        if size < target:
            continue
        text = "".join(parts)
        done = _commit(tokenizer, text)
        if done is None:
            parts, target = [text], max(size + step, 2 * size)  # geometric: no quadratic re-reading
            continue
        full, k, cut, words = done
        yield full.shifted(k, base)
        base += words
        parts = [text[cut:]]
        size = len(parts[0])
        target = size + step
    text = "".join(parts)
    if text:
        tail = encode(tokenizer, text)
        yield tail.shifted(len(tail.ids), base)


@dataclass(frozen=True)
class Template:
    """The special tokens around every window: ids and special flags before and after the content."""

    prefix: tuple[int, ...]
    prefix_special: tuple[bool, ...]
    suffix: tuple[int, ...]
    suffix_special: tuple[bool, ...]


def special_template(tokenizer) -> Template | None:
    """The fixed special tokens the tokenizer adds around one sequence, or None if they are not a prefix+suffix."""
    text = "the nation"
    bare = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    enc = tokenizer(text, add_special_tokens=True, return_special_tokens_mask=True, verbose=False)
    ids, mask = list(enc["input_ids"]), [bool(s) for s in enc["special_tokens_mask"]]
    n = len(bare)
    starts = [k for k in range(len(ids) - n + 1) if ids[k:k + n] == list(bare)]
    if len(starts) != 1 or len(ids) - n != tokenizer.num_special_tokens_to_add(pair=False):
        return None
    k = starts[0]
    return Template(tuple(ids[:k]), tuple(mask[:k]), tuple(ids[k + n:]), tuple(mask[k + n:]))


def piece_windows(tokenizer, template: Template, pieces: Iterable[str], max_length: int) -> Iterator[dict]:
    """Encodings of at most ``max_length`` tokens of a text given in pieces (as ``document_windows`` makes them).

    Windows that would hold special tokens only are left out, as the whole-document path leaves them out.
    """
    size = max_length - len(template.prefix) - len(template.suffix)
    ids: list[int] = []
    special: list[bool] = []
    words: list[int | None] = []

    def window(a: int, b: int) -> dict | None:
        flags = [*template.prefix_special, *special[a:b], *template.suffix_special]
        if all(flags):
            return None
        return {"input_ids": [*template.prefix, *ids[a:b], *template.suffix], "special_tokens_mask": flags,
                "word_ids": [None] * len(template.prefix) + words[a:b] + [None] * len(template.suffix)}

    for part_ids, part_special, part_words in content_tokens(tokenizer, pieces):
        ids += part_ids
        special += part_special
        words += part_words
        at = 0
        while len(ids) - at > size:
            if (out := window(at, at + size)) is not None:
                yield out
            at += size
        del ids[:at], special[:at], words[:at]
    if ids and (out := window(0, len(ids))) is not None:
        yield out


_STREAMABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_streaming(tokenizer) -> Template | None:
    if not getattr(tokenizer, "is_fast", False) or getattr(tokenizer, "truncation_side", "right") != "right":
        return None
    template = special_template(tokenizer)
    if template is None:
        return None
    text = PROBE_TEXT * 4
    whole = encode(tokenizer, text)
    got: tuple[list, list, list] = ([], [], [])
    parts = 0
    for part in content_tokens(tokenizer, text_pieces(text, 17), 17):
        parts += 1
        for into, values in zip(got, part):
            into += values
    cut_often = parts >= len(text) // 17 // 4  # a tokenizer whose cuts all fail would grow one piece
    return template if cut_often and got == (whole.ids, whole.special, whole.words) else None


def streamable(tokenizer) -> Template | None:
    """The tokenizer's window template if its long documents can be tokenised in pieces, else None.

    Checked once per tokenizer: fast, right truncation, a fixed special-token prefix and suffix, and
    the same tokens as the whole text for :data:`PROBE_TEXT` cut into 17-character pieces, most cuts
    accepted (a tokenizer whose every cut fails would tokenise a long line whole, a piece at a time).
    """
    try:
        if tokenizer in _STREAMABLE:
            return _STREAMABLE[tokenizer]
    except TypeError:
        return _check_streaming(tokenizer)
    _STREAMABLE[tokenizer] = result = _check_streaming(tokenizer)
    return result


__all__ = ["CUT_TRIES", "LONG_LINE_BYTES", "PIECE_CHARS", "PROBE_TEXT", "READ_BYTES", "LongLine", "Template",
           "Tokens", "content_tokens", "encode", "file_chunks", "piece_windows", "read_lines", "special_template",
           "streamable", "text_pieces", "utf8_error"]
