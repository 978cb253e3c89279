"""Issue 15's tables from the committed runs: per-run curve summaries, the primary contrasts with
Holm's correction, and the minimum detectable effect of every null (the plan's rules, see
``figures/finetune/last-block-finetuning/plan.md``).

    python -m analyses.last_block_finetuning.powered_report # reads figures/finetune/last-block-finetuning/<regime>/runs

Writes ``figures/finetune/last-block-finetuning/run_summaries.csv`` (one row per run: AUC, steps to 90% of
``full``'s mean final validation score, final test score) and ``contrasts.csv`` / ``contrasts.md``
(the 14 primary contrasts: mean paired difference, 95% t-interval, p, Holm-adjusted p, and for a
null the minimum detectable effect at 80% power at alpha 0.05 and 0.05/14).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from analyses.last_block_finetuning.grid import collect, mean_ci
from gradflow.analysis.experiment_stats import (
    area_under_curve,
    minimum_detectable_effect,
    paired_test,
    steps_to_threshold,
)
from gradflow.analysis.stats import holm

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "figures/finetune/last-block-finetuning"  # default --out: the experiment folder (runs under <regime>/runs)
METRIC = {"brown-pos": "accuracy", "brown-propn": "entity_f1"}
MINI, TWIN = "gradflow-mini-en", "gradflow-mini-en-alltoken"
FAMILY = 14


def run_summaries(regime_dir: Path, collected: tuple[pd.DataFrame, pd.DataFrame] | None = None) -> pd.DataFrame:
    """One row per finished run: factors, AUC of the validation curve, final validation and test scores.

    ``collected``: ``collect(regime_dir)``'s (curves, finals) when the caller has read them already."""
    curves, finals = collected if collected is not None else collect(regime_dir)
    rows = []
    for run_id, curve in curves.groupby("run_id"):
        task = curve["task"].iloc[0]
        val = curve[(curve.split == "validation") & (curve.metric == METRIC[task])].sort_values("step")
        fin = finals[(finals.run_id == run_id) & (finals.metric == METRIC[task])].set_index("split")["value"]
        recall = finals[(finals.run_id == run_id) & (finals.metric == "recall") & (finals.split == "test")]["value"]
        seconds = finals[finals.run_id == run_id]["seconds"]
        factors = {k: curve[k].iloc[0] for k in ("model", "arm", "task", "seed", "regime")}
        rows.append({**factors, "run_id": run_id, "auc": area_under_curve(val.step.to_numpy(), val.value.to_numpy()),
                     "steps": val.step.tolist(), "values": val.value.tolist(),
                     "final_validation": fin.get("validation", math.nan), "test": fin.get("test", math.nan),
                     "test_recall": float(recall.iloc[0]) if len(recall) else math.nan,
                     "seconds": float(seconds.iloc[0]) if len(seconds) else math.nan})
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    target = frame[frame.arm == "full"].groupby(["model", "task"])["final_validation"].mean() * 0.9
    frame["steps_to_90"] = [steps_to_threshold(np.array(r.steps), np.array(r.values), target.get((r.model, r.task), math.inf))
                            for r in frame.itertuples()]
    return frame.drop(columns=["steps", "values"])


def paired_differences(frame: pd.DataFrame, model: str, task: str, arm: str, value: str) -> pd.Series:
    """Per seed, ``value`` of ``arm`` minus ``full`` for one model and task (empty when either arm is missing)."""
    sub = frame[(frame.model == model) & (frame.task == task)].set_index(["arm", "seed"])[value]
    return (sub.loc[arm] - sub.loc["full"]).dropna() if {arm, "full"} <= set(sub.index.get_level_values(0)) \
        else pd.Series(dtype=float)


def contrasts(convergence: pd.DataFrame, few: pd.DataFrame) -> pd.DataFrame:
    """The plan's 14 primary contrasts, paired by seed; Holm over those with at least 2 pairs."""
    rows = []
    for regime, frame, value in (("convergence", convergence, "auc"), ("few-sample-250", few, "test")):
        for arm in ("repair1", "drop1", "reinit1"):
            for task in METRIC:
                d = paired_differences(frame, MINI, task, arm, value) if not frame.empty else pd.Series(dtype=float)
                rows.append({"regime": regime, "contrast": f"mini-en {arm} - full", "task": task, "value": value,
                             "diffs": d})
    for task in METRIC:
        d = pd.Series(dtype=float)
        if not convergence.empty:
            mini, twin = paired_differences(convergence, MINI, task, "drop1", "auc"), paired_differences(convergence, TWIN, task, "drop1", "auc")
            d = (mini - twin).dropna()
        rows.append({"regime": "convergence", "contrast": "(mini-en drop1 - full) - (twin drop1 - full)",
                     "task": task, "value": "auc", "diffs": d})
    return tested(rows, FAMILY)


def tested(rows: list[dict], family: int) -> pd.DataFrame:
    """Each row with its ``diffs`` (paired differences, a Series; popped) replaced by a two-sided paired t-test
    (mean, 95% CI, p, SD, pairs), Holm's adjustment over the rows, and for each null the minimum detectable
    effect at 80% power at alpha 0.05 (``mde_alpha05``) and 0.05 / ``family`` (``mde_bonferroni``)."""
    out = []
    for row in rows:
        d = row.pop("diffs").to_numpy()
        if d.size >= 2:
            t = paired_test(d)
            row.update(mean=t.mean, ci_low=t.ci_low, ci_high=t.ci_high, p=t.p_value, sd=t.sd, n_pairs=t.n)
        else:
            row.update(mean=float(d.mean()) if d.size else math.nan, ci_low=math.nan, ci_high=math.nan, p=math.nan,
                       sd=math.nan, n_pairs=int(d.size))
        out.append(row)
    table = pd.DataFrame(out)
    table["p_holm"] = holm(table["p"].to_numpy())
    table["significant"] = table["p_holm"] < 0.05
    for alpha, name in ((0.05, "mde_alpha05"), (0.05 / family, "mde_bonferroni")):
        table[name] = [minimum_detectable_effect(r.sd, r.n_pairs, alpha) if r.n_pairs >= 2 and not r.significant
                       else math.nan for r in table.itertuples()]
    return table


def cells(summaries: pd.DataFrame) -> pd.DataFrame:
    """Per regime, model, task and arm: AUC and test score (mean, 95% t-interval), median steps to 90%,
    runs that collapsed to ``O`` (brown-propn: test recall < 0.01, no proper noun found) and run seconds."""
    rows = []
    for (regime, model, task, arm), sub in summaries.groupby(["regime", "model", "task", "arm"]):
        row = {"regime": regime, "model": model, "task": task, "arm": arm, "n": len(sub)}
        for value in ("auc", "test"):
            v = sub[value].dropna().to_numpy()
            mean, low, high, _ = mean_ci(v) if v.size >= 2 else (float(v.mean()) if v.size else math.nan, math.nan,
                                                                  math.nan, v.size)
            row.update({value: mean, f"{value}_ci_low": low, f"{value}_ci_high": high})
        row["median_steps_to_90"] = float(np.median(sub.steps_to_90))
        row["collapsed_to_O"] = int((sub.test_recall < 0.01).sum()) if task == "brown-propn" else 0
        row["seconds_mean"], row["seconds_total"] = float(sub.seconds.mean()), float(sub.seconds.sum())
        rows.append(row)
    return pd.DataFrame(rows)


def cells_markdown(table: pd.DataFrame) -> str:
    lines = ["| regime | model | task | arm | n | AUC [95% CI] | test [95% CI] | median steps to 90% | collapsed to O |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in table.itertuples():
        auc = "-" if math.isnan(r.auc) else f"{r.auc:.4f} [{r.auc_ci_low:.4f}, {r.auc_ci_high:.4f}]"
        lines.append(f"| {r.regime} | {r.model.replace('gradflow-', '')} | {r.task} | {r.arm} | {r.n} | {auc} | "
                     f"{r.test:.4f} [{r.test_ci_low:.4f}, {r.test_ci_high:.4f}] | {r.median_steps_to_90:g} | "
                     f"{r.collapsed_to_O} |")
    return "\n".join(lines) + "\n"


def exploratory(convergence: pd.DataFrame, extra: pd.DataFrame) -> pd.DataFrame:
    """Deviation 3's contrasts on the regime (a) AUC, paired by seed, outside the Holm family."""
    frame = pd.concat([convergence, extra], ignore_index=True)
    rows = []
    for task in METRIC:
        for arm, baseline in (("repair1-mlm", "full"), ("repair1", "repair1-mlm")):
            sub = frame[(frame.model == MINI) & (frame.task == task)].pivot_table(index="seed", columns="arm",
                                                                                   values="auc")
            if not {arm, baseline} <= set(sub.columns):
                continue
            d = (sub[arm] - sub[baseline]).dropna().to_numpy()
            if d.size < 2:
                continue
            t = paired_test(d)
            rows.append({"contrast": f"mini-en {arm} - {baseline}", "task": task, "mean": t.mean, "ci_low": t.ci_low,
                         "ci_high": t.ci_high, "p": t.p_value, "n_pairs": t.n,
                         "mde_alpha05": minimum_detectable_effect(t.sd, t.n) if t.p_value >= 0.05 else math.nan})
    return pd.DataFrame(rows)


def interval(r) -> str:
    """``+mean [+low, +high]`` of a row with ``mean``, ``ci_low`` and ``ci_high``."""
    return f"{r.mean:+.4f} [{r.ci_low:+.4f}, {r.ci_high:+.4f}]"


def write_markdown(path: Path, header: list[str], rows: list[list]) -> None:
    """A markdown table to ``path`` (and stdout)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="the experiment folder (default %(default)s)")
    return write_tables(parser.parse_args().out)


def write_tables(out: Path) -> int:
    """Read the regimes' runs under ``out`` and write the summaries, contrasts and cells there."""
    if not any((out / regime / "runs").is_dir() for regime in ("convergence", "few-sample-250")):
        raise SystemExit(f"powered_report: no runs under {out}/convergence/runs or {out}/few-sample-250/runs; "
                         "--out (make's OUT=) is the experiment folder the grids wrote: run "
                         "`make -C analyses powered-convergence OUT=...` first, or leave OUT unset for the committed runs")
    convergence = run_summaries(out / "convergence") if (out / "convergence/runs").is_dir() else pd.DataFrame()
    few = run_summaries(out / "few-sample-250") if (out / "few-sample-250/runs").is_dir() else pd.DataFrame()
    summaries = pd.concat([convergence, few], ignore_index=True)
    summaries.to_csv(out / "run_summaries.csv", index=False, float_format="%.6g")
    table = contrasts(convergence, few)
    table.to_csv(out / "contrasts.csv", index=False, float_format="%.6g")
    write_markdown(out / "contrasts.md", ["regime", "contrast", "task", "mean difference [95% CI]", "n", "p (Holm)",
                                           "MDE at 80% power (alpha .05 / .05/14)"],
                    [[r.regime, r.contrast, r.task, interval(r), r.n_pairs, f"{r.p_holm:.3g}",
                      "-" if math.isnan(r.mde_alpha05) else f"{r.mde_alpha05:.4f} / {r.mde_bonferroni:.4f}"]
                     for r in table.itertuples()])
    if not summaries.empty:
        table = cells(summaries)
        table.to_csv(out / "cells.csv", index=False, float_format="%.6g")
        (out / "cells.md").write_text(cells_markdown(table), encoding="utf-8")
        print(cells_markdown(table))
        cost = summaries.groupby(["regime", "model"])["seconds"].agg(["count", "sum", "mean"])
        print("run seconds (one thread each) per regime and model:\n" + cost.round(1).to_string())
    if (out / "convergence-exploratory/runs").is_dir() and not convergence.empty:
        extra = run_summaries(out / "convergence-exploratory")
        extra.to_csv(out / "run_summaries_exploratory.csv", index=False, float_format="%.6g")
        table = exploratory(convergence, extra)
        table.to_csv(out / "exploratory.csv", index=False, float_format="%.6g")
        write_markdown(out / "exploratory.md", ["contrast (exploratory, regime (a) AUC)", "task",
                                                 "mean difference [95% CI]", "n", "p", "MDE (alpha .05)"],
                        [[r.contrast, r.task, interval(r), r.n_pairs, f"{r.p:.3g}",
                          "-" if math.isnan(r.mde_alpha05) else f"{r.mde_alpha05:.4f}"] for r in table.itertuples()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
