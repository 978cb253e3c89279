"""Issue 15: layer-wise probes of every arm's encoder before fine-tuning, beside its fine-tuning effect.

The arms of gradflow-mini-en share every block below the last, so their probe curves differ only at
the top site:

- ``full`` and ``repair1`` are the runs of ``analyses/probes/run.py`` (``figures/probes/runs/``);
- ``drop1`` is ``full`` read at layer L-1 (its top site is ``full``'s ``blocks.{L-2}.out``);
- ``reinit1`` is probed here for seeds 0..2 (``gradflow surgery --reinit-last 1 --seed s``; the
  fine-tuning runs of seed s re-initialise the block with the same seed), 600 sentences per split.

Writes ``figures/finetune/last-block-finetuning/probes/runs/reinit1-s<seed>-<task>/`` and
``figures/finetune/last-block-finetuning/probes/arms.csv`` / ``arms.md``: per arm and task, the top site's test
accuracy [95% CI] and online code length, and the difference to ``full``'s top site.

    python -m analyses.last_block_finetuning.arm_probes            # seed 0 measured: 168 s + 92 s, one thread each
    python -m analyses.last_block_finetuning.arm_probes --tables-only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from analyses.probes.run import gradflow, run_all

ROOT = Path(__file__).resolve().parents[2]
OUT = "figures/finetune/last-block-finetuning/probes"  # default --out, relative to the repository root
PROBES = "figures/probes/runs"
TASKS = ("brown-pos", "brown-propn")
SEEDS = (0, 1, 2)


def probe_reinit(limit: str, jobs: int, seeds: tuple[int, ...] = SEEDS, out: str = OUT) -> None:
    commands = []
    for seed in seeds:
        model = f"build/mini-reinit1-s{seed}"
        if not (ROOT / model / "config.json").exists():
            gradflow("surgery", "--model", "gradflow-mini-en", "--reinit-last", "1", "--seed", str(seed),
                     "--out", model, "--overwrite")
        for task in TASKS:
            run = f"{out}/runs/reinit1-s{seed}-{task}"
            if (ROOT / run / "probe_drops.csv").exists():
                continue
            commands.append(["probe", "--model", model, "--task", task, "--out", run, "--limit", limit,
                             "--overwrite", "--quiet", "--format", "png"])
    run_all(commands, jobs)


def top_site(run: str, layer: int | None = None) -> pd.Series:
    """The unmasked probe row of ``run`` at ``layer`` (default: its top layer)."""
    frame = pd.read_csv(ROOT / run / "probes.csv")
    frame = frame[frame.regime == "unmasked"]
    return frame[frame.layer == (frame.layer.max() if layer is None else layer)].iloc[0]


def arm_table(out: str = OUT) -> pd.DataFrame:
    rows = []
    for task in TASKS:
        full = top_site(f"{PROBES}/mini-en-{task}")
        arms = {"full": [full], "drop1": [top_site(f"{PROBES}/mini-en-{task}", int(full.layer) - 1)],
                "repair1": [top_site(f"{PROBES}/repaired-{task}")],
                "reinit1": [top_site(f"{out}/runs/reinit1-s{s}-{task}") for s in SEEDS
                            if (ROOT / out / "runs" / f"reinit1-s{s}-{task}" / "probes.csv").exists()]}
        for arm, sites in arms.items():
            for i, r in enumerate(sites):
                rows.append({"task": task, "arm": arm, "probe_seed": i if arm == "reinit1" else None,
                             "site": r.site, "accuracy": r.accuracy, "ci_low": r.ci_low, "ci_high": r.ci_high,
                             "selectivity": r.selectivity, "code_length_bits": r.code_length_bits,
                             "accuracy_minus_full": r.accuracy - full.accuracy,
                             "code_bits_minus_full": r.code_length_bits - full.code_length_bits})
    return pd.DataFrame(rows)


def markdown(table: pd.DataFrame) -> str:
    lines = ["| task | arm | top site | test accuracy [95% CI] | minus full | code length (bits) | minus full |",
             "|---|---|---|---|---|---|---|"]
    for r in table.itertuples():
        arm = r.arm if pd.isna(r.probe_seed) else f"{r.arm} (seed {int(r.probe_seed)})"
        lines.append(f"| {r.task} | {arm} | {r.site} | {r.accuracy:.4f} [{r.ci_low:.4f}, {r.ci_high:.4f}] | "
                     f"{r.accuracy_minus_full:+.4f} | {r.code_length_bits:.0f} | {r.code_bits_minus_full:+.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", default="600", help="sentences per split (default %(default)s)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="reinit1 seeds to probe")
    parser.add_argument("--tables-only", action="store_true")
    parser.add_argument("--out", default=OUT, help="relative to the repository root (default %(default)s)")
    args = parser.parse_args()
    if not args.tables_only:
        probe_reinit(args.limit, args.jobs, tuple(args.seeds), args.out)
    table = arm_table(args.out)
    (ROOT / args.out).mkdir(parents=True, exist_ok=True)
    table.to_csv(ROOT / args.out / "arms.csv", index=False, float_format="%.6g")
    (ROOT / args.out / "arms.md").write_text(markdown(table), encoding="utf-8")
    print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
