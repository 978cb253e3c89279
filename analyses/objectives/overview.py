"""Issue 52 per objective: every measure of ``figures/objectives/plan.md`` for each of the four 6-block models in
one table, each number with its 95% CI, read from the committed tables of Parts 1-4.

    python -m analyses.objectives.overview  # -> figures/objectives/overview.{csv,md}

Rows are measures, columns the four models (mini-en, the twin, mask40, the diffusion member):

- Part 1 (``figures/objectives/{measures,pressure}``): the last block's sublayers with exactly zero context signal
  under the model's own objective (its report), ``gradflow check``'s skippable share, the context / loss
  gradient-norm ratio at every depth (bootstrap CI over sequences), the last block's counterfactual pressure;
- Part 2 (``figures/probes/robustness`` for mini-en and the twin, ``figures/objectives/probes`` for the others):
  the robustness rule's verdict and the last-layer drop at 4,500 sentences, logistic and MLP, both Brown tasks;
- Parts 3-4 (``figures/objectives/finetune/run_summaries_*.csv``): each arm minus ``full`` in validation AUC,
  paired by seed (t interval), at lr 1e-4 (both tasks, seeds 0-9) and lr 1e-5 (brown-pos, the pilot's n seeds),
  with the Holm-adjusted p of the family that tests it (the 6-block experiment's for mini-en, Family A for the new
  models, Family B at lr 1e-5; the twin's lr 1e-4 contrast is in no family: uncorrected p).

The lr 1e-5 rows wait for Family B (``family_b.csv``): before all its runs are in they say so.

Whether a model learned is a measurement, not its name (issue 59; the rule is ``analyses.objectives.stage``'s, which
the other tables of the results page use too): a model whose last validation top-1 at BERT 15%
(``figures/objectives/pretraining_curves.csv``) is not above ``LEFT_UNIGRAM_TOP1`` did not leave the unigram stage.
Its column is marked ``†`` in every cell, with a footnote giving its top-1, and none of its contrasts is bold; the
csv's ``learned`` column says the same per row.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

from analyses.last_block_finetuning.powered_report import METRIC, paired_differences
from analyses.objectives import measures
from analyses.objectives import stage as stage_rule
from analyses.objectives.measures import relative
from analyses.objectives.design import ALL_MODELS, LR1E4_SEEDS, ROOT
from analyses.objectives.report import read_decision
from analyses.objectives.stage import CURVES, LEFT_UNIGRAM_TOP1, UNLEARNED, Stage
from analyses.probes.robustness import verdict
from gradflow.analysis.experiment_stats import paired_test

LABELS = dict(zip(ALL_MODELS, ("mini-en", "twin", "mask40", "diffusion")))  # model -> the measures' label
HEADINGS = {"mini-en": "mini-en (BERT 15%)", "twin": "twin (all-token)", "mask40": "mask40 (BERT 40%)",
            "diffusion": "diffusion (masked diffusion)"}
MEASURES, PRESSURE = ROOT / "figures/objectives/measures", ROOT / "figures/objectives/pressure"
PROBES = {"mini-en": ROOT / "figures/probes/robustness", "twin": ROOT / "figures/probes/robustness",
          "mask40": ROOT / "figures/objectives/probes", "diffusion": ROOT / "figures/objectives/probes"}
FINETUNE = ROOT / "figures/objectives/finetune"
POWERED = ROOT / "figures/finetune/last-block-finetuning/contrasts.csv"  # mini-en's lr 1e-4 contrasts (Holm, m = 14)
OUT = ROOT / "figures/objectives"
PRESSURE_SUBLAYERS = ("attn.q", "ffn.in")
PROBE_FAMILIES, PROBE_SIZE = ["logistic", "mlp"], "4500"
ARMS = {"lr 1e-4": ("drop1", "reinit1", "repair1"), "lr 1e-5": ("drop1", "reinit1")}


def stages(curves: Path = CURVES) -> dict[str, Stage]:
    """Each model's :class:`Stage` (``analyses.objectives.stage``: the rule) by the measures' label."""
    by_model = stage_rule.stages(curves)
    return {label: by_model[model] for model, label in LABELS.items()}


@dataclass(frozen=True)
class Row:
    """One measure of one model: a number with its 95% CI, or a text, and the Holm-adjusted p where one exists."""

    part: str
    measure: str
    model: str
    mean: float = math.nan
    ci_low: float = math.nan
    ci_high: float = math.nan
    text: str = ""
    p_holm: float = math.nan
    digits: int = 3


def zero_rows(measures_dir: Path = MEASURES) -> list[Row]:
    """The last block's exact-zero set under each own objective (as many sublayers as ``mean``) and check's share."""
    rows = []
    for run in measures.COMPARES["own"]:
        zero = measures.last_block_zero(measures_dir, run)
        rows.append(Row("1", "last block: sublayers exactly zero from context (own objective)", run.label,
                        mean=len(zero), text=", ".join(zero) or "none"))
    for label in LABELS.values():
        share = measures.check_result(measures_dir, label)["flops"]["share"]
        rows.append(Row("1", "`gradflow check`: skippable share (%), own masking, loss at the selected positions", label, mean=100 * share,
                        digits=2))
    return rows


def ratio_rows(measures_dir: Path = MEASURES) -> list[Row]:
    """The context / loss gradient-norm ratio at every depth under each own objective, with its bootstrap CI."""
    own = measures.COMPARES["own"]
    tables = {run.name: pd.read_csv(measures_dir / "reports" / run.name / "tables" / "role_ratios.csv") for run in own}
    rows = []
    for layer in measures.LAYERS:
        for run in own:
            t = tables[run.name]
            r = t[(t.role == "context") & (t.reference == "loss") & (t.layer == layer)].iloc[0]
            rows.append(Row("1", f"context / loss ratio, layer {layer}", run.label, r.ratio, r.ci_low, r.ci_high))
    return rows


def pressure_rows(pressure_dir: Path = PRESSURE) -> list[Row]:
    """The last block's counterfactual context pressure (all-positions loss) of ``PRESSURE_SUBLAYERS``."""
    frame = pd.read_csv(pressure_dir / "pressure.csv")
    last = frame[frame.last_block.astype(bool)].set_index(["sublayer", "model"])
    return [Row("1", f"last block's pressure, {sub}", label, *last.loc[(sub, label), ["pressure", "ci_low", "ci_high"]])
            for sub in PRESSURE_SUBLAYERS for label in LABELS.values()]


def probe_rows(probes: dict[str, Path] = PROBES) -> list[Row]:
    """Per task: the robustness rule's verdict and the last-layer drop at 4,500 sentences per probe family."""
    frames = {folder: pd.read_csv(folder / "last_layer_drops.csv", dtype={"train_size": str})
              for folder in set(probes.values())}
    rows = []
    for task in METRIC:
        for label, folder in probes.items():
            frame = frames[folder]
            mine = frame[(frame.model == label) & (frame.task == task)]
            rows.append(Row("2", f"probe {task}: verdict", label,
                            text=verdict(mine, PROBE_FAMILIES, sorted(mine.train_size.unique(), key=int))))
            for family in PROBE_FAMILIES:
                r = mine[(mine.family == family) & (mine.train_size == PROBE_SIZE)].iloc[0]
                rows.append(Row("2", f"probe {task}: last - best earlier layer, {family} 4,500", label,
                                r.last_layer_drop, r.ci_low, r.ci_high, digits=4))
    return rows


def holm_p(tables: list[pd.DataFrame], contrast: str, task: str) -> float:
    """The Holm-adjusted p of ``contrast`` on ``task`` in the first of ``tables`` that has it (nan: none has)."""
    for table in tables:
        hit = table[(table.contrast == contrast) & (table.task == task)]
        if len(hit):
            return float(hit.p_holm.iloc[0])
    return math.nan


def contrast_row(summaries: pd.DataFrame, lr: str, model: str, task: str, arm: str, seeds: tuple[int, ...],
                 families: list[pd.DataFrame]) -> Row:
    """``arm - full`` in AUC for one model and task, paired over ``seeds``; 'not run' when an arm has no runs."""
    part, label, measure = "3" if lr == "lr 1e-4" else "4", LABELS[model], f"{lr}, {task}: {arm} - full (AUC)"
    d = paired_differences(summaries[summaries.seed.isin(seeds)], model, task, arm, "auc")
    if d.empty:
        return Row(part, measure, label, text="not run")
    t = paired_test(d.to_numpy())
    contrast = f"{model.replace('gradflow-', '')} {arm} - full"  # the families' name of it
    return Row(part, measure, label, t.mean, t.ci_low, t.ci_high, p_holm=holm_p(families, contrast, task), digits=4)


def finetune_rows(finetune: Path = FINETUNE, powered: Path = POWERED) -> list[Row]:
    """Each arm - full at lr 1e-4 (both tasks) and, once Family B is computed, at lr 1e-5 (brown-pos)."""
    lr4 = pd.read_csv(finetune / "run_summaries_lr1e-4.csv")
    mini = pd.read_csv(powered)
    families = [mini[mini.regime == "convergence"], pd.read_csv(finetune / "family_a.csv")]
    rows = [contrast_row(lr4, "lr 1e-4", model, task, arm, LR1E4_SEEDS, families)
            for task in METRIC for arm in ARMS["lr 1e-4"] for model in ALL_MODELS]
    measures_b = [f"lr 1e-5, brown-pos: {arm} - full (AUC)" for arm in ARMS["lr 1e-5"]]
    if not (finetune / "family_b.csv").is_file():
        return rows + [Row("4", m, LABELS[model], text="not yet (Family B incomplete)")
                       for m in measures_b for model in ALL_MODELS]
    seeds = tuple(range(int(read_decision(finetune)["n"])))  # Family B's seeds, as the report pairs them
    low, family_b = pd.read_csv(finetune / "run_summaries_seed-regime.csv"), pd.read_csv(finetune / "family_b.csv")
    rows += [contrast_row(low, "lr 1e-5", m, "brown-pos", arm, seeds, [family_b])
             for arm in ARMS["lr 1e-5"] for m in ALL_MODELS]
    return rows


def overview(measures_dir: Path = MEASURES, pressure_dir: Path = PRESSURE, probes: dict[str, Path] = PROBES,
             finetune: Path = FINETUNE, powered: Path = POWERED, curves: Path = CURVES) -> pd.DataFrame:
    """Every row of the overview, long format: part, measure, model, mean, ci_low, ci_high, text, p_holm, digits,
    learned (the model left the unigram stage: :func:`stages`). SystemExit naming what is missing (and the target
    that writes it) when a source table is not there."""
    needed = {curves: "objectives-ship", pressure_dir / "pressure.csv": "objectives-pressure",
              finetune / "run_summaries_lr1e-4.csv": "objectives-finetune-report",
              finetune / "family_a.csv": "objectives-finetune-report", powered: "powered-report",
              **{folder / "last_layer_drops.csv": "objectives-probes / probes-robustness" for folder in probes.values()},
              **{measures_dir / "reports" / run.name / "tables" / "role_ratios.csv": "objectives-measures"
                 for run in measures.COMPARES["own"]}}
    missing = [f"{relative(path)} (make -C analyses {target})" for path, target in needed.items() if not path.is_file()]
    if missing:
        raise SystemExit(f"the overview needs tables that are not there: {'; '.join(missing)}")
    rows = (zero_rows(measures_dir) + ratio_rows(measures_dir) + pressure_rows(pressure_dir) + probe_rows(probes)
            + finetune_rows(finetune, powered))
    table = pd.DataFrame([asdict(r) for r in rows])
    learned = {label: stage.learned for label, stage in stages(curves).items()}
    return table.assign(learned=table.model.map(learned))


def cell(r, learned: bool = True) -> str:
    """A number ``mean [low, high]`` (bold when its family's Holm p < 0.05 and the model learned), or the row's
    text; every cell of a model that did not learn carries ``UNLEARNED`` after its value."""
    mark = "" if learned else UNLEARNED
    if r.measure.startswith("last block:"):
        return f"{int(r.mean)}{mark}: {r.text}" if r.mean else f"none{mark}"
    if r.text:
        return r.text + mark
    if r.mean == 0 and r.ci_low == 0 and r.ci_high == 0:
        return f"0{mark} (exact)"
    signed = "+" if r.part != "1" else ""
    value = f"{r.mean:{signed}.{r.digits}f}"
    if math.isnan(r.ci_low):
        return value + mark
    value = f"**{value}**" if learned and r.p_holm < 0.05 else value
    return f"{value}{mark} [{r.ci_low:{signed}.{r.digits}f}, {r.ci_high:{signed}.{r.digits}f}]"


def unlearned_note(stage: Stage, learned: list[Stage]) -> str:
    """The footnote of a model that did not leave the unigram stage: its top-1, the rule, what its cells are."""
    reached = f"; the others were at {min(s.first_top1 for s in learned):.3f} or more at theirs" if learned else ""
    return (f"{UNLEARNED} {stage.model} did not leave the unigram stage: its validation top-1 at BERT 15% was "
            f"{stage.first_top1:.3f} at its first evaluation (step {stage.first_step:,}) and {stage.last_top1:.3f} at "
            f"its last (step {stage.last_step:,}), not above {LEFT_UNIGRAM_TOP1:.2f}, the rule for a model that learned "
            f"(`{stage.curves}`{reached}). Its cells describe a model that has not learned "
            "to use context, not masked diffusion as an objective, and none of them is bold whatever its p "
            "(plan deviation 1, `figures/objectives/plan.md`).")


def markdown(table: pd.DataFrame, stage: dict[str, Stage]) -> str:
    """One row per measure, one column per model (``UNLEARNED`` on the heading and cells of a model that did not
    learn, by ``table.learned``), the notes below; ``stage`` gives the footnotes' numbers."""
    labels = list(LABELS.values())
    learned = dict(zip(table.model, table.learned.astype(bool)))
    headings = [HEADINGS[m] + ("" if learned[m] else f", unigram stage {UNLEARNED}") for m in labels]
    lines = ["| part | measure | " + " | ".join(headings) + " |", "|---|---|" + "---|" * len(labels)]
    for (part, measure), sub in table.groupby(["part", "measure"], sort=False):
        by = {r.model: cell(r, bool(r.learned)) for r in sub.itertuples()}
        lines.append(f"| {part} | {measure} | " + " | ".join(by.get(m, "-") for m in labels) + " |")
    never = f" (never in a column marked {UNLEARNED})" if not all(learned.values()) else ""
    note = ("Bold: Holm-adjusted p < 0.05 in the family that tests the contrast (mini-en at lr 1e-4: the 6-block "
            "experiment's, m = 14; mask40 and diffusion: Family A, m = 12; lr 1e-5: Family B, m = 8), for a model "
            f"that learned{never}; the twin's lr 1e-4 contrast is in no family. Every "
            "interval is a 95% CI: bootstrap over sequences (Part 1), over test sentences (Part 2), paired t over "
            "fine-tuning seeds (Parts 3-4). Written by `python -m analyses.objectives.overview` from the committed "
            "tables of Parts 1-4.")
    notes = [unlearned_note(stage[m], [stage[k] for k in labels if learned[k]]) for m in labels if not learned[m]]
    return "\n".join(lines) + "\n\n" + "".join(n + "\n\n" for n in notes) + note + "\n"


def write_overview(out: Path = OUT, **sources) -> pd.DataFrame:
    """``out/overview.{csv,md}`` (``out`` created if missing: ``make ... OUT=new/folder``); returns the table."""
    table = overview(**sources)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "overview.csv", index=False, float_format="%.10g")
    stage = stages(sources.get("curves", CURVES))
    (out / "overview.md").write_text(markdown(table, stage), encoding="utf-8")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="where overview.{csv,md} go (default %(default)s)")
    args = parser.parse_args(argv)
    write_overview(args.out)
    print((args.out / "overview.md").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
