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
  :class:`~gradflow.errors.CorpusError` naming the line), and so is one with no string ``"text"``
  (:func:`no_text_field`: when the record's string fields look like a prompt/response pair, the error names the
  ``--prompt-field``/``--response-field`` flags that record it as one).

One difference from ``json.loads``: a record whose string ``"text"`` is followed by another
``"text"`` key is refused (``json.loads`` keeps the last one; the first has been streamed by then).
An error after the text has begun (e.g. a truncated record) is raised when the scan reaches it,
after windows of the record may have been made; the reader checks the rest of a record before it
reads the next line.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Iterator, Sequence
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


PROMPT_NAMES = ("prompt", "instruction", "question", "query", "input", "source")
"""Field names of prompt/response corpora that hold the prompt (the error of a record without ``"text"`` says so)."""
RESPONSE_NAMES = ("response", "output", "answer", "completion", "target", "chosen")
"""Field names of prompt/response corpora that hold the response."""
SHOWN_FIELDS = 6
"""The most string fields the error names."""


def prompt_response_pair(string_fields: Sequence[str]) -> tuple[str, str] | None:
    """(prompt field, response field) of a record whose string fields look like a prompt/response pair, or None.

    The first of :data:`PROMPT_NAMES` and of :data:`RESPONSE_NAMES` the record has (any case); failing that, a
    record of exactly two string fields is a pair: the one named like a prompt or a response takes that part, else
    the first is the prompt.
    """
    lower = {name.lower(): name for name in reversed(string_fields)}  # the first spelling of each name wins
    prompt = next((lower[n] for n in PROMPT_NAMES if n in lower), None)
    response = next((lower[n] for n in RESPONSE_NAMES if n in lower), None)
    if prompt is not None and response is not None:
        return prompt, response
    if len(string_fields) != 2:
        return None
    first, second = string_fields
    return (second, first) if response == first or prompt == second else (first, second)


def no_text_field(where: str, string_fields: Sequence[str] = ()) -> CorpusError:
    """The error of a ``.jsonl`` record (``where``: file and line) with no string ``"text"`` field.

    ``string_fields``: the record's top-level fields with string values, in order. When they look like a
    prompt/response pair (:func:`prompt_response_pair`) the error says so and names the flags that record the file
    as a prompt/response corpus; otherwise it names the string fields there are.
    """
    head = f"{where}: no string \"text\" field"
    plain = "a plain .jsonl corpus reads each line's text from a string \"text\" field"
    quoted = ", ".join(f'"{name}"' for name in string_fields[:SHOWN_FIELDS])
    if len(string_fields) > SHOWN_FIELDS:
        quoted += f" and {len(string_fields) - SHOWN_FIELDS} more"
    pair = prompt_response_pair(string_fields)
    if pair is not None:
        prompt, response = (shlex.quote(name) for name in pair)
        return CorpusError(f"{head}; its string fields are {quoted}: if it is a prompt/response corpus for "
                           f"supervised fine-tuning, record it with --prompt-field {prompt} --response-field "
                           f"{response} (gradflow record; the prompt is never masked), else {plain}.")
    if len(string_fields) > 1:
        return CorpusError(f"{head}; its string fields are {quoted}: {plain}, and a prompt/response corpus is "
                           "recorded with --prompt-field NAME --response-field NAME (gradflow record).")
    if string_fields:
        return CorpusError(f"{head}; its only string field is {quoted}: {plain} (rename the field).")
    return CorpusError(f"{head}. Each line of a .jsonl corpus must be an object with a \"text\" field.")


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
        raise no_text_field(where) if scan.peek() == "" else _format_error(where, "more after the end of the value")
    scan.pos += 1
    found = False
    strings: list[str] = []  # the other top-level fields with string values, for the error without "text"
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
                if scan.peek() == '"' and name not in strings:
                    strings.append(name)
                scan.skip_value()
            if scan.take(",}") == "}":
                break
    if scan.peek() != "":
        raise _format_error(where, "more after the end of the object")
    if not found:
        raise no_text_field(where, strings)


__all__ = ["ESCAPE_CHARS", "PROMPT_NAMES", "RESPONSE_NAMES", "no_text_field", "prompt_response_pair", "record_text"]
