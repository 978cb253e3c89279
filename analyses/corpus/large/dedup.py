"""Exact and near-duplicate removal, document by document.

Exact: two documents whose normalised text has the same SHA-256 are one; the first in source order
is kept. Near: every document gets a bottom-k MinHash sketch (k = 128) of its word 5-gram shingles;
two documents whose estimated Jaccard similarity is at least 0.5 are two editions of one work, and
only the one from the earlier source in ``sources.SOURCES`` is kept (ties: more tokens, then the
smaller id). Documents of protected sources (SOTU and Brown) are never dropped.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass

SHINGLE = 5
SKETCH = 128
NEAR_JACCARD = 0.5


@dataclass
class Doc:
    """A cleaned document and where it came from."""

    doc_id: str
    source: str
    kind: str
    text: str
    rank: int  # position of its source in SOURCES: lower wins near-duplicate ties

    @property
    def tokens(self) -> int:
        """Whitespace tokens."""
        return len(self.text.split())

    @property
    def sha256(self) -> str:
        """SHA-256 of the normalised text (UTF-8)."""
        return text_sha256(self.text)


def text_sha256(text: str) -> str:
    """SHA-256 hex digest of a normalised text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sketch(text: str, k: int = SKETCH, n: int = SHINGLE) -> list[int]:
    """The ``k`` smallest 64-bit hashes of the text's lower-cased word ``n``-grams, sorted."""
    words = text.lower().split()
    hashes = {int.from_bytes(hashlib.blake2b(" ".join(words[i:i + n]).encode(), digest_size=8).digest(), "big")
              for i in range(max(1, len(words) - n + 1))}
    return sorted(hashes)[:k]


def jaccard_estimate(a: list[int], b: list[int], k: int = SKETCH) -> float:
    """Bottom-k estimate of the Jaccard similarity of two shingle sets from their sketches."""
    union = sorted(set(a) | set(b))[:k]
    if not union:
        return 0.0
    both = set(a) & set(b)
    return sum(1 for h in union if h in both) / len(union)


def _preference(doc: Doc) -> tuple[int, int, str]:
    return (doc.rank, -doc.tokens, doc.doc_id)


def drop_exact(docs: list[Doc]) -> tuple[list[Doc], list[tuple[str, str]]]:
    """Keep the first document of each normalised-text hash; return (kept, [(dropped id, kept id)])."""
    kept: list[Doc] = []
    first: dict[str, str] = {}
    dropped = []
    for doc in sorted(docs, key=_preference):
        digest = doc.sha256
        if digest in first:
            dropped.append((doc.doc_id, first[digest]))
        else:
            first[digest] = doc.doc_id
            kept.append(doc)
    return kept, dropped


def drop_near(docs: list[Doc], protected: set[str], threshold: float = NEAR_JACCARD,
              k: int = SKETCH) -> tuple[list[Doc], list[tuple[str, str, float]]]:
    """Drop near-duplicate editions (see module doc); return (kept, [(dropped id, kept id, estimate)])."""
    ordered = sorted(docs, key=_preference)
    sketches = {d.doc_id: sketch(d.text, k) for d in ordered}
    postings: dict[int, list[int]] = defaultdict(list)
    for i, doc in enumerate(ordered):
        for h in sketches[doc.doc_id]:
            postings[h].append(i)
    alive = [True] * len(ordered)
    dropped = []
    for i, doc in enumerate(ordered):
        if not alive[i]:
            continue
        shared: dict[int, int] = defaultdict(int)
        for h in sketches[doc.doc_id]:
            for j in postings[h]:
                if j > i:
                    shared[j] += 1
        for j, count in sorted(shared.items()):
            other = ordered[j]
            if not alive[j] or other.source in protected or count < k * threshold / 2:
                continue
            estimate = jaccard_estimate(sketches[doc.doc_id], sketches[other.doc_id], k)
            if estimate >= threshold:
                alive[j] = False
                dropped.append((other.doc_id, doc.doc_id, round(estimate, 3)))
    return [d for d, keep in zip(ordered, alive) if keep], dropped
