"""Document-level split into train / valid / test by a hash of the document id.

``u = int(sha256("corpus-large:" + id)[:8], 16) / 2**32``; ``u < 0.01`` -> valid, ``u < 0.02`` ->
test, else train (98 / 1 / 1 % of documents in expectation). A document's split depends on its id
alone, never on the order or the other documents. The small corpus's held-out documents (SOTU and
Brown names in ``data/corpus/split.json`` under "valid", i.e. ``fetch_corpus.is_validation``) are
forced into test, so no text the small models were validated on is trained on here.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

from analyses.corpus.fetch_corpus import is_validation

VALID_FRACTION = 0.01
TEST_FRACTION = 0.01
SPLITS = ("train", "valid", "test")


def unit_hash(doc_id: str) -> float:
    """A number in [0, 1) determined by the document id alone."""
    return int(hashlib.sha256(f"corpus-large:{doc_id}".encode()).hexdigest()[:8], 16) / 2**32


def legacy_held_out(doc_id: str, split_json: Path | None = None) -> bool:
    """Whether a SOTU/Brown document was held out (validation) in the small corpus.

    Uses ``split_json`` (the small corpus's ``split.json``) when given and present, else the small
    corpus's own rule ``fetch_corpus.is_validation`` (which is what wrote that file).
    """
    if not (doc_id.startswith("sotu/") or doc_id.startswith("brown/")):
        return False
    if split_json is not None and split_json.exists():
        return doc_id in _held_out_names(split_json)
    return is_validation(doc_id)


@lru_cache(maxsize=4)
def _held_out_names(split_json: Path) -> frozenset[str]:
    """The "valid" names of a small-corpus ``split.json``."""
    return frozenset(json.loads(split_json.read_text())["valid"])


def assign_split(doc_id: str, split_json: Path | None = None) -> str:
    """"train", "valid" or "test" for one document (see module doc)."""
    if legacy_held_out(doc_id, split_json):
        return "test"
    u = unit_hash(doc_id)
    if u < VALID_FRACTION:
        return "valid"
    if u < VALID_FRACTION + TEST_FRACTION:
        return "test"
    return "train"
