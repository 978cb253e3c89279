"""Regenerate the committed figures in ``figures/`` from the embedded models (and the zoo models
when fetched), with the run tables beside them. One command::

    python -m analyses.report_figures.make_figures      # or: make -C analyses report-figures

Runs (all on the committed held-out SOTU sample, seed 0, max length 128):

- ``mini-en_mlm``: gradflow-mini-en under the MLM loss it was trained with;
- ``mini-en-alltoken_all-positions``: the all-token twin under its own all-positions loss;
- ``mini-en-alltoken_mlm``: the twin under the MLM loss (the last-block zero is structural);
- ``mini-en_mlm_mask40``: gradflow-mini-en with 40% masking;
- ``mini12-en_mlm``: gradflow-mini12-en (12 blocks) under the MLM loss, for the comparison across depths;
- ``zoo-antiberty_mlm`` / ``zoo-rxnfp_mlm``: the zoo checkpoints on their example inputs, if fetched.

Each run gets ``figures/runs/<run>/`` (tables, meta.json) and ``figures/report/<run>/`` (figures,
summary.md); comparisons go to ``figures/report/compare_*`` (``compare_depths``: 6 against 12 blocks, matched
at the same relative depth). ``--keep-runs`` reuses every run directory already there with a complete
meta.json (the committed ones) and records only the missing runs: the reports and comparisons are
redrawn from the committed measurements.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from gradflow.figures.report import write_comparison, write_report
from gradflow.runs.record import RecordConfig, record_corpus

ROOT = Path(__file__).resolve().parents[2]


def runs(limit: int | None) -> list[tuple[str, dict]]:
    plan = [
        ("mini-en_mlm", dict(model="gradflow-mini-en", loss="mlm")),
        ("mini-en-alltoken_all-positions", dict(model="gradflow-mini-en-alltoken", loss="all-positions")),
        ("mini-en-alltoken_mlm", dict(model="gradflow-mini-en-alltoken", loss="mlm")),
        ("mini-en_mlm_mask40", dict(model="gradflow-mini-en", loss="mlm", mask_rate=0.4)),
        ("mini12-en_mlm", dict(model="gradflow-mini12-en", loss="mlm")),
    ]
    from gradflow.models import zoo

    for name in ("antiberty", "rxnfp"):
        if zoo.zoo_path(name) is not None:
            plan.append((f"zoo-{name}_mlm", dict(model=f"zoo:{name}", loss="mlm", texts=_zoo_texts(name),
                                                 max_length=256)))
    return [(n, {**c, "limit": c.get("limit", limit)}) for n, c in plan]


def _complete(run_dir: Path) -> bool:
    """The run directory holds a finished recording (meta.json with ``complete: true``)."""
    import json

    meta = run_dir / "meta.json"
    return meta.is_file() and json.loads(meta.read_text(encoding="utf-8")).get("complete") is True


def _zoo_texts(name: str) -> str:
    from importlib import resources

    return str(resources.files("gradflow") / "zoo_inputs" / f"{name}.txt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "figures")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--keep-runs", action="store_true",
                        help="reuse run directories with a complete meta.json; record only the missing runs")
    args = parser.parse_args()
    command = "python -m analyses.report_figures.make_figures " + shlex.join(sys.argv[1:])
    done = {}
    for name, cfg in runs(args.limit):
        run_dir = args.out / "runs" / name
        if args.keep_runs and _complete(run_dir):
            print(f"[figures] reusing {name}", flush=True)
        else:
            print(f"[figures] recording {name}", flush=True)
            record_corpus(RecordConfig(out=str(run_dir), overwrite=True, quiet=True, command=command, **cfg))
        write_report(run_dir, args.out / "report" / name)
        done[name] = run_dir
    write_comparison([done["mini-en_mlm"], done["mini-en-alltoken_all-positions"]],
                     ["mini-en, MLM loss", "alltoken twin, all-positions loss"], args.out / "report" / "compare_models")
    write_comparison([done["mini-en_mlm"], done["mini-en-alltoken_mlm"]],
                     ["mini-en", "alltoken twin"], args.out / "report" / "compare_same_mlm_loss")
    write_comparison([done["mini-en_mlm"], done["mini-en_mlm_mask40"]],
                     ["masking 15%", "masking 40%"], args.out / "report" / "compare_masking")
    write_comparison([done["mini-en_mlm"], done["mini12-en_mlm"]], ["6 blocks", "12 blocks"],
                     args.out / "report" / "compare_depths")
    print(f"[figures] written under {args.out}", flush=True)


if __name__ == "__main__":
    main()
