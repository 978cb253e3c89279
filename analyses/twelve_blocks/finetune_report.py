"""The twelve-block fine-tuning experiment's tables: the plan's 8 primary contrasts and its verdict.

Pre-registered in ``figures/twelve-blocks/plan.md`` ("Fine-tuning: regime (a)"): AUC of the validation curve,
paired by seed; contrasts 1-6 are gradflow-mini12-en ``arm - full`` for repair1, drop1, reinit1 on both tasks,
7-8 the model contrast ``(mini12 drop1 - full) - (twin drop1 - full)``; Holm over the 8 (family-wise 0.05),
and for each null the minimum detectable effect at 80% power at alpha 0.05 and 0.05/8.

    python -m analyses.twelve_blocks.finetune_report [--out figures/twelve-blocks/finetune]

Reads ``<out>/convergence/runs`` (``make -C analyses twelve-blocks-convergence``) and writes there
``run_summaries.csv``, ``contrasts.{csv,md}``, ``cells.{csv,md}``, ``verdict.md`` (the plan's rule for the seed's
claim holding at twelve blocks, applied to the contrasts) and ``convergence_curves.{csv,pdf,png}``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pandas as pd

from analyses.last_block_finetuning.powered_figures import curve_table, draw_curves
from analyses.last_block_finetuning.powered_report import (
    METRIC,
    cells,
    cells_markdown,
    interval,
    paired_differences,
    run_summaries,
    tested,
    write_markdown,
)

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "figures/twelve-blocks/finetune"
MLM, TWIN = "gradflow-mini12-en", "gradflow-mini12-en-alltoken"
FAMILY = 8
MODEL_CONTRAST = "(mini12-en drop1 - full) - (twin drop1 - full)"
CELLS = {MLM: ("full", "drop1", "reinit1", "repair1"), TWIN: ("full", "drop1")}
SEEDS = tuple(range(10))


def missing_runs(summaries: pd.DataFrame) -> list[str]:
    """The plan's (model, task, arm) cells that lack one of the 10 seeds, as readable lines (empty: complete).

    Holm's adjustment ranks all 8 contrasts, so no contrast is computed before every cell is in (deviation 4)."""
    have = set() if summaries.empty else set(zip(summaries.model, summaries.task, summaries.arm, summaries.seed))
    lines = []
    for model, arms in CELLS.items():
        for task in METRIC:
            for arm in arms:
                absent = [s for s in SEEDS if (model, task, arm, s) not in have]
                if absent:
                    lines.append(f"{model} {task} {arm}: {len(SEEDS) - len(absent)} of {len(SEEDS)} seeds "
                                 f"(missing {', '.join(map(str, absent))})")
    return lines


def contrasts(summaries: pd.DataFrame) -> pd.DataFrame:
    """The plan's 8 primary contrasts on the AUC, paired by seed, tested with Holm over the 8."""
    rows = []
    for arm in ("repair1", "drop1", "reinit1"):
        for task in METRIC:
            rows.append({"contrast": f"mini12-en {arm} - full", "task": task, "value": "auc",
                         "diffs": paired_differences(summaries, MLM, task, arm, "auc")})
    for task in METRIC:
        mlm = paired_differences(summaries, MLM, task, "drop1", "auc")
        d = (mlm - paired_differences(summaries, TWIN, task, "drop1", "auc")).dropna()
        rows.append({"contrast": MODEL_CONTRAST, "task": task, "value": "auc", "diffs": d})
    return tested(rows, FAMILY)


def verdict(table: pd.DataFrame) -> tuple[bool, str]:
    """The plan's rule: ``drop1 - full`` positive with Holm p < 0.05 on at least one task and not significantly
    negative on the other, and the model contrast positive on that task. Returns (holds, the reasoning)."""
    drop = {r.task: r for r in table[table.contrast == "mini12-en drop1 - full"].itertuples()}
    model = {r.task: r for r in table[table.contrast == MODEL_CONTRAST].itertuples()}
    reasons, holds = [], False
    for task in METRIC:
        others = [t for t in METRIC if t != task]
        up = bool(drop[task].significant) and drop[task].mean > 0
        other_down = any(bool(drop[t].significant) and drop[t].mean < 0 for t in others)
        model_up = model[task].mean > 0
        ok = up and not other_down and bool(model_up)
        holds |= ok
        reasons.append(f"- {task}: drop1 - full {interval(drop[task])} (Holm p {drop[task].p_holm:.3g}): "
                       f"{'positive and significant' if up else 'not a significant gain'}; the other task "
                       f"{'significantly negative' if other_down else 'not significantly negative'}; the model "
                       f"contrast {interval(model[task])} (Holm p {model[task].p_holm:.3g}): "
                       f"{'positive' if model_up else 'not positive'} "
                       "(the plan asks for its sign, not its significance)"
                       f" -> {'holds' if ok else 'does not hold'} on this task")
    head = ("The seed's claim holds at twelve blocks" if holds else
            "The seed's claim does not hold at twelve blocks") + " (the plan's rule, figures/twelve-blocks/plan.md):"
    return holds, "\n".join([head, *reasons]) + "\n"


def write_tables(out: Path) -> int:
    """Read ``out/convergence/runs`` and write the summaries, contrasts, cells and the verdict into ``out``."""
    runs = out / "convergence"
    if not (runs / "runs").is_dir():
        raise SystemExit(f"finetune_report: no runs under {runs / 'runs'}: run `make -C analyses "
                         "twelve-blocks-convergence` first (it needs the shipped 12-block pair)")
    summaries = run_summaries(runs)
    summaries.to_csv(out / "run_summaries.csv", index=False, float_format="%.6g")
    missing = missing_runs(summaries)
    if missing:
        raise SystemExit("finetune_report: the plan's cells are not all in, so no contrast is computed (Holm ranks "
                         f"all {FAMILY}; plan deviation 4):\n  " + "\n  ".join(missing) + "\nrun `make -C analyses "
                         "twelve-blocks-convergence` to finish them (it resumes); run_summaries.csv was written")
    table = contrasts(summaries)
    table.to_csv(out / "contrasts.csv", index=False, float_format="%.6g")
    write_markdown(out / "contrasts.md", ["contrast", "task", "mean difference in AUC [95% CI]", "n", "p (Holm)",
                                           "MDE at 80% power (alpha .05 / .05/8)"],
                    [[r.contrast, r.task, interval(r), r.n_pairs, f"{r.p_holm:.3g}",
                      "-" if math.isnan(r.mde_alpha05) else f"{r.mde_alpha05:.4f} / {r.mde_bonferroni:.4f}"]
                     for r in table.itertuples()])
    cell_table = cells(summaries)
    cell_table.to_csv(out / "cells.csv", index=False, float_format="%.6g")
    (out / "cells.md").write_text(cells_markdown(cell_table), encoding="utf-8")
    _, text = verdict(table)
    (out / "verdict.md").write_text(text, encoding="utf-8")
    curves = curve_table(runs)
    curves.to_csv(out / "convergence_curves.csv", index=False, float_format="%.6g")
    draw_curves(curves, out, {MLM: "gradflow-mini12-en", TWIN: "12-block all-token twin"})
    print(text)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="the experiment folder (default %(default)s)")
    return write_tables(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
