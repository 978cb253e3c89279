"""The pretraining-seeds table (issue 60 item 4): ``figures/objectives/seeds/seeds.{md,csv}`` from committed files.

    python -m analyses.objectives.seeds_table [--out figures/objectives/seeds]

One row per member and pretraining seed: the context/loss ratio after the second-to-last block (own objective),
the last block's pressure (``attn.q``, ``ffn.in``) and ``drop1 - full`` in POS AUC at lr 1e-4 (paired over the
fine-tuning seeds, 95% t interval, two-sided p). Seed 0 is the shipped model, read from the single-seed analyses'
committed files (Part 1's ``role_ratios.csv`` and ``pressure.csv``; Part 3's per-run AUCs, through the same paired
test as the other seeds); seeds 1 and 2 from ``measures/<member>-s<S>.json`` and the runs under ``finetune/``.
Then each member's spread over its three seeds (range, SD) and the plan's survival rule for each finding of
:data:`FINDINGS` (``figures/diffusion-diagnosis/plan.md``, "Afterwards"): a finding survives if its sign holds at
all three pretraining seeds of every model it names and, for a significance-based finding, if the paired contrast
stays significant (p < 0.05) at two of the three. A comparison of two members is read at each seed s (both trained
with ``--seed s``: the same initialisation draw and window order). A missing seed is shown as missing and decides
nothing: a finding is "open" until the seeds present decide it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analyses.last_block_finetuning.powered_report import paired_differences, run_summaries
from analyses.objectives.pretraining_seeds import (FT_ARMS, FT_SEEDS, FT_TASK, MEMBERS, OUT, PLAN,
                                                   PRESSURE_SUBLAYERS, ROOT, Job, Member, relative)
from gradflow.analysis.experiment_stats import paired_test

ALL_SEEDS = (0, 1, 2)
QUANTITIES = {"ratio": "context / loss ratio after the second-to-last block (own objective)",
              **{f"pressure {s}": f"last block's pressure, {s}" for s in PRESSURE_SUBLAYERS},
              "drop1 - full": "drop1 - full, brown-pos AUC at lr 1e-4"}
Values = dict[tuple[str, int], dict]  # (member, seed) -> quantity -> {value, ci_low, ci_high, p, n} | reason str


@dataclass(frozen=True)
class Finding:
    """One objective finding and the quantity that checks it: ``sum(coefficient * quantity of member)`` at each
    pretraining seed, expected of ``sign`` (0: a null result, reported but not judged by the rule), with its
    paired p (fine-tuning contrasts) when ``significance``."""

    key: str
    claim: str
    stated: str
    quantity: str
    terms: tuple[tuple[float, str], ...]
    sign: int
    significance: bool = False


FINDINGS = (
    Finding("ratio-mask40",
            "40% masking sends clean channels more signal than 15% after block 5 (0.224 against 0.154)",
            "docs/results/objectives.md, Part 1", "ratio", ((1, "mask40"), (-1, "mini-en")), +1),
    Finding("ratio-twin", "the twin's ratio is lower than mini-en's (after block 5: 0.117 against 0.154)",
            "docs/results/objectives.md, Part 1", "ratio", ((1, "twin"), (-1, "mini-en")), -1),
    Finding("pressure-mask40-q",
            "clean channels push mask40's last block less than mini-en's (attn.q 0.273 against 0.472)",
            "docs/results/objectives.md, Part 1", "pressure attn.q", ((1, "mask40"), (-1, "mini-en")), -1),
    Finding("pressure-mask40-ffn", "... and on ffn.in (0.242 against 0.287)",
            "docs/results/objectives.md, Part 1", "pressure ffn.in", ((1, "mask40"), (-1, "mini-en")), -1),
    Finding("pressure-twin-q", "the twin's last-block pressure is more than ten times less than mini-en's, attn.q "
            "(0.030 against 0.472): 10 x twin - mini-en < 0", "results index row 4", "pressure attn.q",
            ((10, "twin"), (-1, "mini-en")), -1),
    Finding("pressure-twin-ffn", "... and ffn.in (0.026 against 0.287)", "results index row 4", "pressure ffn.in",
            ((10, "twin"), (-1, "mini-en")), -1),
    Finding("drop1-mini-en", "dropping mini-en's last block slows fine-tuning (POS AUC -0.0213)",
            "results index row 9", "drop1 - full", ((1, "mini-en"),), -1, True),
    Finding("drop1-mask40", "dropping mask40's last block slows fine-tuning (POS AUC -0.0101)",
            "results index row 15 (POS)", "drop1 - full", ((1, "mask40"),), -1, True),
    Finding("drop1-twin", "dropping the twin's last block slows fine-tuning (POS AUC -0.0222)",
            "docs/results/objectives.md, overview", "drop1 - full", ((1, "twin"),), -1, True),
    Finding("drop1-mask40-vs-mini-en", "dropping costs mask40 about half what it costs mini-en on POS (secondary "
            "contrast +0.0112)", "docs/results/objectives.md, Part 3", "drop1 - full",
            ((1, "mask40"), (-1, "mini-en")), +1, True),
    Finding("drop1-twin-equal", "dropping costs the twin what it costs mini-en (+0.0009, not significant)",
            "results index row 10", "drop1 - full", ((1, "mini-en"), (-1, "twin")), 0, True),
    Finding("pressure-diffusion-q", "clean channels push the diffusion member's last block harder than mini-en's, "
            "attn.q (2.449 against 0.472)", "docs/results/objectives.md, Part 1", "pressure attn.q",
            ((1, "diffusion"), (-1, "mini-en")), +1),
    Finding("pressure-diffusion-ffn", "... and on ffn.in (1.912 against 0.287)", "docs/results/objectives.md, Part 1",
            "pressure ffn.in", ((1, "diffusion"), (-1, "mini-en")), +1),
    Finding("drop1-diffusion", "dropping the diffusion member's last block speeds fine-tuning (POS AUC +0.0078)",
            "results index row 17", "drop1 - full", ((1, "diffusion"),), +1, True),
    Finding("drop1-diffusion-vs-mini-en", "dropping the last block helps the diffusion member where it costs mini-en "
            "(secondary contrast +0.0290)", "docs/results/objectives.md, Part 3", "drop1 - full",
            ((1, "diffusion"), (-1, "mini-en")), +1, True),
)


def estimate(value: float, low: float = math.nan, high: float = math.nan, p: float = math.nan,
             n: float = math.nan) -> dict:
    return {"value": float(value), "ci_low": float(low), "ci_high": float(high), "p": float(p), "n": n}


def contrast(diffs: pd.Series) -> dict:
    t = paired_test(diffs.to_numpy())
    return {**estimate(t.mean, t.ci_low, t.ci_high, t.p_value, t.n), "diffs": diffs}


def drop1_diffs(summaries: pd.DataFrame, model: str, seeds: Sequence[int]) -> pd.Series | str:
    """``drop1 - full`` AUC per fine-tuning seed of ``model`` on brown-pos, or why not (a seed's pair missing)."""
    have = summaries[(summaries.model == model) & (summaries.task == FT_TASK)] if len(summaries) else summaries
    pairs = {(a, s) for a, s in zip(have.arm, have.seed)} if len(have) else set()
    absent = [s for s in seeds if not all((arm, s) in pairs for arm in FT_ARMS)]
    if absent:
        return f"missing: {len(seeds) - len(absent)} of {len(seeds)} fine-tuning pairs"
    diffs = paired_differences(have, model, FT_TASK, "drop1", "auc")
    return diffs[diffs.index.isin(seeds)]


def seed0_values(member: Member, root: Path = ROOT) -> dict:
    """The shipped model's quantities from the single-seed analyses' committed files."""
    s = member.seed0
    run = root / s.measures / "runs" / s.run / "meta.json"
    meta = json.loads(run.read_text(encoding="utf-8"))
    ratios = pd.read_csv(root / s.measures / "reports" / s.run / "tables" / "role_ratios.csv")
    layer = meta["num_layers"] - 1
    row = ratios[(ratios.role == "context") & (ratios.reference == "loss") & (ratios.layer == layer)].iloc[0]
    values = {"ratio": estimate(row.ratio, row.ci_low, row.ci_high)}
    pressure = pd.read_csv(root / s.pressure)
    last = pressure[(pressure.model == s.pressure_label) & pressure.last_block.astype(bool)].set_index("sublayer")
    for sub in PRESSURE_SUBLAYERS:
        values[f"pressure {sub}"] = estimate(*last.loc[sub, ["pressure", "ci_low", "ci_high"]])
    summaries = root / s.summaries
    if not summaries.is_file():  # a member's Part 3 not yet summarised (its report not run)
        values["drop1 - full"] = f"missing: no {relative(summaries)}"
        return values
    diffs = drop1_diffs(pd.read_csv(summaries), s.model, FT_SEEDS)
    values["drop1 - full"] = diffs if isinstance(diffs, str) else contrast(diffs)
    return values


def new_seed_values(job: Job, out: Path, summaries: pd.DataFrame) -> dict:
    """A trained seed's quantities: its measures file and its fine-tuning runs (reasons where missing)."""
    path = Path(out) / "measures" / f"{job.name}.json"
    if path.is_file():
        m = json.loads(path.read_text(encoding="utf-8"))
        r = m["ratio_after_second_to_last_block"]
        values = {"ratio": estimate(r["ratio"], r["ci_low"], r["ci_high"])}
        for sub in PRESSURE_SUBLAYERS:
            p = m["last_block_pressure"][sub]
            values[f"pressure {sub}"] = estimate(p["pressure"], p["ci_low"], p["ci_high"])
    else:
        values = {q: f"missing: no {relative(path)}" for q in QUANTITIES if q != "drop1 - full"}
    diffs = drop1_diffs(summaries, job.name, FT_SEEDS)
    values["drop1 - full"] = diffs if isinstance(diffs, str) else contrast(diffs)
    return values


def finetune_summaries(out: Path) -> pd.DataFrame:
    """Per-run AUCs of the committed runs under ``out/finetune`` (empty while there are none)."""
    folder = Path(out) / "finetune"
    return run_summaries(folder) if any((folder / "runs").glob("*/result.json")) else pd.DataFrame()


def collect(out: Path = OUT, root: Path = ROOT) -> Values:
    """Every (member, seed)'s quantities; an unconfigured member's cells say why they are missing."""
    summaries, values = finetune_summaries(out), {}
    for label, member in MEMBERS.items():
        for seed in ALL_SEEDS:
            if not member.configured:
                values[label, seed] = {q: "missing: not configured yet" for q in QUANTITIES}
            elif seed == 0:
                values[label, seed] = seed0_values(member, root)
            else:
                values[label, seed] = new_seed_values(Job(member, seed), out, summaries)
    return values


def spread(values: Values, label: str, quantity: str) -> tuple[float, float] | str:
    """(range, SD) of ``quantity`` over the member's three seeds, or how many are present."""
    present = [values[label, s][quantity]["value"] for s in ALL_SEEDS if isinstance(values[label, s][quantity], dict)]
    if len(present) < len(ALL_SEEDS):
        return f"needs all three seeds ({len(present)} present)"
    return float(np.ptp(present)), float(np.std(present, ddof=1))


def finding_at(finding: Finding, values: Values, seed: int) -> dict | None:
    """The finding's quantity at ``seed`` (value and, for fine-tuning contrasts, the paired p); None if missing."""
    cells = [values[label, seed][finding.quantity] for _, label in finding.terms]
    if any(isinstance(c, str) for c in cells):
        return None
    if "diffs" in cells[0]:  # paired over fine-tuning seeds: the contrast of the combined differences
        combined = sum(k * c["diffs"] for (k, _), c in zip(finding.terms, cells)).dropna()
        return contrast(combined) if len(finding.terms) > 1 else cells[0]
    return estimate(sum(k * c["value"] for (k, _), c in zip(finding.terms, cells)))


def verdict(finding: Finding, at: dict[int, dict | None]) -> str:
    """The plan's survival rule on the seeds present; missing seeds decide nothing."""
    if finding.sign == 0:
        return "not judged: a null result (the rule judges signs and significant contrasts)"
    present = {s: a for s, a in at.items() if a is not None}
    missing = [s for s in ALL_SEEDS if s not in present]
    flipped = [s for s, a in present.items() if not finding.sign * a["value"] > 0]
    if flipped:
        return f"does not survive: the sign flips at seed {', '.join(map(str, flipped))}"
    weak = [s for s, a in present.items() if finding.significance and not a["p"] < 0.05]
    if len(weak) >= 2:
        return f"does not survive: p >= 0.05 at seeds {', '.join(map(str, weak))}"
    if missing:
        return f"open: seed {', '.join(map(str, missing))} missing (the seeds present hold)"
    return "survives"


def fmt(cell: dict | str, quantity: str) -> str:
    if isinstance(cell, str):
        return cell
    places, sign = (4, "+") if quantity == "drop1 - full" else (3, "")
    text = f"{cell['value']:{sign}.{places}f}"
    if not math.isnan(cell["ci_low"]):
        text += f" [{cell['ci_low']:{sign}.{places}f}, {cell['ci_high']:{sign}.{places}f}]"
    return text


def tables(values: Values) -> tuple[str, pd.DataFrame]:
    """seeds.md's text and seeds.csv's tidy rows (kind seed / spread / finding)."""
    rows, quantities = [], list(QUANTITIES)
    lines = ["# Pretraining seeds: Part 1's measures and Part 3's drop1 - full, three seeds per member", "",
             ("Written by `python -m analyses.objectives.seeds_table` from the committed files "
              "(`tests/analyses/test_pretraining_seeds.py` recomputes it); the plan: "
              f"`{PLAN}`, \"Afterwards\". Seed 0: the shipped model, from `figures/objectives/measures`, "
              "`figures/objectives/pressure/pressure.csv` and `figures/objectives/finetune/run_summaries_lr1e-4.csv`; "
              "seeds 1 and 2: `measures/*.json` and `finetune/runs/` beside this file (the command of each: "
              "`commands.md`). Intervals: 95%, bootstrap over sequences (Part 1), paired t over the fine-tuning "
              f"seeds {FT_SEEDS[0]}-{FT_SEEDS[-1]} (Part 3)."), "",
             "| member | seed | " + " | ".join(QUANTITIES.values()) + " | p (drop1 - full) |",
             "|---|---|" + "---|" * (len(quantities) + 1)]
    for (label, seed), cells in values.items():
        d = cells["drop1 - full"]
        p = f"{d['p']:.3g} ({d['n']} pairs)" if isinstance(d, dict) else "-"
        lines.append(f"| {label} | {seed} | " + " | ".join(fmt(cells[q], q) for q in quantities) + f" | {p} |")
        for q in quantities:
            c = cells[q]
            rows.append({"kind": "seed", "member": label, "seed": seed, "quantity": q,
                         **({k: c[k] for k in ("value", "ci_low", "ci_high", "p", "n")} if isinstance(c, dict)
                            else {"note": c})})
    lines += ["", "## Spread over the three pretraining seeds (range, SD)", "",
              "| member | quantity | seed 0 | seed 1 | seed 2 | range | SD |", "|---|---|---|---|---|---|---|"]
    for label in MEMBERS:
        for q in quantities:
            s = spread(values, label, q)
            cells = " | ".join(fmt(values[label, seed][q], q) for seed in ALL_SEEDS)
            tail = s if isinstance(s, str) else f"{s[0]:.4f} | {s[1]:.4f}"
            lines.append(f"| {label} | {q} | {cells} | {tail} |" + (" |" if isinstance(s, str) else ""))
            rows.append({"kind": "spread", "member": label, "quantity": q,
                         **({"note": s} if isinstance(s, str) else {"range": s[0], "sd": s[1]})})
    lines += ["", "## Do the findings survive the pretraining seeds?", "",
              ("The plan's rule: the sign holds at all three seeds of every model named and, for a significance-based "
               "finding, p < 0.05 (two-sided, paired over fine-tuning seeds) at two of the three. Two members are "
               "compared at the same seed. The diffusion member's are the second member's (issue 60)."), "",
              "| finding | where stated | checked quantity | expected | seed 0 | seed 1 | seed 2 | verdict |",
              "|---|---|---|---|---|---|---|---|"]
    for f in FINDINGS:
        at = {s: finding_at(f, values, s) for s in ALL_SEEDS}
        quantity = " ".join(f"{k:+g} x {label}" for k, label in f.terms) + f", {f.quantity}"
        expected = {1: "> 0", -1: "< 0", 0: "none"}[f.sign] + (", p < 0.05" if f.significance and f.sign else "")
        shown = [("missing" if a is None else fmt(a, f.quantity) + (f" (p {a['p']:.3g})" if f.significance else ""))
                 for a in at.values()]
        v = verdict(f, at)
        lines.append(f"| {f.claim} | {f.stated} | {quantity} | {expected} | " + " | ".join(shown) + f" | {v} |")
        rows += [{"kind": "finding", "finding": f.key, "seed": s, "quantity": quantity, "verdict": v,
                  **({} if a is None else {k: a[k] for k in ("value", "ci_low", "ci_high", "p", "n")}),
                  **({"note": "missing"} if a is None else {})} for s, a in at.items()]
    return "\n".join(lines) + "\n", pd.DataFrame(rows)


def write(out: Path = OUT, root: Path = ROOT) -> tuple[Path, Path]:
    text, frame = tables(collect(out, root))
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "seeds.md").write_text(text, encoding="utf-8")
    frame.to_csv(Path(out) / "seeds.csv", index=False, float_format="%.6g")
    return Path(out) / "seeds.md", Path(out) / "seeds.csv"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"default {relative(OUT)}")
    args = parser.parse_args(argv)
    for path in write(ROOT / args.out):
        print(f"wrote {relative(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
