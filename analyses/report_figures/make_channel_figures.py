"""Figures and tables of the channel view and the representation diagnostics (issue: channel view).

One command (after ``python -m analyses.pretraining.ship``)::

    python -m analyses.report_figures.make_channel_figures [--limit 96]

Writes, under ``figures/``:
- ``channel_view.{pdf,png,csv}`` and ``channel_view_attribution.*``: gradflow-mini-en on one
  sentence of the held-out sample (seeded BERT masking, seed 0);
- ``diagnostics/<model>/``: logit lens, input shift, anisotropy and last-block transformation
  tables (CSV), figures and meta.json, for gradflow-mini-en and gradflow-mini-en-alltoken on the
  committed held-out SOTU sample, and for the zoo models (``zoo-antiberty``, ``zoo-rxnfp``) on
  their shipped example inputs when they are fetched (``gradflow zoo fetch NAME``); the mini-en
  figures are also copied to ``figures/*.png`` for the tutorial (docs/guides/channel-view.md);
- ``diagnostics/summary.csv``: every model's tables side by side.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pandas as pd

from gradflow.figures.diagnostics import plot_diagnostics
from gradflow.models import load_model
from gradflow.runs.channels import write_channel_view
from gradflow.runs.diagnose import diagnose_corpus

ROOT = Path(__file__).resolve().parents[2]
SENTENCE = ("The progress of public credit is witnessed by a considerable rise of American stock abroad "
            "as well as at home.")
MODELS = ("gradflow-mini-en", "gradflow-mini-en-alltoken")


def channel_figures(out: Path) -> None:
    loaded = load_model("gradflow-mini-en")
    for quantity, stem in (("grad_norm", "channel_view"), ("attribution", "channel_view_attribution")):
        tmp = out / f".{stem}"
        paths = write_channel_view(loaded, SENTENCE, tmp, quantity=quantity)
        for path in paths:
            shutil.move(str(path), out / f"{stem}{path.suffix}")
        shutil.rmtree(tmp, ignore_errors=True)


def plan() -> list[tuple[str, str, str | None, int]]:
    """(label, model spec, texts (None: the committed sample), max length) of every diagnosed model."""
    from importlib import resources

    from gradflow.models import zoo

    runs = [(name, name, None, 128) for name in MODELS]
    for name in ("antiberty", "rxnfp"):
        if zoo.zoo_path(name) is not None:
            runs.append((f"zoo-{name}", f"zoo:{name}", str(resources.files("gradflow") / "zoo_inputs" / f"{name}.txt"),
                         256))
    return runs


def diagnostics(out: Path, limit: int | None) -> pd.DataFrame:
    rows = []
    for name, spec, texts, max_length in plan():
        target = out / "diagnostics" / name
        tables = diagnose_corpus(load_model(spec), texts, target, max_length=max_length, limit=limit,
                                 command=f"python -m analyses.report_figures.make_channel_figures --limit {limit}")
        plot_diagnostics(tables, target, ("pdf", "png"))
        for table_name, table in tables.items():
            t = table.copy()
            t.insert(0, "table", table_name)
            t.insert(0, "model", name)
            rows.append(t)
        if name == "gradflow-mini-en":
            for png in target.glob("*.png"):
                shutil.copy(png, out / png.name)
    summary = pd.concat(rows, ignore_index=True)
    summary.to_csv(out / "diagnostics" / "summary.csv", index=False, float_format="%.6g")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "figures")
    parser.add_argument("--limit", type=int, default=96, help="windows of the sample per model")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    channel_figures(args.out)
    diagnostics(args.out, args.limit)
    print(f"written under {args.out}")


if __name__ == "__main__":
    main()
