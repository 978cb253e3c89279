"""Issue 52's fine-tuning tables (``figures/objectives/plan.md``, Parts 3 and 4), recomputed from the committed
per-run files.

    python -m analyses.objectives.report [--out figures/objectives/finetune]

Reads ``<out>/lr1e-4/runs`` (the new models at lr 1e-4), ``figures/finetune/last-block-finetuning/convergence/runs``
(mini-en's and the twin's cells, reused: ``--convergence``), ``<out>/pilot/decision.json`` (S and n) and
``<out>/seed-regime/runs``, and writes into ``<out>``:

- ``run_summaries_lr1e-4.csv``, ``cells_lr1e-4.{csv,md}``: every lr 1e-4 run and cell of the four models (AUC,
  final test score, seconds);
- ``family_a.{csv,md}`` (Holm over 12, MDEs) and ``secondary.{csv,md}`` (the model contrasts, no correction);
- ``run_summaries_seed-regime.csv``, ``cells_seed-regime.{csv,md}``, ``family_b.{csv,md}`` (Holm over 8, MDEs,
  the lr 1e-4 value of each contrast beside it, and the plan's reading of the seed's claim);
- ``curves_{lr1e-4,seed-regime}.{csv,pdf,png}``: each arm's mean validation curve (``analyses.objectives.figures``).

A model that did not leave the unigram stage (``analyses.objectives.stage``: its last validation top-1 in
``figures/objectives/pretraining_curves.csv``, ``--curves``) has its name marked ``†`` in the label of each of its
rows in every ``.md`` table, none of them bold, and one footnote line under the table; the ``.csv`` files are not
marked.

A family whose cells lack a seed is not computed (Holm ranks all its contrasts together): its ``.md`` says so in
one sentence and its ``.csv`` is removed; a secondary contrast is computed once its own four cells are complete.
Runs of the seed regime whose validation steps are not 60, 120, ..., S are left out and named.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd

from analyses.last_block_finetuning.grid import collect
from analyses.last_block_finetuning.powered_report import (
    METRIC,
    cells,
    cells_markdown,
    interval,
    run_summaries,
    write_markdown,
)
from analyses.objectives.contrasts import FAMILY_B, at_lr1e4, family_a, family_b, secondary, seeds_claim, short
from analyses.objectives.design import CONVERGENCE, EVAL_EVERY_LOW, MINI, NEW_MODELS, OUT, ROOT, TWIN
from analyses.objectives.figures import write_curves_lr1e4, write_curves_seed_regime
from analyses.objectives.stage import CURVES, Stage, footnotes, mark, stages


Collected = tuple[pd.DataFrame, pd.DataFrame]  # grid.collect's (curves, finals) of one regime's runs
NO_RUNS = ["model", "arm", "task", "seed", "run_id", "auc", "test"]  # the columns of a regime with no finished run
Stages = dict[str, Stage]  # model name -> its stage (analyses.objectives.stage.stages)


def name(model: str, stage: Stages) -> str:
    """``model``'s short name as a row label, marked when it did not leave the unigram stage."""
    return mark(short(model), stage[model].learned if model in stage else True)


def add_footnotes(path: Path, models, stage: Stages) -> None:
    """One line under the table of ``path`` for each of ``models`` that did not learn (none when all did)."""
    notes = footnotes(models, stage=stage)
    if notes:
        with path.open("a", encoding="utf-8") as handle:
            handle.write("\n" + "\n".join(notes) + "\n")


def read_runs(regime_dir: Path) -> Collected | None:
    """``collect(regime_dir)``: every finished run under ``regime_dir/runs`` read once; None when there is none."""
    return collect(regime_dir) if any((regime_dir / "runs").glob("*/result.json")) else None


def summaries_of(regime_dir: Path, collected: Collected | None = None) -> pd.DataFrame:
    """``run_summaries`` of the finished runs under ``regime_dir/runs`` (empty when there are none); ``collected``:
    the runs when the caller has read them already."""
    collected = collected if collected is not None else read_runs(regime_dir)
    if collected is None:
        return pd.DataFrame(columns=NO_RUNS)
    return run_summaries(regime_dir, collected)


def lr1e4_summaries(out: Path, convergence: Path = CONVERGENCE, new_runs: Collected | None = None,
                    also: Path | None = None) -> pd.DataFrame:
    """The four models' lr 1e-4 runs: mini-en's and the twin's committed ones, the new models' from ``out``
    (``new_runs``: those runs when the caller has read them already), and from ``also`` (another experiment's
    ``lr1e-4`` folder) those of a new model that ``out`` has no run of: a folder holding one member's runs (the first
    diffusion member's in figures/objectives/diffusion-v1, as the second's while it was staged) borrows mask40's runs
    from the study."""
    old, new = summaries_of(convergence), summaries_of(out / "lr1e-4", new_runs)
    borrowed = summaries_of(also) if also is not None else pd.DataFrame(columns=NO_RUNS)
    if not borrowed.empty:
        borrowed = borrowed[~borrowed.model.isin(set(new.model))]
        new = pd.concat([p for p in (new, borrowed) if not p.empty], ignore_index=True)
    parts = [p for p in (old[old.model.isin((MINI, TWIN))], new[new.model.isin(NEW_MODELS)]) if not p.empty]
    return pd.concat(parts, ignore_index=True) if parts else new


def off_schedule(regime_dir: Path, steps: int, curves: pd.DataFrame | None = None) -> list[str]:
    """The finished runs under ``regime_dir`` whose validation steps are not 60, 120, ..., ``steps`` (``curves``:
    their ``collect`` curves when the caller has read them already)."""
    if curves is None:
        collected = read_runs(regime_dir)
        if collected is None:
            return []
        curves = collected[0]
    expected = list(range(EVAL_EVERY_LOW, steps + 1, EVAL_EVERY_LOW))
    val = curves[(curves.split == "validation") & (curves.metric == curves.task.map(METRIC))]
    found = val.groupby("run_id")["step"].apply(lambda s: sorted(s.tolist()))
    return sorted(run_id for run_id in curves.run_id.unique() if found.get(run_id, []) != expected)


def refuse(out: Path, name: str, sentence: str) -> None:
    """``name``.md is the one sentence; a stale ``name``.csv is removed."""
    (out / f"{name}.md").write_text(sentence + "\n", encoding="utf-8")
    (out / f"{name}.csv").unlink(missing_ok=True)
    print(sentence)


def mde(r: tuple) -> str:
    """The MDE cell of a tested row: ``-`` for a significant contrast."""
    return "-" if math.isnan(r.mde_alpha05) else f"{r.mde_alpha05:.4f} / {r.mde_bonferroni:.4f}"


def write_cells(out: Path, summaries: pd.DataFrame, label: str, stage: Stages | None = None) -> None:
    """``run_summaries_<label>.csv`` and ``cells_<label>.{csv,md}`` (``stage`` marks the ``.md``'s model labels;
    default: the committed curves')."""
    stage = stages() if stage is None else stage
    summaries.to_csv(out / f"run_summaries_{label}.csv", index=False, float_format="%.6g")
    if summaries.empty:
        return
    table = cells(summaries)
    table.to_csv(out / f"cells_{label}.csv", index=False, float_format="%.6g")
    labelled = table.assign(model=[name(m, stage) for m in table.model])
    (out / f"cells_{label}.md").write_text(cells_markdown(labelled), encoding="utf-8")
    add_footnotes(out / f"cells_{label}.md", table.model, stage)


def write_lr1e4(out: Path, summaries: pd.DataFrame, stage: Stages | None = None) -> list[str]:
    """Family A and the secondary contrasts into ``out`` (``stage`` marks the ``.md`` labels); returns the sentences
    of what was not computed."""
    stage = stages() if stage is None else stage
    notes = []
    try:
        table = family_a(summaries)
    except ValueError as err:
        refuse(out, "family_a", str(err))
        notes.append(str(err))
    else:
        table.to_csv(out / "family_a.csv", index=False, float_format="%.6g")
        write_markdown(out / "family_a.md", ["contrast", "task", "mean difference in AUC [95% CI]", "n", "p",
                                              "p (Holm, m = 12)", "MDE at 80% power (alpha .05 / .05/12)"],
                       [[f"{name(r.model, stage)} {r.arm} - full", r.task, interval(r), r.n_pairs, f"{r.p:.3g}",
                         f"{r.p_holm:.3g}", mde(r)] for r in table.itertuples()])
        add_footnotes(out / "family_a.md", table.model, stage)
    table = secondary(summaries)
    table.to_csv(out / "secondary.csv", index=False, float_format="%.6g")
    rows = [[f"({name(r.model, stage)} drop1 - full) - ({name(MINI, stage)} drop1 - full)", r.task,
             interval(r) if r.computed else r.note, r.n_pairs,
             f"{r.p:.3g}" if r.computed else "-",
             "-" if not r.computed or math.isnan(r.mde_alpha05) else f"{r.mde_alpha05:.4f}"]
            for r in table.itertuples()]
    write_markdown(out / "secondary.md", ["model contrast (secondary, no correction)", "task",
                                           "mean difference in AUC [95% CI]", "n", "p", "MDE (alpha .05)"], rows)
    add_footnotes(out / "secondary.md", [*table.model, MINI], stage)
    notes += [f"{r.contrast}, {r.task}: {r.note}." for r in table.itertuples() if not r.computed]
    return notes


def read_decision(out: Path) -> dict | None:
    """The pilot's ``decision.json`` (S, n), or None before the pilot's decision."""
    path = out / "pilot" / "decision.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def seed_regime_summaries(out: Path, steps: int, collected: Collected | None = None) -> tuple[pd.DataFrame, list[str]]:
    """(run summaries of ``out/seed-regime`` on S = ``steps``'s schedule, the run ids left out as off it);
    ``collected``: those runs when the caller has read them already."""
    regime = out / "seed-regime"
    collected = collected if collected is not None else read_runs(regime)
    if collected is None:
        return pd.DataFrame(columns=NO_RUNS), []
    stray = off_schedule(regime, steps, collected[0])
    summaries = summaries_of(regime, collected)
    return (summaries[~summaries.run_id.isin(stray)] if not summaries.empty else summaries), stray


def write_seed_regime(out: Path, lr_summaries: pd.DataFrame, stage: Stages | None = None) -> list[str]:
    """Family B (and the seed regime's cells) into ``out`` (``stage`` marks the ``.md`` labels); returns the
    sentences of what was not computed."""
    stage = stages() if stage is None else stage
    decision = read_decision(out)
    if decision is None:
        sentence = ("Family B is not computed yet: the pilot's decision (S and n, "
                    f"{(out / 'pilot' / 'decision.json').relative_to(out)}) is not there.")
        refuse(out, "family_b", sentence)
        return [sentence]
    steps, seeds = int(decision["S"]), tuple(range(int(decision["n"])))
    runs = read_runs(out / "seed-regime")
    summaries, stray = seed_regime_summaries(out, steps, runs)
    write_cells(out, summaries, "seed-regime", stage)
    if runs is not None:
        write_curves_seed_regime(out / "seed-regime", out, steps, runs[0])
    notes = [f"Left out of Family B, their validation steps are not 60..{steps}: {', '.join(stray)}."] if stray \
        else []
    try:
        table = family_b(summaries, seeds)
    except ValueError as err:
        refuse(out, "family_b", str(err))
        return [*notes, str(err)]
    table["at_lr1e4"] = [at_lr1e4(lr_summaries, r.model, r.arm) for r in table.itertuples()]
    table["steps"] = steps
    table.to_csv(out / "family_b.csv", index=False, float_format="%.6g")
    write_markdown(out / "family_b.md", ["contrast (brown-pos, lr 1e-5)",
                                         f"mean difference in AUC 60..{steps} [95% CI]", "n", "p",
                                         f"p (Holm, m = {FAMILY_B})",
                                         f"MDE at 80% power (alpha .05 / .05/{FAMILY_B})",
                                         "the same contrast at lr 1e-4 (AUC 15..120)"],
                   [[f"{name(r.model, stage)} {r.arm} - full", interval(r), r.n_pairs, f"{r.p:.3g}",
                     f"{r.p_holm:.3g}", mde(r), r.at_lr1e4] for r in table.itertuples()])
    add_footnotes(out / "family_b.md", table.model, stage)
    claim = seeds_claim(table)
    with (out / "family_b.md").open("a", encoding="utf-8") as handle:
        handle.write("\n" + claim + "\n")
    print(claim)
    return notes


def write_report(out: Path = OUT, convergence: Path = CONVERGENCE, curves: Path = CURVES,
                 also: Path | None = None) -> list[str]:
    """Every table of Parts 3 and 4 into ``out``, a model that did not learn by ``curves`` marked in the ``.md``
    labels (``also``: :func:`lr1e4_summaries`'s); returns (and prints) the sentences of what was not computed."""
    stage = stages(curves)
    out.mkdir(parents=True, exist_ok=True)
    new_runs = read_runs(out / "lr1e-4")
    lr = lr1e4_summaries(out, convergence, new_runs, also)
    write_cells(out, lr, "lr1e-4", stage)
    if new_runs is not None:
        write_curves_lr1e4(out / "lr1e-4", out, new_runs[0])
    notes = write_lr1e4(out, lr, stage) + write_seed_regime(out, lr, stage)
    for note in notes:
        print(f"note: {note}")
    return notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"the experiment folder (default "
                        f"{OUT.relative_to(ROOT)})")
    parser.add_argument("--convergence", type=Path, default=CONVERGENCE,
                        help="mini-en's and the twin's committed lr 1e-4 runs (default %(default)s)")
    parser.add_argument("--curves", type=Path, default=CURVES,
                        help="the pretraining curves that say which model learned (default %(default)s)")
    parser.add_argument("--also-lr1e-4", type=Path, default=None, metavar="DIR",
                        help="another experiment's lr1e-4 folder: its runs of a new model that --out has none of")
    args = parser.parse_args(argv)
    write_report(args.out, args.convergence, args.curves, args.also_lr1e_4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
