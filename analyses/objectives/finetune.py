"""Issue 52's fine-tuning runs (``figures/objectives/plan.md``, Parts 3 and 4), resumable.

    python -m analyses.objectives.finetune --part lr1e-4 --seeds 0 1 2 3 4  # Part 3 (160 runs for seeds 0-9)
    python -m analyses.objectives.finetune --part pilot       # Part 4's pilot (4 runs), then its decision
    python -m analyses.objectives.finetune --part decision    # the decision again, from the pilot's files
    python -m analyses.objectives.finetune --part seed-regime --steps S --seeds 0 1 ... n-1  # Part 4: 12 x n

The parts' runs are ``analyses.objectives.design``'s; they run with ``grid.run_grid`` (one thread a run,
``--workers`` processes; finished runs are skipped, a finished run made with another config is refused) into
``figures/objectives/finetune/<part>/runs/<run_id>/`` with ``plan.json`` beside them. ``--models`` runs some of
the part's models now (a model still training is left for later); ``plan.json`` lists the whole part.

The repair1 arm (Part 3) fine-tunes ``build/<model>-repaired/model``, made by ``gradflow repair`` with its
defaults when missing; its ``repair.json`` (with the weights' SHA-256) is copied to ``<out>/repair-<model>.json``.
The pilot ends with the plan's step-budget and seeds rules (``analyses.objectives.budget``): printed and written
to ``<out>/decision.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from analyses.last_block_finetuning.grid import GridRun, run_grid, write_plan
from analyses.objectives.budget import decide, describe
from analyses.objectives.design import ALL_MODELS, OUT, PARTS, PLAN, ROOT, plan, repaired_dir, repairs_needed


def make_repairs(runs: list[GridRun], out: Path) -> list[str]:
    """Run ``gradflow repair`` (its defaults) for each model whose repair1 runs need a missing repaired copy;
    return the models repaired. Every repaired model used by ``runs`` gets its record in ``out``."""
    made = []
    for model, folder in repairs_needed(runs):
        print(f"repairing {model} into {folder.parent} (gradflow repair, its defaults)", flush=True)
        subprocess.run([sys.executable, "-m", "gradflow", "repair", "--model", model, "--out",
                        str(folder.parent.relative_to(ROOT))], cwd=ROOT, check=True)
        made.append(model)
    for model in sorted({r.factors["model"] for r in runs if r.factors["arm"] == "repair1"}):
        write_repair_record(model, out)
    return made


def write_repair_record(model: str, out: Path) -> Path | None:
    """Copy ``build/<model>-repaired/repair.json`` to ``out/repair-<model>.json`` with the SHA-256 of the repaired
    weights (``model_safetensors_sha256``), when the repair is on disk and the record is not written yet."""
    folder = ROOT / repaired_dir(model)
    source, target = folder.parent / "repair.json", out / f"repair-{model}.json"
    if target.is_file() or not source.is_file():
        return None
    record = json.loads(source.read_text(encoding="utf-8"))
    weights = folder / "model.safetensors"
    if weights.is_file():
        record["model_safetensors_sha256"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    out.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return target


def check_against_decision(steps: int, seeds: tuple[int, ...], decision_path: Path) -> list[str]:
    """Lines saying where ``--steps`` and ``--seeds`` differ from the pilot's ``decision.json`` (none: agree or no
    decision yet)."""
    if not decision_path.is_file():
        return [f"note: no {decision_path} yet (the pilot's decision); S and n must be the plan's decision entry"]
    decision = json.loads(decision_path.read_text(encoding="utf-8"))
    lines = []
    if steps != decision["S"]:
        lines.append(f"warning: --steps {steps} is not the pilot's S = {decision['S']} ({decision_path}); only a "
                     f"deviation recorded in {PLAN} allows that")
    if sorted(seeds) != list(range(decision["n"])):
        lines.append(f"note: seeds {list(seeds)} are not the decision's 0-{decision['n'] - 1} (fine for a slice)")
    return lines


def whole_seeds(part: str, seeds: list[int] | None, out: Path) -> tuple[int, ...] | None:
    """The seeds ``plan.json`` lists: the part's own (0-9 at lr 1e-4), those of this command and those of the runs
    an earlier command listed in ``out/plan.json``, so that running the part seed by seed keeps every run in it
    (None: the part's fixed seeds, the pilot's)."""
    if PARTS[part].seeds_fixed:
        return None
    path = out / "plan.json"
    listed = {run["factors"]["seed"] for run in json.loads(path.read_text())["runs"]} if path.is_file() else set()
    return tuple(sorted(set(PARTS[part].seeds or ()) | set(seeds or ()) | listed)) or None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the part's runs planned (``runs``: this command's, ``whole``: every model's)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=(*PARTS, "decision"), required=True,
                        help="lr1e-4 (Part 3), pilot (Part 4's pilot, then its decision), decision (the pilot's "
                             "decision only, from its files), seed-regime (Part 4 at --steps S)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="default: 0-9 for lr1e-4, 0 for pilot; required for seed-regime (0..n-1)")
    parser.add_argument("--models", nargs="+", choices=ALL_MODELS, default=None,
                        help="run some of the part's models now (default: all of them)")
    parser.add_argument("--steps", type=int, default=None, help="seed-regime only: the decision's S")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help=f"default {OUT.relative_to(ROOT)}/<part>")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--autocast", default=None, choices=["bfloat16"],
                        help="float32 by default, as the 6-block experiment's runs")
    parser.add_argument("--data-root", default=str(ROOT / "data/tasks"))
    args = parser.parse_args(argv)
    if args.part == "decision":
        args.out = args.out or OUT / "pilot"
        return args
    args.out = args.out or OUT / args.part
    try:
        args.runs = plan(args.part, args.seeds, args.models, args.steps, args.device, args.autocast, args.data_root)
        args.whole = plan(args.part, whole_seeds(args.part, args.seeds, args.out), None, args.steps, args.device,
                          args.autocast, args.data_root)
    except ValueError as err:
        parser.error(str(err))
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one part (repairs first where needed, then the grid; the pilot ends with its decision)."""
    args = parse(argv)
    if args.part == "decision":
        print(describe(decide(args.out)))
        return 0
    if args.part == "seed-regime":
        seeds = tuple(sorted({r.factors["seed"] for r in args.runs}))
        for line in check_against_decision(args.steps, seeds, args.out.parent / "pilot" / "decision.json"):
            print(line, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    make_repairs(args.runs, args.out)
    write_plan(args.whole, args.out, {"part": args.part, "plan": PLAN,
                                      "models_run_by_this_command": sorted({r.factors["model"] for r in args.runs})})
    run_grid(args.runs, args.out, workers=args.workers)
    if args.part == "pilot":
        try:
            print(describe(decide(args.out)))
        except SystemExit as err:  # a pilot run of another model is still to come (--models)
            print(f"no decision yet: {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
