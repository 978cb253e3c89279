"""Raw package text -> one normalised line of prose per document.

Each reader in ``extract`` hands over raw text with a format tag; :func:`clean` strips that format's
markup and boilerplate, joins hard-wrapped lines into paragraphs, drops paragraphs that are not
prose (code, tables, rules of punctuation) and returns the paragraphs joined by single spaces.
"""

from __future__ import annotations

import html
import re
import unicodedata
from html.parser import HTMLParser

MIN_TOKENS = 200  # documents shorter than this (whitespace tokens) are dropped

_GUTENBERG_START = re.compile(r"\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG[^*\n]*(?:\*{3})?", re.I)
_GUTENBERG_END = re.compile(r"\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG|End of (?:the |this )?Project Gutenberg",
                            re.I)
# a short credit or licence line of its own (a whole book on one line is never cut by this)
_PRODUCED_BY = re.compile(r"^[ \t]*(?:Produced by|This eBook is for the use of)[^\n]{0,300}$", re.I | re.M)
_BLANK_SPLIT = re.compile(r"\n\s*\n")


def normalise(text: str) -> str:
    """NFC, every run of whitespace one space, no leading or trailing space."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def strip_gutenberg(text: str) -> str:
    """Cut a Project Gutenberg header (up to the START line), footer and licence (from the END line)."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[:end.start()]
    return _PRODUCED_BY.sub("", text)


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks with their hard line wraps joined (a hyphen at a line end is kept)."""
    return [normalise(block) for block in _BLANK_SPLIT.split(text) if block.strip()]


def is_prose(paragraph: str) -> bool:
    """A paragraph of words: at least 60% of its tokens contain a letter and few look like code."""
    tokens = paragraph.split()
    if not tokens:
        return False
    wordy = sum(1 for t in tokens if any(c.isalpha() for c in t))
    codey = sum(1 for t in tokens if any(c in "{}<>=;$@|\\" for c in t))
    return wordy / len(tokens) >= 0.6 and codey / len(tokens) <= 0.1


def join_prose(blocks: list[str]) -> str:
    """The prose paragraphs of ``blocks`` as one normalised line."""
    return normalise(" ".join(b for b in blocks if is_prose(b)))


class _TextExtractor(HTMLParser):
    """Visible text of an HTML page, one block per block-level element; skips code, tables, navigation."""

    SKIP_TAGS = {"script", "style", "pre", "table", "head", "nav", "form", "button"}
    SKIP_CLASSES = {"sphinxsidebar", "related", "footer", "navheader", "navfooter", "toc", "highlight",
                    "sphx-glr-footer", "headerlink", "clearer", "navigation", "literallayout", "programlisting",
                    "screen", "synopsis", "cmdsynopsis", "funcsynopsis", "mobile-nav"}
    BLOCK_TAGS = {"p", "div", "li", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6", "section", "blockquote",
                  "br", "ul", "ol", "dl", "tr", "title"}
    VOID_TAGS = {"br", "img", "hr", "meta", "link", "input", "area", "base", "col", "source", "wbr"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self.current: list[str] = []
        self.stack: list[bool] = []  # per open element: does it start a skipped region
        self.skip_depth = 0

    def _flush(self) -> None:
        if self.current:
            self.blocks.append("".join(self.current))
            self.current = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.BLOCK_TAGS:
            self._flush()
        if tag in self.VOID_TAGS:
            return
        classes = set((dict(attrs).get("class") or "").split())
        skip = tag in self.SKIP_TAGS or bool(classes & self.SKIP_CLASSES) or dict(attrs).get("role") == "navigation"
        self.stack.append(skip)
        self.skip_depth += skip

    def handle_endtag(self, tag: str) -> None:
        if tag in self.VOID_TAGS or not self.stack:
            return
        self.skip_depth -= self.stack.pop()
        if tag in self.BLOCK_TAGS:
            self._flush()

    def handle_data(self, data: str) -> None:
        if self.skip_depth == 0:
            self.current.append(data)


def html_blocks(page: str) -> list[str]:
    """Normalised text blocks of an HTML page (see :class:`_TextExtractor`)."""
    parser = _TextExtractor()
    parser.feed(page)
    parser.close()
    parser._flush()
    return [normalise(b) for b in parser.blocks if b.strip()]


_POD_CODE = re.compile(r"[A-Z]<<+\s(.*?)\s>>+|[A-Z]<([^<>]*)>", re.S)
_POD_ESCAPES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}


def _pod_inline(text: str) -> str:
    """Formatting codes (``C<x>``, ``L<text|link>``, ``E<lt>``, ``C<< x >>``) -> their text."""
    def repl(m: re.Match[str]) -> str:
        inner = m.group(1) if m.group(1) is not None else m.group(2)
        code = m.group(0)[0]
        if code == "E":
            return _POD_ESCAPES.get(inner, "")
        if code in "XZ":
            return ""
        if code == "L":
            return inner.split("|")[0] if "|" in inner else inner.split("/")[-1].strip('"')
        return inner
    for _ in range(4):  # nested codes
        text = _POD_CODE.sub(repl, text)
    return text


def pod_blocks(pod: str) -> list[str]:
    """Ordinary paragraphs and headings of a POD file; verbatim (indented) paragraphs are code and dropped."""
    out = []
    for block in _BLANK_SPLIT.split(pod):
        if not block.strip() or block[:1] in " \t":
            continue
        if block.startswith("="):
            command, _, rest = block.partition(" ")
            if command in ("=head1", "=head2", "=head3", "=head4", "=item"):
                out.append(normalise(_pod_inline(rest)))
            continue
        out.append(normalise(_pod_inline(block)))
    return [b for b in out if b]


_OSIS_TAG = re.compile(r"<[^>]+>")


def osis_blocks(text: str) -> list[str]:
    """Text of an OSIS/ThML fragment (SWORD modules): paragraphs at ``x-p``/``p`` divisions, tags removed."""
    text = re.sub(r'<div [^>]*type="x-p"[^>]*/>|</?p>|<lb[^>]*/>|<title[^>]*>', "\n\n", text)
    text = html.unescape(_OSIS_TAG.sub(" ", text))
    return paragraphs(text)


_DICT_SOURCE_LINE = re.compile(r"^\s*\[[^\]\n]{0,60}\]\s*$", re.M)  # "[1913 Webster]", "[PJC]" alone on a line
_DICT_PRONUNCIATION = re.compile(r"\\[^\\\n]{1,80}\\")  # GCIDE "\A*buse"\"
_DICT_BRACES = re.compile(r"[{}]")


def dict_entry_blocks(entry: str) -> list[str]:
    """A dictd entry: source tags, pronunciation keys and cross-reference braces removed; lines joined."""
    entry = _DICT_SOURCE_LINE.sub("", entry)
    entry = _DICT_PRONUNCIATION.sub("", entry)
    entry = _DICT_BRACES.sub("", entry)
    return paragraphs(entry)


def clean(raw: str, fmt: str) -> str:
    """One normalised line of prose from raw text in format ``fmt``."""
    if fmt == "plain":
        return join_prose(paragraphs(raw))
    if fmt == "gutenberg":
        return join_prose(paragraphs(strip_gutenberg(raw)))
    if fmt == "html":
        return join_prose(html_blocks(raw))
    if fmt == "pod":
        return join_prose(pod_blocks(raw))
    if fmt == "osis":
        return join_prose(osis_blocks(raw))
    if fmt == "dict":
        return join_prose(dict_entry_blocks(raw))
    if fmt == "keep":  # already clean text (SOTU, de-tagged Brown): only normalised, never filtered
        return normalise(raw)
    raise ValueError(f"unknown format {fmt!r}")


def long_enough(text: str, min_tokens: int = MIN_TOKENS) -> bool:
    """Whether a cleaned document has at least ``min_tokens`` whitespace tokens."""
    return len(text.split()) >= min_tokens
