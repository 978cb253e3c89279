"""Counterfactual context pressure of gradflow-mini-en and its all-token twin (issue 14, part 2).

Regenerates the pressure numbers quoted in README.md (about 3 min on 2 cores):

    python -m analyses.pressure.run [--out figures/pressure]

Records both embedded models on the committed sample under the all-positions loss
(``runs/pressure-*``, not committed), writes ``figures/pressure/pressure.csv`` (every layer and
sublayer of both models), ``figures/pressure/last_block.md`` (the README table) and the comparison
report with its ``compare_context_pressure`` figure under ``figures/pressure/``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
MODELS = {"mini-en": "gradflow-mini-en", "twin": "gradflow-mini-en-alltoken"}
OUT = "figures/pressure"  # default --out, relative to the repository root


def gradflow(*args: str) -> None:
    command = [sys.executable, "-m", "gradflow", *args]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=OUT, help="relative to the repository root (default %(default)s)")
    out_dir = parser.parse_args().out
    out = ROOT / out_dir
    from gradflow.analysis import load_run
    from gradflow.analysis.pressure import context_pressure
    from gradflow.formatting import format_estimate

    runs = {label: f"runs/pressure-{label}" for label in MODELS}
    for label, model in MODELS.items():
        gradflow("record", "--model", model, "--loss", "all-positions", "--out", runs[label], "--overwrite", "--quiet")
    out.mkdir(parents=True, exist_ok=True)
    gradflow("compare", *runs.values(), "--labels", *MODELS, "--out", out_dir, "--format", "pdf,png")
    tables = [context_pressure(load_run(ROOT / path)).assign(model=label) for label, path in runs.items()]
    frame = pd.concat(tables, ignore_index=True)
    frame.to_csv(out / "pressure.csv", index=False, float_format="%.6g")
    last = {label: t[t["last_block"]].set_index("sublayer") for label, t in zip(MODELS, tables)}
    lines = ["| last-block sublayer | mini-en pressure [95% CI] | mini-en vs earlier blocks | twin pressure [95% CI] | "
             "twin vs earlier blocks |", "|---|---|---|---|---|"]
    for sublayer in last["mini-en"].index:
        cells = []
        for label in MODELS:
            r = last[label].loc[sublayer]
            cells += [format_estimate(r.pressure, r.ci_low, r.ci_high),
                      format_estimate(r.vs_earlier, r.vs_earlier_ci_low, r.vs_earlier_ci_high)]
        lines.append(f"| {sublayer} | " + " | ".join(cells) + " |")
    (out / "last_block.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
