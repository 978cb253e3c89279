"""Layer-wise probes of gradflow-mini-en, its all-token twin and the repaired mini-en (issue 14).

Regenerates every probe number quoted in README.md:

    python analyses/probes.py            # ~25 min on 2 cores (repair included when build/ lacks it)

Writes ``figures/probes/runs/<label>-<task>/`` (probes.csv, probe_drops.csv, meta.json), the comparison
figures ``figures/probes/probes_<task>.{pdf,png}`` and ``figures/probes/drops.md`` (the README table).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
REPAIRED = "build/mini-repaired"
MODELS = {"mini-en": "gradflow-mini-en", "twin": "gradflow-mini-en-alltoken", "repaired": f"{REPAIRED}/model"}
TASKS = ("brown-pos", "brown-propn")


def gradflow(*args: str) -> None:
    command = [sys.executable, "-m", "gradflow", *args]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", default="600", help="sentences per split (default %(default)s)")
    parser.add_argument("--masked-limit", default="100", help="sentences per split of the masked regime runs")
    parser.add_argument("--out", default="figures/probes")
    args = parser.parse_args()
    out = ROOT / args.out
    if not (ROOT / REPAIRED / "model").is_dir():
        gradflow("repair", "--model", "gradflow-mini-en", "--out", REPAIRED)
    dirs: dict[str, list[str]] = {task: [] for task in TASKS}
    for task in TASKS:
        for label, model in MODELS.items():
            run = f"{args.out}/runs/{label}-{task}"
            gradflow("probe", "--model", model, "--task", task, "--out", run, "--limit", args.limit, "--overwrite",
                     "--quiet", "--format", "png")
            dirs[task].append(run)
    masked = []
    for label in ("mini-en", "twin"):
        run = f"{args.out}/runs/{label}-brown-pos-masked"
        gradflow("probe", "--model", MODELS[label], "--task", "brown-pos", "--masked", "--out", run, "--limit",
                 args.masked_limit, "--overwrite", "--quiet", "--format", "png")
        masked.append(run)
    for task in TASKS:
        gradflow("compare", *dirs[task], "--labels", *MODELS, "--out", args.out)
    gradflow("compare", *masked, "--labels", "mini-en", "twin", "--out", f"{args.out}/masked")
    (out / "drops.md").write_text(drops_table([*dirs["brown-pos"], *dirs["brown-propn"], *masked]), encoding="utf-8")
    print((out / "drops.md").read_text(encoding="utf-8"))
    return 0


def drops_table(runs: list[str]) -> str:
    """The README table: last-layer drop (accuracy points and code-length bits) with 95% CIs."""
    lines = ["| run | regime | last-layer drop, accuracy (95% CI) | best earlier layer | "
             "last-layer drop, code length in bits (95% CI) |", "|---|---|---|---|---|"]
    for run in runs:
        drops = pd.read_csv(ROOT / run / "probe_drops.csv")
        for regime, d in drops.groupby("regime", sort=False):
            acc = d[d.metric == "accuracy"].iloc[0]
            code = d[d.metric == "code_length_bits"]
            bits = (f"{code.iloc[0].last_layer_drop:+.0f} [{code.iloc[0].ci_low:+.0f}, {code.iloc[0].ci_high:+.0f}]"
                    if len(code) else "-")
            lines.append(f"| {Path(run).name} | {regime} | {acc.last_layer_drop:+.4f} [{acc.ci_low:+.4f}, "
                         f"{acc.ci_high:+.4f}] | {int(acc.best_earlier_layer)} ({acc.best_earlier_score:.4f}) | {bits} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
