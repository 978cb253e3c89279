"""Run a grid of fine-tuning runs (resumable, in parallel processes) and summarise it over seeds.

Shared by the experiments of this package (``drop_or_reinit.py``, ...). Each run is one
``gradflow.interventions.finetune.FinetuneConfig`` written to ``<out>/runs/<run_id>/`` (``eval.csv``,
``result.json``); a run whose ``result.json`` exists is skipped, so an interrupted experiment
resumes where it stopped. Workers are separate processes with one torch thread each (on a 2-core
machine two one-thread runs beat one two-thread run for these small models).
"""

from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from gradflow.analysis.experiment_stats import paired_test

REPO = Path(__file__).resolve().parents[2]
PATH_KEYS = ("model", "task", "data_root", "out_dir")  # config keys that may hold a path


@dataclass(frozen=True)
class GridRun:
    """One fine-tuning run: its id (directory name), the grid factors it stands for, its config."""

    run_id: str
    factors: dict
    config: dict


def run_one(run: GridRun, out: Path, threads: int) -> tuple[str, float]:
    import torch

    torch.set_num_threads(threads)
    from gradflow.interventions.finetune.train import FinetuneConfig, finetune

    run_dir = out / "runs" / run.run_id
    start = time.perf_counter()
    result = finetune(FinetuneConfig(**run.config, out_dir=str(run_dir), progress=False))
    (run_dir / "factors.json").write_text(json.dumps(run.factors, indent=2) + "\n")
    return run.run_id, result.seconds if result.seconds else time.perf_counter() - start


def run_grid(runs: list[GridRun], out: Path, workers: int = 2, threads: int = 1) -> list[str]:
    """Run every run not yet done under ``out/runs``; return the ids run now (printing progress)."""
    todo = pending(runs, out)
    print(f"{len(runs) - len(todo)} of {len(runs)} runs already done; {len(todo)} to run with {workers} workers",
          flush=True)
    if not todo:
        return []
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    start = time.perf_counter()
    done = []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(run_one, r, out, threads): r for r in todo}
        for i, fut in enumerate(as_completed(futures), 1):
            run_id, seconds = fut.result()
            done.append(run_id)
            print(f"[{i}/{len(todo)}] {run_id}: {seconds:.0f} s (elapsed {time.perf_counter() - start:.0f} s)",
                  flush=True)
    return done


def pending(runs: list[GridRun], out: Path) -> list[GridRun]:
    """The runs without a finished result under ``out/runs``; exits if a finished one was made with
    another config (a changed default would otherwise mix two experiments in one table)."""
    stale = [r.run_id for r in runs if _saved_config_differs(r, out)]
    if stale:
        raise SystemExit(f"{len(stale)} finished runs under {out / 'runs'} were made with another config "
                         f"(e.g. {stale[0]}): delete them or pass another --out")
    return [r for r in runs if not (out / "runs" / r.run_id / "result.json").exists()]


def _saved_config_differs(run: GridRun, out: Path) -> bool:
    """Whether ``run`` has a finished result whose recorded config differs from ``run.config``.

    result.json records paths (data_root, a model directory) as ``gradflow.provenance.portable_path``
    writes them (``data/tasks``, ``./model``, ``gradflow:...``) where the plan may hold absolute
    ones: both sides are compared as the paths they stand for (see :func:`_as_path`).
    """
    run_dir = out / "runs" / run.run_id
    path = run_dir / "result.json"
    if not path.exists():
        return False
    saved = json.loads(path.read_text()).get("config", {})
    return any(k in saved and _as_path(k, saved[k], run_dir) != _as_path(k, v, run_dir)
               for k, v in run.config.items())


def _as_path(key: str, value, run_dir: Path):
    """What a config value recorded for ``run_dir`` stands for: for the path keys (model, task,
    data_root, out_dir) a resolved path (absolute; ``gradflow:`` inside the package; ``.``, ``./``
    and ``../`` relative to ``run_dir``; any other relative one relative to the repository root),
    other values unchanged."""
    if key not in PATH_KEYS or not isinstance(value, str):
        return value
    if value.startswith("gradflow:"):
        import gradflow

        return Path(gradflow.__file__).resolve().parent / value[len("gradflow:"):]
    if os.path.isabs(value):
        return Path(value).resolve()
    if value in (".", "..") or value.startswith(("./", "../")):
        return (run_dir / value).resolve()
    return (REPO / value).resolve()  # names (hub, embedded, zoo:NAME) map the same way on both sides


def _portable(value, out: Path):
    """``value`` as provenance records it for an output in ``out``: absolute paths made portable."""
    from gradflow.provenance import portable_path

    return portable_path(value, out) if isinstance(value, (str, Path)) and os.path.isabs(value) else value


def _portable_tree(value, out: Path):
    """``value`` (JSON-like) with every absolute path in it made portable for an output in ``out``."""
    if isinstance(value, dict):
        return {k: _portable_tree(v, out) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_portable_tree(v, out) for v in value]
    return _portable(value, out)


def collect(out: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(curves, finals) of every finished run under ``out/runs``, with its factors as columns.

    curves: one row per (run, step, split, metric) from ``eval.csv``;
    finals: one row per (run, split, metric) from ``result.json``'s final metrics.
    """
    curves, finals = [], []
    for result_path in sorted((out / "runs").glob("*/result.json")):
        run_dir = result_path.parent
        factors = json.loads((run_dir / "factors.json").read_text())
        frame = pd.read_csv(run_dir / "eval.csv")
        for k, v in factors.items():
            frame[k] = v
        frame["run_id"] = run_dir.name
        curves.append(frame)
        result = json.loads(result_path.read_text())
        for split, metrics in result["final"].items():
            for metric, value in metrics.items():
                finals.append({**factors, "run_id": run_dir.name, "split": split, "metric": metric, "value": value,
                               "seconds": result["seconds"]})
    if not curves:
        raise SystemExit(f"no finished runs under {out / 'runs'}")
    return pd.concat(curves, ignore_index=True), pd.DataFrame(finals)


def mean_ci(values: np.ndarray, level: float = 0.95) -> tuple[float, float, float, int]:
    """Mean and a Student-t confidence interval over independent runs (seeds): (mean, lo, hi, n)."""
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    n = len(values)
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    if n == 1:
        return float(values[0]), math.nan, math.nan, 1
    test = paired_test(values, confidence=level)  # the package's t-interval (of paired differences or any sample)
    return test.mean, test.ci_low, test.ci_high, n


def summarise(frame: pd.DataFrame, by: list[str], value: str = "value") -> pd.DataFrame:
    """Mean and 95% t-interval of ``value`` over the rows of each ``by`` group (seeds)."""
    rows = []
    for key, group in frame.groupby(by, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        mean, lo, hi, n = mean_ci(group[value].to_numpy())
        rows.append({**dict(zip(by, key)), "mean": mean, "ci_low": lo, "ci_high": hi, "n": n})
    return pd.DataFrame(rows)


def paired_differences(frame: pd.DataFrame, by: list[str], arm: str, baseline: str, pair_on: str = "seed"
                       ) -> pd.DataFrame:
    """Per ``by`` group: every arm minus ``baseline``, paired on ``pair_on``; mean and 95% t-interval."""
    rows = []
    for key, group in frame.groupby(by, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        base = group[group[arm] == baseline].set_index(pair_on)["value"]
        for other, sub in group[group[arm] != baseline].groupby(arm):
            diff = (sub.set_index(pair_on)["value"] - base).dropna()
            mean, lo, hi, n = mean_ci(diff.to_numpy())
            rows.append({**dict(zip(by, key)), arm: other, "baseline": baseline, "mean_difference": mean,
                         "ci_low": lo, "ci_high": hi, "n_pairs": n})
    return pd.DataFrame(rows)


def write_plan(runs: list[GridRun], out: Path, extra: dict | None = None) -> None:
    """``out/plan.json``: how the experiment was called (command line, versions; the commands of earlier
    parts of it in ``earlier_commands``), ``extra``, and every run's factors and config; paths in it are
    portable (``gradflow.provenance.portable_path``), never a machine's absolute path."""
    import platform
    import shlex
    import sys

    import torch

    out.mkdir(parents=True, exist_ok=True)
    script = Path(sys.argv[0]).resolve()
    try:  # a module of this repository (run with python -m from its root): name it as such
        script = "-m " + ".".join(script.relative_to(REPO).with_suffix("").parts)
    except ValueError:
        script = _portable(str(script), out)
    args = [_portable(a, out) for a in sys.argv[1:]]
    command = f"python {script} " + shlex.join(args)
    # an experiment run in parts (another --models, more seeds) keeps the commands of the earlier parts
    previous = json.loads((out / "plan.json").read_text()) if (out / "plan.json").is_file() else {}
    earlier = [c for c in [*previous.get("earlier_commands", []), previous.get("command")] if c and c != command]
    plan = {"command": command, **({"earlier_commands": earlier} if earlier else {}), "torch": torch.__version__,
            "python": platform.python_version(), **(extra or {}), "runs": [asdict(r) for r in runs]}
    plan = _portable_tree(plan, out)
    (out / "plan.json").write_text(json.dumps(plan, indent=2, default=str) + "\n")
