"""The text field of a long ``.jsonl`` record, decoded as it streams in (memory independent of its length).

A record of :data:`~gradflow.inputs.streaming.LONG_LINE_BYTES` or more is not parsed whole:
:func:`record_text` scans the JSON of the line's decoded pieces and yields the string value of the
record's top-level ``"text"`` field in chunks whose concatenation is ``json.loads(line)["text"]``:

- string content is found with one regular expression (plain characters and complete escapes) and
  decoded by the json module's own string scanner, a segment at a time; a segment ends only between
  complete escapes and never between the two halves of an escaped surrogate pair (``\\ud83d\\ude00``),
  so an escape cut by a read boundary is completed from the next piece before it is decoded;
- every other value (strings, numbers, literals, nested arrays and objects, at any depth) is checked
  and skipped without being held; a record that ``json.loads`` refuses is refused (a
  :class:`~gradflow.errors.CorpusError` naming the line), and so is one with no string ``"text"``.

One difference from ``json.loads``: a record whose string ``"text"`` is followed by another
``"text"`` key is refused (``json.loads`` keeps the last one; the first has been streamed by then).
An error after the text has begun (e.g. a truncated record) is raised when the scan reaches it,
after windows of the record may have been made; the reader checks the rest of a record before it
reads the next line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from json.decoder import scanstring

from gradflow.errors import CorpusError

_WS = re.compile(r"[ \t\n\r]*")
_CONTENT = re.compile(r'[^"\\\x00-\x1f]*+(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*+)*+')
"""Plain string characters and complete escapes (stops at the closing quote, a bad or cut escape, a control)."""
_HIGH = re.compile(r"u[dD][89abAB][0-9a-fA-F]{2}")
"""The tail of an escaped high surrogate (after its backslash)."""
_SCALAR_CHARS = re.compile(r"[-+.0-9a-zA-Z]*")
_SCALAR = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|true|false|null|NaN|-?Infinity")
"""The numbers and literals ``json.loads`` accepts (NaN and Infinity included)."""
ESCAPE_CHARS = 6
"""The longest escape (``\\uXXXX``): the look-ahead a segment needs at the end of the text read so far."""


def _format_error(where: str, what: str) -> CorpusError:
    return CorpusError(f"{where}: not valid JSON ({what}). Each line of a .jsonl corpus must be an object "
                       "with a \"text\" field.")


def _no_text(where: str) -> CorpusError:
    return CorpusError(f"{where}: no string \"text\" field. Each line of a .jsonl corpus must be an object "
                       "with a \"text\" field.")


def _ends_in_high_surrogate(s: str, start: int, end: int) -> bool:
    """Whether ``s[start:end]`` (complete units) ends with an escaped high surrogate (its backslash not escaped)."""
    at = end - ESCAPE_CHARS
    if at < start or s[at] != "\\" or not _HIGH.fullmatch(s, at + 1, end):
        return False
    run = at
    while run > start and s[run - 1] == "\\":
        run -= 1
    return (at - run) % 2 == 0  # an even run of backslashes before it: this one starts an escape


class _Scanner:
    """A read position over text given in pieces; only the unread part of the last pieces is held."""

    def __init__(self, pieces: Iterable[str], where: str) -> None:
        self._pieces = iter(pieces)
        self.where = where
        self.s = ""
        self.pos = 0

    def more(self) -> bool:
        """Append the next non-empty piece to the unread text; False at the end."""
        for piece in self._pieces:
            if piece:
                self.s = self.s[self.pos:] + piece
                self.pos = 0
                return True
        return False

    def peek(self) -> str:
        """The next character that is not JSON whitespace (not consumed), or "" at the end."""
        while True:
            self.pos = _WS.match(self.s, self.pos).end()
            if self.pos < len(self.s):
                return self.s[self.pos]
            if not self.more():
                return ""

    def take(self, expected: str) -> str:
        """Consume the next non-whitespace character, which must be one of ``expected``."""
        char = self.peek()
        if not char or char not in expected:
            found = f"{char!r}" if char else "the end of the line"
            raise _format_error(self.where, f"expected one of {' '.join(expected)} but found {found}")
        self.pos += 1
        return char

    def string(self) -> Iterator[str]:
        """The decoded content of the string starting at the next character (a quote), in chunks."""
        self.take('"')
        while True:
            end = _CONTENT.match(self.s, self.pos).end()
            closed = end < len(self.s) and self.s[end] == '"'
            cut_short = end == len(self.s) or (self.s[end] == "\\" and len(self.s) - end < ESCAPE_CHARS)
            if not closed and not cut_short:
                what = "a control character" if self.s[end] != "\\" else f"bad escape {self.s[end:end + 6]!r}"
                raise _format_error(self.where, f"{what} in a string")
            if not closed and _ends_in_high_surrogate(self.s, self.pos, end):
                end -= ESCAPE_CHARS  # its low half may follow: decode the pair together
            if end > self.pos:
                yield scanstring(self.s[self.pos:end] + '"', 0, True)[0]
                self.pos = end
            if closed:
                self.pos += 1
                return
            if not self.more():
                what = f"bad escape {self.s[end:]!r}" if end < len(self.s) else "a string not closed"
                raise _format_error(self.where, f"{what} at the end of the line")

    def scalar(self) -> None:
        """Check and skip one number or literal (true, false, null, NaN, Infinity)."""
        self.peek()
        while (end := _SCALAR_CHARS.match(self.s, self.pos).end()) == len(self.s) and self.more():
            pass
        token = self.s[self.pos:end]
        if not _SCALAR.fullmatch(token):
            shown = repr(token[:20]) if token else repr(self.s[end:end + 1]) if end < len(self.s) else "the end"
            raise _format_error(self.where, f"expected a value but found {shown}")
        self.pos = end

    def key(self) -> str:
        """One object key and the colon after it."""
        if self.peek() != '"':
            self.take('"')
        name = "".join(self.string())
        self.take(":")
        return name

    def skip_value(self) -> None:
        """Check and skip one JSON value of any depth (nesting kept on a list, not the call stack)."""
        closers: list[str] = []
        while True:
            char = self.peek()
            if char in ("{", "["):
                self.pos += 1
                close = "}" if char == "{" else "]"
                if self.peek() != close:
                    closers.append(close)
                    if close == "}":
                        self.key()
                    continue
                self.pos += 1
            elif char == '"':
                for _ in self.string():
                    pass
            else:
                self.scalar()
            while closers:  # a value is complete: close containers, or move on to the next element
                if self.take("," + closers[-1]) == ",":
                    if closers[-1] == "}":
                        self.key()
                    break
                closers.pop()
            else:
                return


def record_text(pieces: Iterable[str], where: str) -> Iterator[str]:
    """The top-level ``"text"`` string of one JSON object given in pieces, decoded, in chunks.

    ``where`` names the record in errors (``"corpus.jsonl, line 7"``). The whole record is checked:
    the generator ends only after the closing brace and nothing but whitespace after it.
    """
    scan = _Scanner(pieces, where)
    if scan.peek() != "{":  # a value that is not an object (checked first, as json.loads does) has no text
        scan.skip_value()
        raise _no_text(where) if scan.peek() == "" else _format_error(where, "more after the end of the value")
    scan.pos += 1
    found = False
    if scan.peek() == "}":
        scan.pos += 1
    else:
        while True:
            name = scan.key()
            if name == "text" and found:
                raise CorpusError(f"{where}: two \"text\" fields in one record. A long .jsonl record is read as "
                                  "it streams in, so its \"text\" field must occur once.")
            if name == "text" and scan.peek() == '"':
                found = True
                yield from scan.string()
            else:
                scan.skip_value()
            if scan.take(",}") == "}":
                break
    if scan.peek() != "":
        raise _format_error(where, "more after the end of the object")
    if not found:
        raise _no_text(where)


__all__ = ["ESCAPE_CHARS", "record_text"]
