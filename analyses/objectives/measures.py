"""Issue 52, plan Part 1 (``figures/objectives/plan.md``), measures 1 and 2: where the training signal goes.

    python -m analyses.objectives.measures [--out figures/objectives/measures] [--threads 1] [--force]
    python -m analyses.objectives.measures --summary-only   # summary.md again from the committed files

Records the four 6-block models on the committed sample (seed 0) under each one's own objective and under BERT
15% (the yardstick; mini-en's own objective is the yardstick, one run serves both), and the diffusion model also
on the grid t = 0.1, ..., 1.0; reports every run (``reports/<run>``), compares the own-objective runs and the BERT-15%
runs (``compare/own``, ``compare/bert15``), checks each model under its own objective (``check/<model>.{txt,json}``;
``gradflow check`` has no loss option, so the twin is checked under BERT 15% at the selected positions), and writes
``summary.md`` from those files and measure 3's table (``figures/objectives/pressure/pressure.csv``, ``make -C
analyses objectives-pressure``). Full runs are scratch, not committed (``runs/objectives-<run>`` in the clone at the
committed location, else ``OUT/scratch/<run>``); ``OUT/runs/<run>`` keeps their small files. A finished scratch run
is not recorded again (``--force`` records it anew). Every command's wall and CPU time go into ``OUT/meta.json``.

The exact-zero set is a theorem for a loss at the selected positions only (every run but the twin's all-positions
one): a measured last-block set that differs from it (or a nonempty set under the all-positions loss, or a
disagreement of ``gradflow check``) stops the script with exit 1 before the summary: a defect, not a finding.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analyses.objectives.stage import CURVES, Stage, footnotes, mark, stages
from gradflow.formatting import fixed_column, masking_label

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = "figures/objectives/measures"
DEFAULT_PRESSURE = "figures/objectives/pressure"
MODELS = {"mini-en": "gradflow-mini-en", "twin": "gradflow-mini-en-alltoken", "mask40": "gradflow-mini-en-mask40",
          "diffusion": "gradflow-mini-en-diffusion"}
GRID = "0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0"
KEEP = ("meta.json", "channels.csv", "sublayers.csv", "mask_ratios.parquet")  # the small files of a run
LAYERS = range(7)  # the embeddings output (0) and the six block outputs
UNIGRAM = ("predicts unigram frequencies (plan deviation 1): the gradient flow of a model that has not learned to use "
           "context; no difference from the others can be attributed to the objective alone")


@dataclass(frozen=True)
class Run:
    """One ``gradflow record`` run: its name, model label, its place (own objective, yardstick) and record options."""

    name: str
    label: str
    own: bool
    yardstick: bool
    args: tuple[str, ...] = ()


RUNS = (Run("mini-en_bert15", "mini-en", True, True),
        Run("twin_all-positions", "twin", True, False, ("--loss", "all-positions")),
        Run("twin_bert15", "twin", False, True),
        Run("mask40_bert40", "mask40", True, False, ("--mask-rate", "0.4")),
        Run("mask40_bert15", "mask40", False, True),
        Run("diffusion_diffusion", "diffusion", True, False, ("--objective", "diffusion")),
        Run("diffusion_bert15", "diffusion", False, True),
        Run("diffusion_grid", "diffusion", False, False, ("--objective", "diffusion", "--mask-ratios", GRID)))
GRID_RUN = "diffusion_grid"
CHECKS = {"mini-en": (), "twin": (), "mask40": ("--mask-rate", "0.4"), "diffusion": ("--objective", "diffusion")}
COMPARES = {"own": [r for r in RUNS if r.own], "bert15": [r for r in RUNS if r.yardstick]}


def relative(path: Path) -> str:
    """``path`` relative to the repository root when inside it, else absolute."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def scratch(run: Run, out: Path) -> Path:
    """Where ``run`` is recorded in full: ``runs/objectives-<name>`` at the committed location, else under ``out``."""
    if Path(out).resolve() == (ROOT / DEFAULT_OUT).resolve():
        return ROOT / "runs" / f"objectives-{run.name}"
    return Path(out) / "scratch" / run.name


def gradflow(args: list[str], threads: int, stdout: Path | None = None) -> dict:
    """Run ``python -m gradflow ARGS`` from the root with ``threads`` torch threads; its command, wall and CPU s."""
    command = [sys.executable, "-m", "gradflow", *args]
    print("+ gradflow", " ".join(args), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    if stdout is None:
        subprocess.run(command, cwd=ROOT, env=env, check=True)
    else:
        with open(stdout, "w", encoding="utf-8") as handle:
            subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=handle)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"command": "gradflow " + " ".join(args), "wall_s": round(time.perf_counter() - start, 1),
            "cpu_s": round(cpu, 1)}


def complete(run_dir: Path) -> bool:
    meta = run_dir / "meta.json"
    return meta.is_file() and bool(json.loads(meta.read_text(encoding="utf-8")).get("complete"))


def measure(out: Path, threads: int, force: bool, limit: int | None = None) -> dict[str, dict]:
    """Record, report, compare and check into ``out``; returns the steps run now (step -> command and times).
    ``limit``: record only that many windows (a smoke test; the committed runs have none)."""
    steps: dict[str, dict] = {}
    extra = ["--limit", str(limit)] if limit else []
    for run in RUNS:
        full = scratch(run, out)
        if force or not complete(full):
            steps[f"record {run.name}"] = gradflow(
                ["record", "--model", MODELS[run.label], "--seed", "0", *run.args, *extra, "--out", relative(full),
                 "--overwrite", "--quiet"], threads)
        (out / "runs" / run.name).mkdir(parents=True, exist_ok=True)
        for name in KEEP:
            if (full / name).is_file():
                shutil.copy2(full / name, out / "runs" / run.name / name)
        steps[f"report {run.name}"] = gradflow(["report", relative(full), "--out", relative(out / "reports" / run.name),
                                                "--format", "png"], threads)
    for name, runs in COMPARES.items():
        steps[f"compare {name}"] = gradflow(["compare", *(relative(scratch(r, out)) for r in runs), "--labels",
                                             *(r.label for r in runs), "--out", relative(out / "compare" / name),
                                             "--format", "png"], threads)
    (out / "check").mkdir(parents=True, exist_ok=True)
    for label, args in CHECKS.items():
        model = MODELS[label]
        for suffix, extra in (("txt", []), ("json", ["--json"])):
            steps[f"check {model} {suffix}"] = gradflow(["check", "--model", model, *args, *extra], threads,
                                                        stdout=out / "check" / f"{model}.{suffix}")
    return steps


def write_meta(out: Path, steps: dict[str, dict], threads: int) -> None:
    """Merge ``steps`` into ``out/meta.json`` (steps skipped now keep their earlier entries)."""
    path = out / "meta.json"
    meta = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {"steps": {}}
    meta["steps"].update(steps)
    meta.update(threads=threads, date=time.strftime("%Y-%m-%d %H:%M %Z"),
                command=f"python -m analyses.objectives.measures --out {relative(out)} --threads {threads}")
    path.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")


# ------------------------------------------------------------------ reading the committed files


def run_meta(out: Path, run: Run) -> dict:
    return json.loads((out / "runs" / run.name / "meta.json").read_text(encoding="utf-8"))


def objective(meta: dict) -> str:
    """The run's objective in words: its masking, and the all-positions loss where it applies."""
    text = masking_label(meta["masking"])
    return text + ", loss at every position" if meta["loss"] == "all-positions" else text


def last_block_zero(out: Path, run: Run) -> list[str]:
    """The last block's sublayers whose weight gets exactly zero context signal (the run's report)."""
    table = pd.read_csv(out / "reports" / run.name / "tables" / "last_block.csv")
    return list(table.loc[table["exact_zero"].astype(bool), "sublayer"])


def check_result(out: Path, label: str) -> dict:
    return json.loads((out / "check" / f"{MODELS[label]}.json").read_text(encoding="utf-8"))


def check_zero(result: dict) -> list[str]:
    """The last block's sublayers that ``gradflow check`` flags (context exactly 0, loss roles nonzero)."""
    last = result["num_blocks"]
    return [s["sublayer"] for s in result["sublayers"] if s["layer"] == last and s["flagged"]]


def defects(out: Path) -> list[str]:
    """Where a measured exact-zero set disagrees with the theory (empty when none)."""
    found = []
    for run in RUNS:
        meta, measured = run_meta(out, run), last_block_zero(out, run)
        theory = [] if meta["loss"] == "all-positions" else list(meta["after_mixing_sublayers"])
        if sorted(measured) != sorted(theory):
            found.append(f"{run.name}: last block exact zero {measured or 'none'}, theory {theory or 'none'}")
    for label, model in MODELS.items():
        result = check_result(out, label)
        found += [f"check {model}: layer {d['layer']} {d['sublayer']} theory "
                  f"{'zero' if d['expected_zero'] else 'nonzero'}, measured {'zero' if d['measured_zero'] else 'nonzero'}"
                  for d in result["theory"]["agreements"] if d["expected_zero"] != d["measured_zero"]]
    return found


Stages = dict[str, Stage]  # model name -> its stage (analyses.objectives.stage.stages)


def learned(label: str, stage: Stages) -> bool:
    """Whether the model ``label`` left the unigram stage by ``stage`` (a model without a curve is not marked)."""
    return stage[MODELS[label]].learned if MODELS[label] in stage else True


def model_cell(label: str, stage: Stages) -> str:
    """``label`` as a row or column label: marked, and why, when the model did not leave the unigram stage."""
    return label if learned(label, stage) else f"{mark(label, False)} (predicts unigram frequencies: plan deviation 1)"


def note_lines(labels, stage: Stages) -> list[str]:
    """A blank line and the footnote of each of ``labels`` that did not learn (nothing when all did)."""
    notes = footnotes([MODELS[label] for label in labels], stage=stage)
    return ["", *notes] if notes else []


def ratio_lines(out: Path, stage: Stages) -> list[str]:
    """Measure 1: the context/loss ratio at every depth with its CI, one row per run (the grid run aside)."""
    runs = [r for r in RUNS if r.name != GRID_RUN]
    cells: dict[int, list[str]] = {}
    for layer in LAYERS:
        rows = []
        for run in runs:
            t = pd.read_csv(out / "reports" / run.name / "tables" / "role_ratios.csv")
            rows.append(t[(t["role"] == "context") & (t["reference"] == "loss") & (t["layer"] == layer)].iloc[0])
        cells[layer] = fixed_column([r["ratio"] for r in rows], [r["ci_low"] for r in rows],
                                    [r["ci_high"] for r in rows])
    lines = ["| model | objective | place | " + " | ".join(f"layer {k}" for k in LAYERS) + " |",
             "|---|---|---|" + "---|" * len(LAYERS)]
    for i, run in enumerate(runs):
        place = "own and yardstick" if run.own and run.yardstick else "own" if run.own else "yardstick"
        lines.append(f"| {model_cell(run.label, stage)} | {objective(run_meta(out, run))} | {place} | "
                     + " | ".join(cells[k][i] for k in LAYERS) + " |")
    return lines + note_lines([run.label for run in runs], stage)


def grid_lines(out: Path, stage: Stages) -> list[str]:
    """Measure 1, the diffusion model by t: the ratio at every depth per t of the grid (its report's table)."""
    t = pd.read_csv(out / "reports" / GRID_RUN / "tables" / "mask_ratio_profile.csv")
    mids = sorted(t["t_mid"].unique())
    cells = {k: fixed_column(*(list(t[t["layer"] == k].set_index("t_mid").reindex(mids)[c])
                               for c in ("ratio", "ci_low", "ci_high"))) for k in LAYERS}
    n = t[t["layer"] == 0].set_index("t_mid")["n_sequences"]
    label = next(r.label for r in RUNS if r.name == GRID_RUN)
    lines = [f"| t ({mark(label, learned(label, stage))}) | sequences | " + " | ".join(f"layer {k}" for k in LAYERS)
             + " |", "|---|---|" + "---|" * len(LAYERS)]
    lines += [f"| {m:g} | {int(n[m])} | " + " | ".join(cells[k][i] for k in LAYERS) + " |" for i, m in enumerate(mids)]
    return lines + note_lines([label], stage)


def zero_lines(out: Path, stage: Stages) -> list[str]:
    """Measure 2: the last block's exact-zero sublayers of every run, then check's set and skippable share."""
    lines = ["| model | objective | last block: sublayers with exactly zero context signal (report) | theory |",
             "|---|---|---|---|"]
    for run in RUNS:
        meta = run_meta(out, run)
        theory = "none (every position carries the loss)" if meta["loss"] == "all-positions" else \
            ", ".join(meta["after_mixing_sublayers"])
        lines.append(f"| {model_cell(run.label, stage)} | {objective(meta)} | "
                     f"{', '.join(last_block_zero(out, run)) or 'none'} | {theory} |")
    lines += note_lines([run.label for run in RUNS], stage)
    windows = check_result(out, "mini-en")["batch"]["sequences"]
    lines += ["", (f"| model | checked objective (`gradflow check`, {windows} windows) | last block flagged | disagreements | "
              "skippable share | with the last block's attention rows |"), "|---|---|---|---|---|---|"]
    for label in MODELS:
        result = check_result(out, label)
        masking = masking_label(result["batch"].get("masking", {"policy": "bert", "rate": 0.15}))
        agreements = result["theory"]["agreements"]
        wrong = sum(d["expected_zero"] != d["measured_zero"] for d in agreements)
        lines.append(f"| {model_cell(label, stage)} | {masking} | {', '.join(check_zero(result)) or 'none'} | "
                     f"{wrong} of {len(agreements)} | {100 * result['flops']['share']:.2f}% | "
                     f"{100 * result['flops']['share_with_attention']:.2f}% |")
    return lines + note_lines(MODELS, stage)


def pressure_lines(pressure: Path, stage: Stages) -> list[str]:
    """Measure 3: the last block's counterfactual pressure [95% CI] and its ratio to the earlier blocks, per model."""
    path = pressure / "pressure.csv"
    if not path.is_file():
        return [f"Not measured yet: `{relative(path)}` is missing (`make -C analyses objectives-pressure`)."]
    frame = pd.read_csv(path)
    last = {label: frame[(frame["model"] == label) & frame["last_block"]].set_index("sublayer") for label in MODELS}
    subs = list(last["mini-en"].index)
    lines = []
    for title, (v, lo, hi) in (("pressure", ("pressure", "ci_low", "ci_high")),
                               ("vs earlier blocks", ("vs_earlier", "vs_earlier_ci_low", "vs_earlier_ci_high"))):
        columns = [fixed_column(*(last[label].reindex(subs)[c] for c in (v, lo, hi))) for label in MODELS]
        lines += [f"| last-block sublayer ({title}) | " + " | ".join(model_cell(m, stage) for m in MODELS) + " |",
                  "|---|" + "---|" * len(MODELS)]
        lines += [f"| {sub} | " + " | ".join(c[k] for c in columns) + " |" for k, sub in enumerate(subs)]
        lines += note_lines(MODELS, stage) + [""]
    return lines[:-1]


def time_lines(out: Path) -> list[str]:
    """The commands and their measured wall and CPU seconds (``meta.json``)."""
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    lines = [f"{meta['threads']} torch thread(s) a command, one command at a time; last run {meta['date']}.", "",
             "| step | wall s | CPU s |", "|---|---|---|"]
    lines += [f"| {step} | {s['wall_s']:.1f} | {s['cpu_s']:.1f} |" for step, s in meta["steps"].items()]
    total = sum(s["wall_s"] for s in meta["steps"].values()), sum(s["cpu_s"] for s in meta["steps"].values())
    return lines + [f"| all | {total[0]:.1f} | {total[1]:.1f} |"]


def unigram_notes(stage: Stages) -> tuple[str, str]:
    """The summary's bold note and its short repeat on the diffusion model: both empty once it left the unigram stage
    by the curves (the second member, issue 60), else :data:`UNIGRAM` (the first)."""
    if learned("diffusion", stage):
        return "", ""
    return f"**The diffusion model {UNIGRAM}.**", f" The diffusion model {UNIGRAM}."


def summary_text(out: Path, pressure: Path, curves: Path = CURVES) -> str:
    """summary.md from the files in ``out`` and ``pressure`` (what the test recomputes); a model that did not leave
    the unigram stage by ``curves`` (``analyses.objectives.stage``) is marked in every table's labels."""
    stage = stages(curves)
    bold, repeat = unigram_notes(stage)
    first = run_meta(out, RUNS[0])
    lines = ["# Four objectives at six blocks: where the training signal goes (plan Part 1)", "",
             ("Written by `python -m analyses.objectives.measures` from the files beside it (runs on the committed "
             f"sample, seed {first['seed']}, {first['counts']['sequences_recorded']} windows of up to "
             f"{first['max_length']} tokens; `tests/analyses/test_objectives_measures.py` recomputes it). "
             f"Measure 3 from `{relative(pressure)}` (`make -C analyses objectives-pressure`)."), "",
             *([bold, ""] if bold else []),
             "## 1. Context / loss gradient-norm ratio by depth [95% CI]", "",
             ("Layer 0 is the embeddings output, layer k the output of block k (`reports/<run>/tables/role_ratios.csv`:"
             " context over the pooled loss positions, bootstrap over sequences). Own objective: the model's training "
             "objective; yardstick: BERT 15% (80/10/10) at the selected positions."), ""]
    lines += ratio_lines(out, stage)
    lines += ["", (f"The diffusion model by t (`--mask-ratios {GRID}`, sequence i at the (i mod 10)-th t; "
              f"`reports/{GRID_RUN}/tables/mask_ratio_profile.csv`; t = 1 masks every token, so it has no context "
              f"positions and no row).{repeat}"), ""]
    lines += grid_lines(out, stage)
    lines += ["", "## 2. Exact-zero sublayers of the last block; skippable compute", "",
              ("Per run, from its report (`reports/<run>/tables/last_block.csv`, the weight's context share exactly 0); "
              "theory: the sublayers after attention mixing (`meta.json`'s `after_mixing_sublayers`) for a loss at the "
              "selected positions, none for the all-positions loss."), ""]
    lines += zero_lines(out, stage)
    lines += ["", ("`gradflow check` (`check/<model>.{txt,json}`) has no loss option: the twin is checked under BERT "
              "15% at the selected positions (its corruption, mini-en's loss), where the theorem holds for any model; "
              "its own all-positions set is the report's row above."), "",
              "## 3. The last block's counterfactual pressure under the all-positions loss [95% CI]", "",
              ("BERT 15% corruption, the loss at every non-special position (`gradflow.analysis.pressure`: a context "
              "position's weight-gradient signal over a loss position's; vs earlier blocks: over the mean of blocks "
              f"1-{first['num_layers'] - 1}).{repeat}"), ""]
    lines += pressure_lines(pressure, stage)
    lines += ["", "## Commands and times (`meta.json`)", ""] + time_lines(out)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"relative to the repository root (default {DEFAULT_OUT})")
    parser.add_argument("--pressure", default=DEFAULT_PRESSURE, help="measure 3's folder (its pressure.csv)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads a command (default 1)")
    parser.add_argument("--force", action="store_true", help="record the finished runs again")
    parser.add_argument("--limit", type=int, default=None, help="windows a run (smoke tests only)")
    parser.add_argument("--summary-only", action="store_true", help="rewrite summary.md from the files in --out")
    parser.add_argument("--curves", default=relative(CURVES),
                        help="the pretraining curves that say which model learned (default: the study's)")
    args = parser.parse_args(argv)
    out, pressure = ROOT / args.out, ROOT / args.pressure
    if not args.summary_only:
        out.mkdir(parents=True, exist_ok=True)
        write_meta(out, measure(out, args.threads, args.force, args.limit), args.threads)
    found = defects(out)
    if found:
        print("DEFECT: a measured exact-zero set disagrees with the theory:\n  " + "\n  ".join(found), file=sys.stderr)
        return 1
    (out / "summary.md").write_text(summary_text(out, pressure, ROOT / args.curves), encoding="utf-8")
    print(f"wrote {relative(out / 'summary.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
