"""Counterfactual context pressure of gradflow-mini-en and its all-token twin (issue 14, part 2); ``--pair
mini12-en``: the 12-block pair (issue 31) into ``figures/twelve-blocks/pressure``; ``--pair objectives``: the four
6-block objectives (issue 52, plan Part 1 measure 3: mini-en, the twin, mask40, diffusion) into
``figures/objectives/pressure``.

Regenerates the pressure numbers quoted in README.md (about 3 min on 2 cores):

    python -m analyses.pressure.run [--out figures/pressure]

Records both embedded models on the committed sample under the all-positions loss (scratch runs,
not committed: ``runs/pressure-*`` of the clone for the committed location; with another ``--out``,
``OUT/runs/<label>``, so that ``make -C analyses pressure OUT=...`` writes nothing into the clone),
writes ``figures/pressure/pressure.csv`` (every layer and sublayer of both models),
``figures/pressure/last_block.md`` (the README table) and the comparison report with its
``compare_context_pressure`` figure under ``figures/pressure/``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
# per pair: label -> model (the MLM model first) and the default --out, relative to the repository root
PAIRS = {"mini-en": ({"mini-en": "gradflow-mini-en", "twin": "gradflow-mini-en-alltoken"}, "figures/pressure"),
         "mini12-en": ({"mini12-en": "gradflow-mini12-en", "twin": "gradflow-mini12-en-alltoken"},
                       "figures/twelve-blocks/pressure"),
         "objectives": ({"mini-en": "gradflow-mini-en", "twin": "gradflow-mini-en-alltoken",
                         "mask40": "gradflow-mini-en-mask40", "diffusion": "gradflow-mini-en-diffusion"},
                        "figures/objectives/pressure")}
MODELS, OUT = PAIRS["mini-en"]


def gradflow(*args: str) -> None:
    command = [sys.executable, "-m", "gradflow", *args]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def as_argument(path: Path) -> str:
    """``path`` for a gradflow command run from the repository root: relative to it when inside (as the committed
    results' commands were written), else absolute."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT.resolve())) if path.is_relative_to(ROOT.resolve()) else str(path)


def scratch_runs(pair: str, out: Path) -> dict[str, Path]:
    """label -> the run directory each model of ``pair`` is recorded into before the comparison.

    At the pair's committed location (``out`` is its default): ``runs/pressure-<label>``
    (``runs/pressure-<pair>-<label>`` for another pair than mini-en) in the repository's ``runs/`` (ignored by git), as
    the committed results were made; anywhere else: ``out/runs/<label>``, beside the results, and nothing in the clone.
    """
    models, default_out = PAIRS[pair]
    if Path(out).resolve() == (ROOT / default_out).resolve():
        prefix = "pressure-" if pair == "mini-en" else f"pressure-{pair}-"
        return {label: ROOT / "runs" / f"{prefix}{label}" for label in models}
    return {label: Path(out) / "runs" / label for label in models}


def last_block_lines(frame: pd.DataFrame, models: list[str]) -> list[str]:
    """The README's last-block table (Markdown lines) from ``pressure.csv``'s rows: each model's pressure and its
    ratio to the earlier blocks, with 95% CIs, fixed decimals per column (:func:`gradflow.formatting.fixed_column`)."""
    from gradflow.formatting import fixed_column

    last = {label: frame[(frame["model"] == label) & frame["last_block"]].set_index("sublayer") for label in models}
    mlm = models[0]
    subs = list(last[mlm].index)
    columns = []
    for label in models:
        r = last[label].reindex(subs)
        columns += [fixed_column(r["pressure"], r["ci_low"], r["ci_high"]),
                    fixed_column(r["vs_earlier"], r["vs_earlier_ci_low"], r["vs_earlier_ci_high"])]
    lines = ["| last-block sublayer | " + " | ".join(f"{label} pressure [95% CI] | {label} vs earlier blocks"
                                                  for label in models) + " |", "|---|" + "---|" * (2 * len(models))]
    lines += [f"| {sub} | " + " | ".join(column[k] for column in columns) + " |" for k, sub in enumerate(subs)]
    return lines


def write_last_block_table(frame: pd.DataFrame, models: list[str], out: Path) -> Path:
    """Write ``last_block.md`` into ``out`` (and print it)."""
    lines = last_block_lines(frame, models)
    path = out / "last_block.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=PAIRS, default="mini-en",
                        help="mini-en: the 6-block pair (issue 14); mini12-en: the 12-block pair (issue 31); objectives: "
                             "the four 6-block objectives (issue 52)")
    parser.add_argument("--out", default=None, help="relative to the repository root (default figures/pressure, "
                        "figures/twelve-blocks/pressure, figures/objectives/pressure)")
    parser.add_argument("--tables-only", action="store_true",
                        help="rewrite last_block.md from the committed pressure.csv in --out; record nothing")
    args = parser.parse_args(argv)
    models, default_out = PAIRS[args.pair]
    out = ROOT / (args.out or default_out)  # an absolute --out stays as given
    if args.tables_only:
        write_last_block_table(pd.read_csv(out / "pressure.csv"), list(models), out)
        return 0
    from gradflow.analysis import load_run
    from gradflow.analysis.pressure import context_pressure

    runs = scratch_runs(args.pair, out)
    for label, model in models.items():
        gradflow("record", "--model", model, "--loss", "all-positions", "--out", as_argument(runs[label]),
                 "--overwrite", "--quiet")
    out.mkdir(parents=True, exist_ok=True)
    gradflow("compare", *map(as_argument, runs.values()), "--labels", *models, "--out", as_argument(out),
             "--format", "pdf,png")
    tables = [context_pressure(load_run(path)).assign(model=label) for label, path in runs.items()]
    frame = pd.concat(tables, ignore_index=True)
    frame.to_csv(out / "pressure.csv", index=False, float_format="%.6g")
    write_last_block_table(frame, list(models), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
