"""How robust is the last-layer drop? Probe training sizes x probe families (issue 31).

The pre-registered plan (figures/twelve-blocks/plan.md, "Probes at twelve blocks"): probe training sizes
300, 600, 1,500 and 4,500 sentences (plan deviation 5: not the whole training split, about 33 CPU-hours for both
pairs), the validation and test splits held fixed (the first ``--limit`` sentences of each: the same test words in
every run); two probe families, the logistic regression and an MLP with one hidden layer of 256; accuracy only (no
online code length).

    python -m analyses.probes.robustness                        # 6-block pair, brown-pos, every size
    python -m analyses.probes.robustness --sizes 300 600 1500 --tasks brown-pos brown-propn
    python -m analyses.probes.robustness --models mini12-en=build/gradflow-mini12-en/model ...
    python -m analyses.probes.robustness --tables-only          # rewrite the tables from finished runs

Writes ``figures/probes/robustness/<model>-<task>-<family>-<size>/`` (one ``gradflow probe`` run each),
``last_layer_drops.csv`` and ``last_layer_drops.md`` (drop, 95% CI, last layer, best earlier layer, and the
plan's verdict per model and task). Resumable: a run whose meta.json says complete and records the same
command is skipped (``--feature-cache`` aside). Each run uses one thread (``--threads``), ``--jobs`` runs at a time
(default 2: one per core). The runs share a feature cache (``--feature-cache``, default ``build/probe-features``),
so each model's validation and test features are extracted once, not in every run.

Rule (the plan): a drop is called a drop only if its 95% CI excludes 0 at the largest training size and it
keeps its sign at 1,500 sentences with both probe families.
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

from analyses.probes.run import finished

ROOT = Path(__file__).resolve().parents[2]
OUT = "figures/probes/robustness"
MODELS = {"mini-en": "gradflow-mini-en", "twin": "gradflow-mini-en-alltoken"}
TASKS = ("brown-pos",)
SIZES = ("300", "600", "1500", "4500")  # plan deviation 5; 'all' is accepted
FAMILIES = ("logistic", "mlp")
RULE_SIZE = "1500"
FEATURE_CACHE = "build/probe-features"  # shared by the runs: the same validation and test sentences in each
COLUMNS = ("model", "task", "family", "train_size", "train_sentences", "train_words", "test_words",
           "last_layer_drop", "ci_low", "ci_high", "last_score", "best_earlier_layer", "best_earlier_score", "wall_s")


def run_dir(out: str, label: str, task: str, family: str, size: str) -> str:
    """The run directory of one (model, task, family, training size), relative to the repository root."""
    return f"{out}/{label}-{task}-{family}-{size}"


def probe_command(model: str, task: str, family: str, size: str, limit: str, out: str,
                  feature_cache: str | None = None) -> list[str]:
    """The ``gradflow probe`` arguments of one run (accuracy only; validation and test: ``limit`` sentences;
    ``feature_cache``: where runs share their extracted features)."""
    cache = ["--feature-cache", feature_cache] if feature_cache else []
    return ["probe", "--model", model, "--task", task, "--probe", family, "--limit", limit, "--train-limit", size,
            "--no-code-length", *cache, "--out", out, "--overwrite", "--quiet", "--format", "png"]


def run(command: list[str], threads: int) -> float:
    """Run one gradflow command on ``threads`` threads; return its wall time in seconds."""
    print("+ gradflow", shlex.join(command), flush=True)
    limits = {name: str(threads) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "gradflow", *command], cwd=ROOT, check=True, env={**os.environ, **limits})
    return time.monotonic() - start


def table(out: str, models: dict[str, str], tasks: list[str], families: list[str], sizes: list[str]) -> pd.DataFrame:
    """One row per finished run (accuracy drop of the unmasked regime), in sweep order."""
    rows = []
    for task in tasks:
        for label in models:
            for family in families:
                for size in sizes:
                    folder = ROOT / run_dir(out, label, task, family, size)
                    meta_file = folder / "meta.json"
                    if not meta_file.is_file():
                        continue
                    meta = json.loads(meta_file.read_text(encoding="utf-8"))
                    if not meta.get("complete"):
                        continue
                    drops = pd.read_csv(folder / "probe_drops.csv")
                    d = drops[(drops.metric == "accuracy") & (drops.regime == "unmasked")].iloc[0]
                    counts = meta["counts"]["unmasked"]
                    rows.append({"model": label, "task": task, "family": family, "train_size": size,
                                 "train_sentences": counts["train"]["sentences"],
                                 "train_words": counts["train"]["words"],
                                 "test_words": counts["test"]["words"], "last_layer_drop": d.last_layer_drop,
                                 "ci_low": d.ci_low, "ci_high": d.ci_high, "last_score": d.last_score,
                                 "best_earlier_layer": int(d.best_earlier_layer),
                                 "best_earlier_score": d.best_earlier_score, "wall_s": meta.get("wall_s")})
    return pd.DataFrame(rows, columns=list(COLUMNS))


def largest_size(sizes: list[str]) -> str:
    """The largest probe training size of ``sizes`` ('all' above every count)."""
    return max(sizes, key=lambda s: float("inf") if s == "all" else int(s))


def verdict(rows: pd.DataFrame, families: list[str], sizes: list[str]) -> str:
    """The plan's rule for one model and task: 'drop', 'gain', 'no drop', or 'undecided' with what is missing."""
    largest = largest_size(sizes)
    missing = [f"{f}-{s}" for f in families for s in dict.fromkeys([largest, RULE_SIZE])
               if rows[(rows.family == f) & (rows.train_size == s)].empty]
    if missing:
        return f"undecided (missing {', '.join(missing)})"
    at_largest = [rows[(rows.family == f) & (rows.train_size == largest)].iloc[0] for f in families]
    at_rule = [rows[(rows.family == f) & (rows.train_size == RULE_SIZE)].iloc[0] for f in families]
    if all(r.ci_high < 0 for r in at_largest) and all(r.last_layer_drop < 0 for r in at_rule):
        return "drop"
    if all(r.ci_low > 0 for r in at_largest) and all(r.last_layer_drop > 0 for r in at_rule):
        return "gain (last layer best)"
    return "no drop"


def markdown(frame: pd.DataFrame, expected: int, families: list[str], sizes: list[str]) -> str:
    """The results table, the verdicts and, while runs are missing, a PARTIAL mark."""
    lines = ["Last-layer accuracy drop (last layer minus the best earlier layer, 95% CI resampling test sentences) "
             "by probe family and probe training size; validation and test are the same words in every run "
             "(`python -m analyses.probes.robustness`; each run on one thread of a shared 2-core machine).", ""]
    if len(frame) < expected:
        lines += [f"**PARTIAL**: {len(frame)} of {expected} runs finished; the verdicts below need the missing "
                  "ones.", ""]
    lines += ["| model | task | family | train sentences (words) | test words | last-layer drop (95% CI) | "
              "last layer | best earlier layer | run (s) |", "|---" * 9 + "|"]
    for r in frame.itertuples():
        lines.append(f"| {r.model} | {r.task} | {r.family} | {r.train_sentences:,} ({r.train_words:,}) | "
                     f"{r.test_words:,} | {r.last_layer_drop:+.4f} [{r.ci_low:+.4f}, {r.ci_high:+.4f}] | "
                     f"{r.last_score:.4f} | {r.best_earlier_layer} ({r.best_earlier_score:.4f}) | "
                     f"{r.wall_s:.0f} |")
    lines += ["", f"Rule (plan): a drop only if the 95% CI excludes 0 at the largest size ({largest_size(sizes)}) "
              f"and the sign holds at {RULE_SIZE} sentences, with both families ({', '.join(families)}).", "",
              "| model | task | verdict | provisional: the same rule with the largest size finished by both "
              "families |", "|---|---|---|---|"]
    for (model, task), rows in frame.groupby(["model", "task"], sort=False):
        done = [s for s in sizes if all(((rows.family == f) & (rows.train_size == s)).any() for f in families)]
        provisional = f"{verdict(rows, families, done)} (at {largest_size(done)})" if done else "-"
        lines.append(f"| {model} | {task} | {verdict(rows, families, sizes)} | {provisional} |")
    return "\n".join(lines) + "\n"


def write_tables(out: str, models: dict[str, str], tasks: list[str], families: list[str], sizes: list[str]) -> None:
    """``last_layer_drops.csv`` and ``.md`` from the finished runs under ``out``."""
    frame = table(out, models, tasks, families, sizes)
    folder = ROOT / out
    folder.mkdir(parents=True, exist_ok=True)
    frame.to_csv(folder / "last_layer_drops.csv", index=False)
    text = markdown(frame, len(models) * len(tasks) * len(families) * len(sizes), families, sizes)
    (folder / "last_layer_drops.md").write_text(text, encoding="utf-8")
    print(text, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[f"{k}={v}" for k, v in MODELS.items()],
                        help="label=model pairs (default: the 6-block pair)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS))
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), help="probe training sentences, or 'all'")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--limit", default="1500", help="validation and test sentences, fixed (default %(default)s)")
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--threads", type=int, default=1, help="threads per run (default %(default)s)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (default %(default)s: one per core)")
    parser.add_argument("--feature-cache", default=FEATURE_CACHE, metavar="DIR",
                        help="the runs' shared feature cache (default %(default)s; validation and test are extracted "
                             "once per model; '' for none)")
    parser.add_argument("--tables-only", action="store_true", help="only rewrite the tables from the finished runs")
    args = parser.parse_args()
    models = dict(pair.split("=", 1) for pair in args.models)
    if not args.tables_only:
        pending = []
        for task in args.tasks:
            for size in args.sizes:  # smallest first, both families and both models per size: pairs finish together
                for family in args.families:
                    for label, model in models.items():
                        command = probe_command(model, task, family, size, args.limit,
                                                run_dir(args.out, label, task, family, size), args.feature_cache)
                        if not finished(command):
                            pending.append((f"{label} {task} {family} {size}", command))

        def one(name: str, command: list[str]) -> None:
            print(f"{name}: {run(command, args.threads):.0f} s wall", flush=True)

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for future in [pool.submit(one, name, command) for name, command in pending]:
                future.result()
                write_tables(args.out, models, args.tasks, args.families, args.sizes)
    write_tables(args.out, models, args.tasks, args.families, args.sizes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
