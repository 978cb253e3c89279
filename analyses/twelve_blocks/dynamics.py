"""The last block's deficit through pretraining (issue 31): three measures at every weight snapshot.

For each model (``--run LABEL=DIR``, a pretraining run with ``--snapshots``) and each of its snapshots
(file checked against ``snapshots.csv`` by SHA-256 before it is loaded):

- ``context_loss_ratio``: :func:`gradflow.analysis.context_ratio` of a ``gradflow record`` run (MLM loss,
  the committed sample, seed 0, ``--limit`` sequences) at every depth (layer 0 = embeddings, L = last block);
- ``pressure``: :func:`gradflow.analysis.pressure.context_pressure` of the same sample recorded under the
  all-positions loss, the last block's sublayers (metric ``pressure`` and ``vs_earlier``: over the mean of
  the earlier blocks);
- ``probe_drop``: ``gradflow probe``'s last-layer drop (unmasked regime, block outputs) on each task
  (brown-pos, brown-propn; ``--probe-limit`` sentences per split), metric ``accuracy`` and
  ``code_length_bits``.

Writes ``<out>/dynamics.csv`` (:data:`COLUMNS`, one row per model x step x measure x detail x metric x
depth, tokens seen included) after every snapshot, and ``<out>/meta.json`` (settings, source revision,
the runs' snapshot hashes, seconds per snapshot, ``partial``: true until every planned snapshot of every
model is measured). Resumable: a snapshot already in the table (same model, step and SHA-256) is skipped;
a step measured from other bytes, or with other settings, is refused.

    python -m analyses.twelve_blocks.dynamics [--run LABEL=DIR ...] [--out figures/twelve-blocks/dynamics]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pandas as pd

from analyses.pretraining.recipe.snapshots import SNAPSHOT_DIR, snapshot_steps
from analyses.twelve_blocks.snapshot import RunInfo, Snapshot, load_snapshot, parse_runs, read_run, run_snapshots
from gradflow.analysis import context_ratio, load_run
from gradflow.analysis.pressure import context_pressure
from gradflow.errors import GradflowError, UsageError
from gradflow.models import LoadedModel
from gradflow.provenance import portable_command, portable_path, source_revision
from gradflow.runs.probe import ProbeConfig, resolve_task, run_probes
from gradflow.runs.record import RecordConfig, record_corpus

COLUMNS = ("model", "step", "tokens", "sha256", "measure", "detail", "metric", "layer", "value", "ci_low", "ci_high")
"""``dynamics.csv``: ``detail`` is the point (``out``) of the ratio, the sublayer of the pressure, the task of a
probe drop; ``layer``: depth (0 = embeddings, L = last block); ``value`` with its 95% CI (sequence or
sentence bootstrap)."""
DYNAMICS_FILE = "dynamics.csv"
META_FILE = "meta.json"
OUT = "figures/twelve-blocks/dynamics"
WORK = "build/twelve-blocks-dynamics"
DEFAULT_RUNS = ("gradflow-mini12-en=build/gradflow-mini12-en",
                "gradflow-mini12-en-alltoken=build/gradflow-mini12-en-alltoken")
TASKS = ("brown-pos", "brown-propn")


@dataclass(frozen=True)
class Settings:
    """What every snapshot is measured with (stored in meta.json; a resume must match it)."""

    limit: int = 128  # sequences of the committed sample recorded per snapshot and loss
    seed: int = 0
    batch_size: int = 8
    max_length: int = 128
    resamples: int = 2000  # bootstrap resamples of the ratio and the pressure
    tasks: tuple[str, ...] = TASKS  # probe tasks (built-in names or labelled files); () = no probes
    probe_limit: int = 600  # sentences per split
    probe_resamples: int = 1000
    code_length: bool = True


def measure_snapshot(loaded: LoadedModel, label: str, snapshot: Snapshot, settings: Settings,
                     work: Path) -> tuple[pd.DataFrame, dict[str, float]]:
    """Every measure of one loaded snapshot -> (rows in :data:`COLUMNS`, seconds per part).

    Intermediate run directories go under ``work`` (overwritten). ``settings.tasks`` are probed in order.
    """
    seconds: dict[str, float] = {}
    parts: list[pd.DataFrame] = []
    start = time.time()
    ratio = context_ratio(load_run(_record(loaded, snapshot, settings, work / "record", "mlm")),
                          n_resamples=settings.resamples, seed=settings.seed)
    parts.append(pd.DataFrame({"measure": "context_loss_ratio", "detail": "out", "metric": "ratio",
                               "layer": ratio["layer"], "value": ratio["ratio"], "ci_low": ratio["ci_low"],
                               "ci_high": ratio["ci_high"]}))
    seconds["record"] = time.time() - start
    start = time.time()
    pressure = context_pressure(load_run(_record(loaded, snapshot, settings, work / "pressure", "all-positions")),
                                n_resamples=settings.resamples, seed=settings.seed)
    last = pressure[pressure["last_block"]]
    for metric, value, low, high in (("pressure", "pressure", "ci_low", "ci_high"),
                                     ("vs_earlier", "vs_earlier", "vs_earlier_ci_low", "vs_earlier_ci_high")):
        parts.append(pd.DataFrame({"measure": "pressure", "detail": last["sublayer"], "metric": metric,
                                   "layer": last["layer"], "value": last[value], "ci_low": last[low],
                                   "ci_high": last[high]}))
    seconds["pressure"] = time.time() - start
    for k, task in enumerate(settings.tasks):
        start = time.time()
        drops = _probe(loaded, snapshot, settings, task, work / f"probe-{k}")
        parts.append(drops)
        seconds[f"probe:{drops['detail'].iloc[0] if len(drops) else task}"] = time.time() - start
    rows = pd.concat(parts, ignore_index=True)
    rows.insert(0, "sha256", snapshot.sha256)
    rows.insert(0, "tokens", snapshot.tokens)
    rows.insert(0, "step", snapshot.step)
    rows.insert(0, "model", label)
    return rows[list(COLUMNS)], {k: round(v, 2) for k, v in seconds.items()}


def _record(loaded: LoadedModel, snapshot: Snapshot, settings: Settings, out: Path, loss: str) -> Path:
    """``gradflow record`` of the snapshot on the committed sample into ``out``; the run directory."""
    record_corpus(RecordConfig(out=str(out), model=str(snapshot.path), seed=settings.seed, limit=settings.limit,
                               batch_size=settings.batch_size, max_length=min(settings.max_length,
                                                                              loaded.max_positions()),
                               loss=loss, overwrite=True, quiet=True,
                               command=f"analyses.twelve_blocks.dynamics ({loss})"), loaded)
    return out


def _probe(loaded: LoadedModel, snapshot: Snapshot, settings: Settings, task: str, out: Path) -> pd.DataFrame:
    """``gradflow probe`` of the snapshot on ``task``: its last-layer drops (unmasked), as dynamics rows."""
    # (the recipe's WordPiece tokenizer takes pre-split words as it is: no prefix-space reload, unlike atlas)
    run = run_probes(ProbeConfig(model=str(snapshot.path), task=task, out=str(out), limit=settings.probe_limit,
                                 max_length=min(settings.max_length, loaded.max_positions()), seed=settings.seed,
                                 n_resamples=settings.probe_resamples, code_length=settings.code_length,
                                 overwrite=True), loaded)
    drops = run.drops[run.drops["regime"] == "unmasked"]
    last = int(run.probes["layer"].max())
    return pd.DataFrame({"measure": "probe_drop", "detail": drops["task"], "metric": drops["metric"], "layer": last,
                         "value": drops["last_layer_drop"], "ci_low": drops["ci_low"], "ci_high": drops["ci_high"]})


def read_table(out: Path) -> pd.DataFrame:
    """``dynamics.csv`` in ``out`` (empty, with :data:`COLUMNS`, when absent)."""
    path = out / DYNAMICS_FILE
    if not path.is_file():
        return pd.DataFrame(columns=list(COLUMNS))
    table = pd.read_csv(path, keep_default_na=False, na_values=[""], dtype={"sha256": str, "detail": str})
    if tuple(table.columns) != COLUMNS:
        raise UsageError(f"{path} has columns {list(table.columns)}, not {list(COLUMNS)}; move it away to start over")
    return table


def measured_keys(table: pd.DataFrame) -> dict[tuple[str, int], str]:
    """{(model, step): sha256} of the snapshots in the table."""
    keys = table[["model", "step", "sha256"]].drop_duplicates()
    return {(str(m), int(s)): str(h) for m, s, h in keys.itertuples(index=False)}


def check_resume(out: Path, table: pd.DataFrame, settings: Settings) -> None:
    """Refuse to add rows measured with other settings than the table's (meta.json's ``settings``)."""
    meta_file = out / META_FILE
    if table.empty or not meta_file.is_file():
        return
    stored = json.loads(meta_file.read_text(encoding="utf-8")).get("settings")
    if stored != _plain(asdict(settings)):
        raise UsageError(f"{out / DYNAMICS_FILE} was measured with other settings ({stored}) than now "
                         f"({_plain(asdict(settings))}); pass the same options, or a new --out to start over")


def plan(runs: dict[str, Path], table: pd.DataFrame) -> tuple[dict[str, RunInfo], list[tuple[str, Snapshot]]]:
    """(the runs found, the snapshots still to measure); a step measured from other bytes is refused."""
    done = measured_keys(table)
    infos: dict[str, RunInfo] = {}
    todo: list[tuple[str, Snapshot]] = []
    for label, folder in runs.items():
        if not folder.is_dir():
            print(f"[dynamics] {label}: {folder} does not exist (not trained yet, or its folder is gone: its rows "
                  "and meta.json record stay); skipped", flush=True)
            continue
        if not (folder / "meta.json").is_file() and not (folder / SNAPSHOT_DIR).is_dir():
            # the recipe writes meta.json once its data is ready: a run starting now (any other folder
            # without meta.json, one holding snapshots, is refused by read_run below)
            print(f"[dynamics] {label}: {folder} has no meta.json and no snapshots yet (a run starting now?); "
                  "skipped", flush=True)
            continue
        infos[label] = replace(read_run(folder), snapshots=tuple(run_snapshots(folder)))
        for snap in infos[label].snapshots:
            measured = done.get((label, snap.step))
            if measured is None:
                todo.append((label, snap))
            elif measured != snap.sha256:
                raise UsageError(f"{label} step {snap.step} is in the table measured on SHA-256 {measured[:12]}..., "
                                 f"but {snap.path} is {snap.sha256[:12]}... now (the run was retrained?); remove "
                                 "that model's rows, or pass a new --out")
    return infos, todo


def write_table(out: Path, table: pd.DataFrame) -> None:
    """``dynamics.csv`` sorted by model, step and measure (atomically)."""
    order = {m: k for k, m in enumerate(("context_loss_ratio", "pressure", "probe_drop"))}
    table = table.assign(_k=table["measure"].map(order)).sort_values(
        ["model", "step", "_k", "detail", "metric", "layer"], kind="stable").drop(columns="_k")
    tmp = out / f".{DYNAMICS_FILE}.tmp"
    table.to_csv(tmp, index=False, float_format="%.6g")
    tmp.replace(out / DYNAMICS_FILE)


def write_meta(out: Path, runs: dict[str, Path], infos: dict[str, RunInfo], table: pd.DataFrame,
               settings: Settings, timings: list[dict], argv: list[str]) -> dict:
    """meta.json: settings, provenance, each run's snapshots (hashes) and which are measured, ``partial``."""
    previous = json.loads((out / META_FILE).read_text(encoding="utf-8")) if (out / META_FILE).is_file() else {}
    done = measured_keys(table)
    models: dict[str, dict] = {}
    for label, folder in runs.items():
        info = infos.get(label)
        earlier = previous.get("models", {}).get(label, {})
        if info is None and earlier.get("found"):
            # measured before, its run folder gone since (a machine that did not keep build/): the record of
            # its snapshots (hashes, planned and measured steps) stands, and the table keeps its rows
            measured = sorted(step for (m, step) in done if m == label)
            models[label] = {**earlier, "measured_steps": measured, "folder_gone": True,
                             "complete": _all_measured(earlier["planned_steps"], measured)}
            continue
        if info is None:
            models[label] = {"run": portable_path(folder, out), "found": False, "complete": False}
            continue
        planned = list(snapshot_steps(info.config.steps, info.config.snapshots))
        listed = [{"step": s.step, "tokens": s.tokens, "sha256": s.sha256} for s in info.snapshots]
        measured = sorted(step for (m, step) in done if m == label)
        models[label] = {"run": portable_path(folder, out), "found": True, "arch": info.config.arch,
                         "loss": info.config.loss, "layers": info.config.layers, "steps": info.config.steps,
                         "planned_steps": planned, "snapshots": listed, "measured_steps": measured,
                         "tokenizer": portable_path(info.tokenizer, out), "tokenizer_sha256": info.tokenizer_sha256,
                         "complete": _all_measured(planned, measured)}
    by_key = {(r["model"], r["step"], r["sha256"]): r for r in [*previous.get("measured", []), *timings]}
    seconds = [by_key[k] for k in sorted(by_key)]
    meta = {"kind": "twelve-blocks-dynamics", "partial": not all(m["complete"] for m in models.values()),
            "note": "partial: not every planned snapshot of every model is measured; the figure and table are "
                    "drawn from what is", "settings": _plain(asdict(settings)), "models": models,
            "measured": seconds, "source_revision": source_revision(), "versions": _versions(),
            "command": portable_command(["python", "-m", "analyses.twelve_blocks.dynamics", *argv], out)}
    if not meta["partial"]:
        meta.pop("note")
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def _all_measured(planned: list[int], measured: list[int]) -> bool:
    """Whether every planned snapshot step is measured (False when none is planned)."""
    return bool(planned) and set(planned) <= set(measured)


def _plain(value):
    """JSON-comparable form (tuples as lists)."""
    return json.loads(json.dumps(value))


def _versions() -> dict[str, str]:
    import sklearn
    import torch
    import transformers

    from gradflow.version import __version__

    return {"gradflow": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "scikit-learn": sklearn.__version__}


def measure(runs: dict[str, Path], out: Path, settings: Settings, work: Path, argv: list[str] | None = None,
            keep_runs: bool = False, max_snapshots: int | None = None) -> pd.DataFrame:
    """Measure every snapshot of ``runs`` not yet in ``out/dynamics.csv``; return the whole table.

    The table and meta.json are rewritten after each snapshot, so an interrupted run keeps what it measured.
    ``max_snapshots``: stop after measuring this many (None: all).
    """
    for task in settings.tasks:  # a task without data fails here, before any model is loaded
        resolve_task(task, settings.seed)
    out.mkdir(parents=True, exist_ok=True)
    table = read_table(out)
    check_resume(out, table, settings)
    infos, todo = plan(runs, table)
    if not infos:
        raise UsageError(f"none of the runs exists ({', '.join(str(p) for p in runs.values())}); train one first "
                         "(python -m analyses.pretraining.pretrain_base ... --snapshots 8)")
    timings: list[dict] = []  # seconds per snapshot measured now (meta.json's ``measured``)
    for count, (label, snap) in enumerate(todo[:max_snapshots], 1):
        print(f"[dynamics] {count}/{len(todo)} {label} step {snap.step} ({snap.tokens:,} tokens)", flush=True)
        start = time.time()
        loaded = load_snapshot(infos[label], snap, label)
        folder = work / label / f"step-{snap.step:06d}"
        rows, seconds = measure_snapshot(loaded, label, snap, settings, folder)
        if not keep_runs:
            shutil.rmtree(folder, ignore_errors=True)
        table = rows if table.empty else pd.concat([table, rows], ignore_index=True)
        timings.append({"model": label, "step": snap.step, "sha256": snap.sha256, "seconds": seconds,
                              "total_s": round(time.time() - start, 2)})
        write_table(out, table)
        write_meta(out, runs, infos, table, settings, timings, argv or [])
        print(f"[dynamics] {label} step {snap.step}: {timings[-1]['total_s']:.0f} s {seconds}", flush=True)
    if not todo:
        print("[dynamics] every snapshot is measured already", flush=True)
    write_meta(out, runs, infos, table, settings, [], argv or [])
    return read_table(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", action="append", default=None, metavar="LABEL=DIR",
                   help=f"a pretraining run with snapshots (repeat; default: {' '.join(DEFAULT_RUNS)})")
    p.add_argument("--out", type=Path, default=Path(OUT), help="table folder (default %(default)s)")
    p.add_argument("--work", type=Path, default=Path(WORK), help="intermediate run folders (default %(default)s)")
    p.add_argument("--keep-runs", action="store_true", help="keep the intermediate record and probe folders")
    p.add_argument("--limit", type=int, default=Settings.limit, help="sequences recorded per snapshot and loss")
    p.add_argument("--tasks", nargs="*", default=list(TASKS), help="probe tasks (none: no probes)")
    p.add_argument("--probe-limit", type=int, default=Settings.probe_limit, help="sentences per split")
    p.add_argument("--no-code-length", action="store_true", help="probe accuracy only (no online code length)")
    p.add_argument("--max-snapshots", type=int, default=None, help="stop after measuring this many snapshots")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = p.parse_args(argv)
    import torch

    threads = torch.get_num_threads()  # restored on return: an in-process caller keeps its own setting
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        runs = parse_runs(args.run or list(DEFAULT_RUNS))
        settings = Settings(limit=args.limit, tasks=tuple(args.tasks), probe_limit=args.probe_limit,
                            code_length=not args.no_code_length)
        measure(runs, args.out, settings, args.work, argv, args.keep_runs, args.max_snapshots)
    except GradflowError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
