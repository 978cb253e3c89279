"""Issue 60 item 4: pretraining seeds 1 and 2 of the four 6-block members, their Part 1 measures and Part 3's
``drop1 - full`` on brown-pos (the plan: ``figures/diffusion-diagnosis/plan.md``, section "Afterwards").

    python -m analyses.objectives.pretraining_seeds commands   # figures/objectives/seeds/commands.md
    python -m analyses.objectives.pretraining_seeds train [--members ...] [--seeds 1 2] [--worker i/n] [--max-minutes M]
    python -m analyses.objectives.pretraining_seeds measure [the same selection]
    python -m analyses.objectives.pretraining_seeds finetune [the same selection] [--ft-seeds 0 ... 9] [--workers 1]
    python -m analyses.objectives.seeds_table                  # figures/objectives/seeds/seeds.{md,csv}

- ``train``: one ``analyses.pretraining.pretrain`` subprocess a (member, seed), the member's shipped loss, steps and
  warm-up with ``--seed S`` (the same compute, data and order rules as seed 0), one thread, into
  ``build/pretraining-seeds/<member>-s<S>/`` (not committed); a model whose ``recipe.json`` exists is finished and
  skipped. Its ``training_log.csv`` and ``recipe.json`` are copied to ``<out>/models/<member>-s<S>/``.
- ``measure``: Part 1's two measures as ``analyses.objectives.measures`` and ``make -C analyses objectives-pressure``
  compute them for the shipped members: ``gradflow record`` (seed 0, the committed sample) under the member's own
  objective, ``gradflow report``'s ratio profile, the context/loss ratio after the second-to-last block; a
  ``gradflow record`` under the all-positions loss and ``gradflow.analysis.pressure.context_pressure``'s last block.
  Scratch runs in ``build/pretraining-seeds/records/``; the numbers in ``<out>/measures/<member>-s<S>.json``.
- ``finetune``: Part 3's ``full`` and ``drop1`` arms on brown-pos, exactly ``analyses.objectives.design``'s lr 1e-4
  configs (regime (a): the same subsets, data order and heads per fine-tuning seed) with the model path set to the
  seed's trained folder; ``grid.run_grid``'s resumable runs in ``<out>/finetune/runs/<member>-s<S>__...``.

Jobs come seed by seed (seed 1 of every member before seed 2: a cut leaves whole seeds); ``--worker i/n`` takes
every n-th job from the i-th, ``--max-minutes`` starts no job after that many minutes (``train``, ``measure``;
``finetune`` resumes run by run instead), and ``train`` stops the job in progress then with its state
(``pretrain.py --max-minutes``), resumed by the next call. The default members are the
configured ones: all four (the diffusion member is the second, whose Parts replaced the first's in the study's
folders; the first's are in ``figures/objectives/diffusion-v1``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

from analyses.last_block_finetuning.grid import GridRun, run_grid, write_plan
from analyses.objectives.design import LR1E4_SEEDS, MASK40
from analyses.objectives.design import plan as design_plan
from gradflow.analysis import load_run
from gradflow.analysis.pressure import context_pressure

ROOT = Path(__file__).resolve().parents[2]
PLAN = "figures/diffusion-diagnosis/plan.md"
DIAGNOSIS = "figures/diffusion-diagnosis/diagnosis.md"
OUT = ROOT / "figures/objectives/seeds"  # commands.md, models/, measures/, finetune/, seeds.{md,csv}
BUILD = ROOT / "build/pretraining-seeds"  # the trained models and the measures' scratch runs (not committed)
SEEDS = (1, 2)  # the plan's new pretraining seeds (seed 0 is the shipped model)
FT_SEEDS = LR1E4_SEEDS  # Part 3's 10 paired seeds (the plan's budget cut would make them 0-5, recorded first)
FT_TASK, FT_ARMS = "brown-pos", ("full", "drop1")
TOKENIZER = "src/gradflow/models/gradflow-mini-en"  # mini-en's shipped tokenizer, as mask40's and diffusion's recipes
EVAL_EVERY, THREADS = 450, 1
KEEP = ("training_log.csv", "recipe.json")  # the small files of a trained model, committed
PRESSURE_SUBLAYERS = ("attn.q", "ffn.in")  # the last block's sublayers the results quote


class NotConfigured(ValueError):
    """A member whose recipe is not chosen yet was asked for."""


@dataclass(frozen=True)
class Seed0:
    """Where the shipped model's (pretraining seed 0's) numbers are committed: its own-objective run of Part 1
    (``figures/objectives/measures/{runs,reports}/<run>``), its label in the pressure table, and the per-run AUCs of
    Part 3 with its model name there."""

    run: str
    pressure_label: str
    model: str
    measures: str = "figures/objectives/measures"
    pressure: str = "figures/objectives/pressure/pressure.csv"
    summaries: str = "figures/objectives/finetune/run_summaries_lr1e-4.csv"


@dataclass(frozen=True)
class Member:
    """One member of the family: its label, the shipped model, ``pretrain.py``'s loss, steps, warm-up and other
    options of its recipe, ``gradflow record``'s options for its own objective, and its seed 0's files. A member
    whose steps are None is not configured yet (:meth:`require` refuses it)."""

    label: str
    model: str | None
    loss: str | None
    steps: int | None
    warmup: int | None
    pretrain_args: tuple[str, ...] = ()
    own_objective: tuple[str, ...] = ()
    seed0: Seed0 | None = None

    @property
    def configured(self) -> bool:
        return None not in (self.model, self.loss, self.steps, self.warmup, self.seed0)

    @property
    def trainable(self) -> bool:
        """Its recipe is known (``pretrain.py``'s loss, steps and warm-up): its seeds can train before its seed 0's
        measures exist."""
        return None not in (self.model, self.loss, self.steps, self.warmup)

    def require(self, train_only: bool = False) -> Member:
        if not (self.trainable if train_only else self.configured):
            raise NotConfigured(
                f"the {self.label} member is not configured yet: its recipe (pretrain.py options, steps, warm-up), "
                f"its own objective for gradflow record and its seed-0 files wait for {DIAGNOSIS} (issue 60's "
                f"diagnosis, {PLAN}); fill in MEMBERS[{self.label!r}] in analyses/objectives/pretraining_seeds.py "
                "once the member is shipped")
        return self


MEMBERS: dict[str, Member] = {
    "mini-en": Member("mini-en", "gradflow-mini-en", "mlm", 3600, 250, (), (),
                      Seed0("mini-en_bert15", "mini-en", "gradflow-mini-en")),
    "twin": Member("twin", "gradflow-mini-en-alltoken", "alltoken", 2700, 190, (), ("--loss", "all-positions"),
                   Seed0("twin_all-positions", "twin", "gradflow-mini-en-alltoken")),
    "mask40": Member("mask40", MASK40, "mask40", 3262, 227, (), ("--mask-rate", "0.4"),
                     Seed0("mask40_bert40", "mask40", MASK40)),
    # the new diffusion member: the recipe the diagnosis chose (figures/diffusion-diagnosis/member.md: mdlm at 1x,
    # 3,059 steps, float32 as it trained; pretrain.py reproduces its seed 0's losses bit for bit)
    "diffusion": Member("diffusion", "gradflow-mini-en-diffusion", "diffusion", 3059, 212,
                        ("--recipe", "mdlm", "--fp32"), ("--objective", "diffusion"),
                        Seed0("diffusion_diffusion", "diffusion", "gradflow-mini-en-diffusion")),
}


@dataclass(frozen=True)
class Job:
    """One (member, pretraining seed): its name ``<member>-s<S>`` names every folder and file it has."""

    member: Member
    seed: int

    @property
    def name(self) -> str:
        return f"{self.member.label}-s{self.seed}"


def relative(path: Path) -> str:
    """``path`` relative to the repository root when inside it, else absolute."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def select(labels: Sequence[str] | None = None, seeds: Sequence[int] = SEEDS, train_only: bool = False) -> list[Job]:
    """The jobs of ``labels`` (default: every configured member) and ``seeds``, seed by seed; NotConfigured when a
    named member is not configured, ValueError on an unknown member or a seed that is not new."""
    if labels is None:
        members = [m for m in MEMBERS.values() if (m.trainable if train_only else m.configured)]
    else:
        unknown = set(labels) - set(MEMBERS)
        if unknown:
            raise ValueError(f"unknown members {sorted(unknown)}; choose from {', '.join(MEMBERS)}")
        members = [MEMBERS[label].require(train_only) for label in MEMBERS if label in labels]
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 1:
        raise ValueError(f"pretraining seeds must be distinct and >= 1 (seed 0 is the shipped model); got {seeds}")
    return [Job(m, s) for s in sorted(seeds) for m in members]


def worker_share(jobs: list[Job], worker: str) -> list[Job]:
    """``--worker i/n``: every n-th job from the i-th (0 <= i < n)."""
    try:
        index, count = (int(x) for x in worker.split("/"))
    except ValueError as err:
        raise ValueError(f"--worker {worker}: give i/n, e.g. 0/2") from err
    if not 0 <= index < count:
        raise ValueError(f"--worker {worker}: i/n with 0 <= i < n")
    return jobs[index::count]


def model_dir(job: Job, build: Path = BUILD) -> Path:
    return Path(build) / job.name


def finished(job: Job, build: Path = BUILD) -> bool:
    """A model is finished when ``pretrain.py`` wrote its ``recipe.json`` (its last file)."""
    return (model_dir(job, build) / "recipe.json").is_file()


def pretrain_command(job: Job, build: Path = BUILD) -> list[str]:
    """The exact ``pretrain.py`` command of ``job`` (run from the repository root; ``python`` is the venv's)."""
    m = job.member.require(train_only=True)
    return ["python", "-m", "analyses.pretraining.pretrain", "--loss", m.loss, "--seed", str(job.seed),
            "--steps", str(m.steps), "--warmup", str(m.warmup), "--tokenizer", TOKENIZER,
            "--out", relative(model_dir(job, build)), "--threads", str(THREADS), "--eval-every", str(EVAL_EVERY),
            *m.pretrain_args]


Runner = Callable[..., object]  # subprocess.run's signature: runner(command, cwd=..., env=..., check=True)


def one_thread() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}


def execute(command: list[str], runner: Runner = subprocess.run) -> dict:
    """Run ``command`` (``python`` -> this interpreter) from the root, printing it; its command, wall and CPU s."""
    print("+", shlex.join(command), flush=True)
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    runner([sys.executable if command[0] == "python" else command[0], *command[1:]], cwd=ROOT, env=one_thread(),
           check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"command": shlex.join(command), "wall_s": round(time.perf_counter() - start, 1),
            "cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 1)}


def keep_small_files(job: Job, build: Path = BUILD, out: Path = OUT) -> list[Path]:
    """Copy a finished model's ``training_log.csv`` and ``recipe.json`` to ``out/models/<name>/``."""
    target = Path(out) / "models" / job.name
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in KEEP:
        shutil.copy2(model_dir(job, build) / name, target / name)
        copied.append(target / name)
    return copied


def each(jobs: list[Job], step: Callable[[Job], bool], max_minutes: float | None,
         clock: Callable[[], float] = time.monotonic) -> list[str]:
    """Call ``step`` on each job until ``max_minutes`` have passed (no job starts after); the names it ran."""
    start, ran = clock(), []
    for job in jobs:
        if max_minutes is not None and clock() - start > 60 * max_minutes:
            print(f"--max-minutes {max_minutes:g} reached: stopping before {job.name}", flush=True)
            break
        if step(job):
            ran.append(job.name)
    return ran


def train(jobs: list[Job], build: Path = BUILD, out: Path = OUT, max_minutes: float | None = None,
          runner: Runner = subprocess.run, clock: Callable[[], float] = time.monotonic) -> list[str]:
    """Train each unfinished job's model (one subprocess each); copy every finished model's small files. With
    ``max_minutes``, the job running at the limit stops there with its state (``pretrain.py --max-minutes``) and
    resumes on the next call."""
    start = clock()

    def step(job: Job) -> bool:
        trained = not finished(job, build)
        if trained:
            left = [] if max_minutes is None else ["--max-minutes", f"{max(max_minutes - (clock() - start) / 60, 0):g}"]
            execute(pretrain_command(job, build) + left, runner)
            if not finished(job, build):
                print(f"{job.name}: stopped at --max-minutes with its state; rerun to resume", flush=True)
                return False
        else:
            print(f"{job.name}: finished ({relative(model_dir(job, build) / 'recipe.json')}), skipped", flush=True)
        keep_small_files(job, build, out)
        return trained
    return each(jobs, step, max_minutes, clock)


# ------------------------------------------------------------------ Part 1's two measures


def records(job: Job, build: Path = BUILD) -> dict[str, Path]:
    """The scratch folders of ``job``'s measures: the own-objective run, its report, the all-positions run."""
    base = Path(build) / "records" / job.name
    return {"own": base / "own", "report": base / "report-own", "pressure": base / "pressure"}


def measure_commands(job: Job, build: Path = BUILD) -> list[list[str]]:
    """``gradflow record`` (seed 0, own objective), ``report``, ``record`` (all-positions) as Part 1 ran them."""
    m, r = job.member.require(), {k: relative(v) for k, v in records(job, build).items()}
    model = relative(model_dir(job, build))
    return [["python", "-m", "gradflow", "record", "--model", model, "--seed", "0", *m.own_objective, "--out",
             r["own"], "--overwrite", "--quiet"],
            ["python", "-m", "gradflow", "report", r["own"], "--out", r["report"], "--format", "png"],
            ["python", "-m", "gradflow", "record", "--model", model, "--loss", "all-positions", "--out",
             r["pressure"], "--overwrite", "--quiet"]]


def ratio_after_second_to_last(role_ratios: pd.DataFrame, num_layers: int) -> dict:
    """The context/loss ratio [95% CI] at layer ``num_layers - 1`` (the second-to-last block's output) of a
    report's ``role_ratios.csv``."""
    layer = num_layers - 1
    row = role_ratios[(role_ratios["role"] == "context") & (role_ratios["reference"] == "loss")
                      & (role_ratios["layer"] == layer)].iloc[0]
    return {"layer": layer, "ratio": float(row["ratio"]), "ci_low": float(row["ci_low"]),
            "ci_high": float(row["ci_high"]), "n_sequences": int(row["n_sequences"])}


def last_block_pressure(pressure: pd.DataFrame) -> dict[str, dict]:
    """The last block's pressure [95% CI] per sublayer from ``context_pressure``'s rows (or pressure.csv's)."""
    last = pressure[pressure["last_block"].astype(bool)]
    return {row.sublayer: {"pressure": float(row.pressure), "ci_low": float(row.ci_low),
                           "ci_high": float(row.ci_high)} for row in last.itertuples()}


def measure(job: Job, build: Path = BUILD, out: Path = OUT, force: bool = False,
            runner: Runner = subprocess.run) -> bool:
    """Record, report and compute ``job``'s two measures into ``out/measures/<name>.json``; False when the file
    exists (and not ``force``) or the model is not trained yet."""
    target = Path(out) / "measures" / f"{job.name}.json"
    if target.is_file() and not force:
        print(f"{job.name}: measured ({relative(target)}), skipped", flush=True)
        return False
    if not finished(job, build):
        print(f"{job.name}: not trained yet, not measured", flush=True)
        return False
    steps = [execute(c, runner) for c in measure_commands(job, build)]
    r = records(job, build)
    meta = json.loads((r["own"] / "meta.json").read_text(encoding="utf-8"))
    ratio = ratio_after_second_to_last(pd.read_csv(r["report"] / "tables" / "role_ratios.csv"), meta["num_layers"])
    result = {"member": job.member.label, "pretraining_seed": job.seed, "model": relative(model_dir(job, build)),
              "ratio_after_second_to_last_block": ratio,
              "last_block_pressure": last_block_pressure(context_pressure(load_run(r["pressure"]))),
              "own_objective": list(job.member.own_objective), "record_seed": meta["seed"],
              "sequences": meta["counts"]["sequences_recorded"], "steps": steps}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {relative(target)}", flush=True)
    return True


# ------------------------------------------------------------------ Part 3's drop1 - full


def finetune_runs(jobs: list[Job], ft_seeds: Sequence[int] = FT_SEEDS, build: Path = BUILD,
                  data_root: str = str(ROOT / "data/tasks")) -> list[GridRun]:
    """The ``full`` and ``drop1`` runs of each job on brown-pos: ``design.plan("lr1e-4")``'s configs (taken from
    its mask40 runs, whose only model-specific entry is the model) with the model set to the seed's folder."""
    template = {(r.factors["seed"], r.factors["arm"]): r for r in design_plan("lr1e-4", tuple(ft_seeds), (MASK40,),
                                                                                data_root=data_root)
                if r.factors["task"] == FT_TASK and r.factors["arm"] in FT_ARMS}
    runs = []
    for seed in ft_seeds:
        for job in jobs:
            for arm in FT_ARMS:
                base = template[seed, arm]
                factors = {**base.factors, "model": job.name, "member": job.member.label,
                           "pretraining_seed": job.seed, "part": "pretraining-seeds"}
                config = {**base.config, "model": str(model_dir(job, build).resolve())}
                runs.append(replace(base, run_id=f"{job.name}__{FT_TASK}__{arm}__s{seed}", factors=factors,
                                    config=config))
    return runs


def finetune(jobs: list[Job], ft_seeds: Sequence[int], workers: int, build: Path = BUILD, out: Path = OUT) -> list[str]:
    """Run the fine-tuning runs of the trained jobs (``plan.json`` lists every configured job's)."""
    folder = Path(out) / "finetune"
    trained = [j for j in jobs if finished(j, build)]
    for job in jobs:
        if job not in trained:
            print(f"{job.name}: not trained yet, not fine-tuned", flush=True)
    whole = finetune_runs(select(None, sorted(set(SEEDS) | {j.seed for j in jobs})),
                          sorted(set(FT_SEEDS) | set(ft_seeds)), build)
    write_plan(whole, folder, {"plan": PLAN, "part": "pretraining-seeds: Part 3's full and drop1, brown-pos"})
    return run_grid(finetune_runs(trained, ft_seeds, build), folder, workers=workers)


# ------------------------------------------------------------------ the commands, committed


def commands_text(build: Path = BUILD) -> str:
    """``commands.md``: the exact retraining command of every job, and the order of the make targets."""
    lines = ["# Pretraining seeds: the commands that retrain them", "",
             (f"Written by `python -m analyses.objectives.pretraining_seeds commands` (the plan: `{PLAN}`, "
              "\"Afterwards\"); `tests/analyses/test_pretraining_seeds.py` recomputes it. Each command runs from the "
              "repository root with `OMP_NUM_THREADS=1` (bfloat16 autocast as the first three members trained; the "
              "diffusion member in float32, as it trained); "
              "`make -C analyses pretraining-seeds` runs the unfinished ones."), "",
             "| model | command |", "|---|---|"]
    for seed in SEEDS:
        for member in MEMBERS.values():
            job = Job(member, seed)
            try:
                cell = f"`{shlex.join(pretrain_command(job, build))}`"
            except NotConfigured:
                cell = f"not configured yet: the new diffusion member's recipe waits for `{DIAGNOSIS}`"
            lines.append(f"| {job.name} | {cell} |")
    lines += ["", "Then, in order: `make -C analyses pretraining-seeds-measure`, `pretraining-seeds-finetune`, "
              "`pretraining-seeds-table`."]
    return "\n".join(lines) + "\n"


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("train", "measure", "finetune", "commands", "table"))
    parser.add_argument("--members", nargs="+", choices=list(MEMBERS), default=None,
                        help="default: every configured member (the diffusion member once configured)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="pretraining seeds (default 1 2)")
    parser.add_argument("--worker", default="0/1", help="i/n: every n-th job from the i-th")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="start no job after this many minutes (train: stop the one in progress, resumably)")
    parser.add_argument("--ft-seeds", type=int, nargs="+", default=list(FT_SEEDS), help="fine-tuning seeds")
    parser.add_argument("--workers", type=int, default=1, help="fine-tuning processes (one thread each)")
    parser.add_argument("--force", action="store_true", help="measure a measured model again")
    parser.add_argument("--out", type=Path, default=OUT, help=f"default {relative(OUT)}")
    parser.add_argument("--build", type=Path, default=BUILD, help=f"the models (default {relative(BUILD)})")
    args = parser.parse_args(argv)
    args.out, args.build = ROOT / args.out, ROOT / args.build  # an absolute path stays as given
    try:
        args.jobs = worker_share(select(args.members, args.seeds, train_only=args.command == "train"), args.worker)
    except ValueError as err:  # NotConfigured included
        parser.error(str(err))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.command == "table":
        from analyses.objectives import seeds_table

        return seeds_table.main(["--out", str(args.out)])
    if args.command == "commands":
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "commands.md").write_text(commands_text(args.build), encoding="utf-8")
        print(f"wrote {relative(args.out / 'commands.md')}")
        return 0
    if args.members is None:
        for member in MEMBERS.values():
            if not member.configured:
                print(f"note: {member.label} left out: not configured yet ({DIAGNOSIS})", flush=True)
    if args.command == "train":
        train(args.jobs, args.build, args.out, args.max_minutes)
    elif args.command == "measure":
        each(args.jobs, lambda job: measure(job, args.build, args.out, args.force), args.max_minutes)
    else:
        finetune(args.jobs, args.ft_seeds, args.workers, args.build, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
