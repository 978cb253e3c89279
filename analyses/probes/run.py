"""Layer-wise probes of gradflow-mini-en, its all-token twin and the repaired mini-en (issue 14); ``--pair
mini12-en``: the same for the 12-block pair (issue 31) into ``figures/twelve-blocks/probes``.

Regenerates every probe number quoted in README.md:

    python -m analyses.probes.run        # ~30 min on 2 cores (repair included when build/ lacks it)
    python -m analyses.probes.run --limit 1500 --no-code-length --no-masked --out figures/probes/n1500

Writes ``figures/probes/runs/<label>-<task>/`` (probes.csv, probe_drops.csv, probe_words.parquet,
meta.json), the comparison figures ``figures/probes/probes_<task>.{pdf,png}``, the tables of both tasks
(``probes_compared.csv``, ``probe_drops_compared.csv``, ``probe_drop_differences.csv``: each model's drop
minus mini-en's, paired) and ``figures/probes/drops.md`` (the README tables).

The second command is the larger sample (issue 26): 1,500 sentences per split, accuracy only (no
online code length, no masked runs), under ``figures/probes/n1500/``; the 600-sentence runs stay the
record of the code-length and masked-regime numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd

from gradflow.runs.probe_tables import write_comparison_tables, write_probe_tables

ROOT = Path(__file__).resolve().parents[2]
# per pair: label -> model, the MLM model first (the baseline of every comparison), then its twin and its repair;
# where ``gradflow repair`` writes the repair; the default output folder
PAIRS = {
    "mini-en": ({"mini-en": "gradflow-mini-en", "twin": "gradflow-mini-en-alltoken",
                 "repaired": "build/mini-repaired/model"}, "figures/probes"),
    "mini12-en": ({"mini12-en": "gradflow-mini12-en", "twin": "gradflow-mini12-en-alltoken",
                   "repaired": "build/mini12-repaired/model"}, "figures/twelve-blocks/probes"),
}
MODELS = PAIRS["mini-en"][0]
TASKS = ("brown-pos", "brown-propn")


def gradflow(*args: str, threads: int | None = None) -> None:
    command = [sys.executable, "-m", "gradflow", *args]
    print("+", " ".join(command), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    subprocess.run(command, cwd=ROOT, check=True, env=env)


def finished(command: list[str]) -> bool:
    """True when ``command``'s probe directory holds a complete run of exactly this command (``--feature-cache``
    aside: a cache changes how fast features come, not one bit of them)."""
    meta = ROOT / command[command.index("--out") + 1] / "meta.json"
    if not meta.is_file():
        return False
    recorded = json.loads(meta.read_text(encoding="utf-8"))
    wanted = without_feature_cache(["gradflow", *command])
    return bool(recorded.get("complete")) and without_feature_cache(shlex.split(recorded.get("command", ""))) == wanted


def without_feature_cache(argv: list[str]) -> list[str]:
    """``argv`` without ``--feature-cache DIR``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--feature-cache":
            skip = True
        elif not arg.startswith("--feature-cache="):
            out.append(arg)
    return out


def run_all(commands: list[list[str]], jobs: int) -> None:
    """Run gradflow commands, ``jobs`` at a time (one thread each when parallel)."""
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for future in [pool.submit(gradflow, *c, threads=1 if jobs > 1 else None) for c in commands]:
            future.result()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", default="600", help="sentences per split (default %(default)s)")
    parser.add_argument("--masked-limit", default="100", help="sentences per split of the masked regime runs")
    parser.add_argument("--pair", choices=PAIRS, default="mini-en",
                        help="mini-en: the 6-block pair (issue 14); mini12-en: the 12-block pair (issue 31)")
    parser.add_argument("--out", default=None, help="default figures/probes (mini-en), figures/twelve-blocks/probes")
    parser.add_argument("--jobs", type=int, default=2, help="probe runs at a time, one thread each (default 2)")
    parser.add_argument("--no-code-length", action="store_true",
                        help="skip the online code length (accuracy and selectivity only; much faster)")
    parser.add_argument("--no-masked", action="store_true", help="skip the two masked-regime runs")
    parser.add_argument("--labels", nargs="+", default=None,
                        help="probe only these models of the pair (default: all; e.g. the MLM model and its repair "
                             "while the twin trains); the comparison covers every finished run")
    parser.add_argument("--resume", action="store_true",
                        help="keep a probe run whose meta.json says complete and records this same command")
    parser.add_argument("--tables-only", action="store_true", help="only rewrite the markdown tables from the runs")
    parser.add_argument("--compare-only", action="store_true",
                        help="only compare the finished runs under --out and rewrite the tables (no probing)")
    args = parser.parse_args()
    models, default_out = PAIRS[args.pair]
    args.out = args.out or default_out
    if args.tables_only:
        write_tables(args.out, models)
        return 0
    if args.compare_only:
        compare(args.out, models)
        write_tables(args.out, models)
        return 0
    unknown = sorted(set(args.labels or ()) - set(models))
    if unknown:
        parser.error(f"--labels {' '.join(unknown)}: not a model of the pair {args.pair} ({', '.join(models)})")
    labels = args.labels or list(models)
    start = time.monotonic()
    repaired = Path(models["repaired"]).parent
    if "repaired" in labels and not (ROOT / repaired / "model").is_dir():
        gradflow("repair", "--model", next(iter(models.values())), "--out", str(repaired))
        print(f"repair: {time.monotonic() - start:.0f} s wall", flush=True)
    commands = []
    extra = ["--no-code-length"] if args.no_code_length else []
    if not args.no_masked:  # the slow masked runs first
        for label in [label for label in list(models)[:2] if label in labels]:
            run = f"{args.out}/runs/{label}-brown-pos-masked"
            commands.append(["probe", "--model", models[label], "--task", "brown-pos", "--masked", "--out", run,
                             "--limit", args.masked_limit, "--overwrite", "--quiet", "--format", "png", *extra])
    for task in TASKS:
        for label in labels:
            run = f"{args.out}/runs/{label}-{task}"
            model = models[label]
            commands.append(["probe", "--model", model, "--task", task, "--out", run, "--limit", args.limit,
                             "--overwrite", "--quiet", "--format", "png", *extra])
    if args.resume:
        commands = [c for c in commands if not finished(c)]
    probes_start = time.monotonic()
    run_all(commands, args.jobs)
    elapsed = time.monotonic() - probes_start
    print(f"{len(commands)} probe runs, {args.jobs} at a time: {elapsed:.0f} s wall", flush=True)
    compare(args.out, models)
    write_tables(args.out, models)
    print(f"total: {time.monotonic() - start:.0f} s wall", flush=True)
    return 0


def complete(run: str) -> bool:
    """True when the probe directory ``run`` (relative to the repository root) holds a finished run."""
    meta = ROOT / run / "meta.json"
    return meta.is_file() and bool(json.loads(meta.read_text(encoding="utf-8")).get("complete"))


def finished_runs(out_dir: str, models: dict[str, str] = MODELS) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(label, directory) of the finished unmasked runs (task by task) and of the finished masked runs (the MLM
    model and its twin: the first two of ``models``)."""
    unmasked = [(label, f"{out_dir}/runs/{label}-{task}") for task in TASKS for label in models]
    masked = [(label, f"{out_dir}/runs/{label}-brown-pos-masked") for label in list(models)[:2]]
    return [r for r in unmasked if complete(r[1])], [r for r in masked if complete(r[1])]


def compare(out_dir: str, models: dict[str, str] = MODELS) -> None:
    """One comparison over both tasks (a figure per task, the tables of both, the MLM model the baseline of each)
    and one of the masked runs, over the finished runs."""
    unmasked, masked = finished_runs(out_dir, models)
    gradflow("compare", *(d for _, d in unmasked), "--labels", *(label for label, _ in unmasked), "--out", out_dir)
    if len(masked) > 1:
        gradflow("compare", *(d for _, d in masked), "--labels", *(label for label, _ in masked),
                 "--out", f"{out_dir}/masked", "--width", "single")


def write_tables(out_dir: str, models: dict[str, str] = MODELS) -> None:
    """``drops.md`` (last-layer drops), ``layers_<task>.md`` (every layer) and every ``tables.tex`` (each run's and
    each comparison's) from the finished runs."""
    out = ROOT / out_dir
    unmasked, masked = finished_runs(out_dir, models)
    runs = [d for _, d in unmasked + masked]
    (out / "drops.md").write_text(drops_table(runs) + differences_table(out), encoding="utf-8")
    for run in runs:  # tables.tex of each run and of each comparison, from the committed CSVs
        write_probe_tables(ROOT / run)
    for folder, finished in ((out, unmasked), (out / "masked", masked)):
        if (folder / "probe_drop_differences.csv").is_file():
            write_comparison_tables([ROOT / d for _, d in finished], [label for label, _ in finished], folder,
                                    pd.read_csv(folder / "probe_drop_differences.csv"))
    for task in TASKS:
        (out / f"layers_{task}.md").write_text(layers_table(out_dir, task, models), encoding="utf-8")
    for name in ("drops.md", *(f"layers_{task}.md" for task in TASKS)):
        print((out / name).read_text(encoding="utf-8"))


def layers_table(out_dir: str, task: str, models: dict[str, str] = MODELS) -> str:
    """Every layer of every model: test accuracy [95% CI], selectivity, online code length (kbits)."""
    frames = {label: pd.read_csv(ROOT / run / "probes.csv") for label, run in finished_runs(out_dir, models)[0]
              if run.endswith(f"-{task}")}
    first = next(iter(frames.values()))
    code = any(frame["code_length_bits"].notna().any() for frame in frames.values())  # not with --no-code-length
    columns = ("accuracy [95% CI]", "selectivity", "code (kbits)") if code else ("accuracy [95% CI]", "selectivity")
    header = "| layer | " + " | ".join(" | ".join([f"{label}: {columns[0]}", *columns[1:]]) for label in frames)
    lines = [header + " |", "|---" * (1 + len(columns) * len(frames)) + "|"]
    for i, site in enumerate(first["site"]):
        cells = []
        for frame in frames.values():
            r = frame.iloc[i]
            cells += [f"{r.accuracy:.4f} [{r.ci_low:.4f}, {r.ci_high:.4f}]", f"{r.selectivity:.3f}"]
            cells += [f"{r.code_length_bits / 1000:.2f}"] if code else []
        lines.append(f"| {int(first.iloc[i].layer)} ({site}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def drops_table(runs: list[str]) -> str:
    """The README table: last-layer drop (accuracy points and code-length bits, when computed) with 95% CIs."""
    frames = {run: pd.read_csv(ROOT / run / "probe_drops.csv") for run in runs}
    code = any((d.metric == "code_length_bits").any() for d in frames.values())
    header = "| run | regime | last-layer drop, accuracy (95% CI) | best earlier layer |"
    header += " last-layer drop, code length in bits (95% CI) |" if code else ""
    lines = [header, "|---" * (5 if code else 4) + "|"]
    for run, drops in frames.items():
        for regime, d in drops.groupby("regime", sort=False):
            acc = d[d.metric == "accuracy"].iloc[0]
            bits = d[d.metric == "code_length_bits"]
            cell = (f"{bits.iloc[0].last_layer_drop:+.0f} [{bits.iloc[0].ci_low:+.0f}, {bits.iloc[0].ci_high:+.0f}]"
                    if len(bits) else "-")
            lines.append(f"| {Path(run).name} | {regime} | {acc.last_layer_drop:+.4f} [{acc.ci_low:+.4f}, "
                         f"{acc.ci_high:+.4f}] | {int(acc.best_earlier_layer)} ({acc.best_earlier_score:.4f}) |"
                         + (f" {cell} |" if code else ""))
    return "\n".join(lines) + "\n"


def differences_table(out: Path) -> str:
    """Each model's last-layer accuracy drop minus the MLM model's on the same words (paired CI), if compared."""
    files = [f for f in (out / "probe_drop_differences.csv", out / "masked" / "probe_drop_differences.csv")
             if f.is_file()]
    if not files:
        return ""
    lines = ["", "| task | regime | drop difference (95% paired CI) | words | sentences |", "|---|---|---|---|---|"]
    for file in files:
        for r in pd.read_csv(file).itertuples():
            task = f"{r.task} (masked run)" if file.parent.name == "masked" else r.task
            lines.append(f"| {task} | {r.regime} | {r.label} - {r.baseline}: {r.difference:+.4f} "
                         f"[{r.ci_low:+.4f}, {r.ci_high:+.4f}] | {r.n_words:,} | {r.n_sentences} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
