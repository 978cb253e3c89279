"""Reading probe directories (``gradflow probe``) into one tidy table for figures and comparisons."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from gradflow.analysis.probes import drop_difference_ci
from gradflow.errors import UsageError
from gradflow.schema import (
    META_FILE,
    PROBE_DIFFERENCE_COLUMNS,
    PROBE_DROP_COLUMNS,
    PROBE_DROP_DTYPES,
    PROBE_DROPS_FILE,
    PROBE_DTYPES,
    PROBE_WORDS_FILE,
    PROBES_FILE,
)


@dataclass(frozen=True)
class ProbeTables:
    """Probe rows and last-layer drops of one or more probe directories, each row labelled ``label``;
    ``labels`` holds each directory's label in the order given, ``families`` its probe family
    (``"logistic"`` or ``"mlp"``, from ``meta.json``'s options; ``"logistic"`` where a run predates the option)."""

    probes: pd.DataFrame
    drops: pd.DataFrame
    incomplete: tuple[str, ...]
    labels: tuple[str, ...] = ()
    families: tuple[str, ...] = ()


def is_probe_dir(path: str | Path) -> bool:
    """True when ``path`` holds a ``probes.csv`` (a ``gradflow probe`` output)."""
    return (Path(path) / PROBES_FILE).is_file()


def load_probe_dirs(paths: Sequence[str | Path], labels: Sequence[str] | None = None) -> ProbeTables:
    """Concatenate the tables of probe directories; ``labels`` default to each table's model name.

    Raises :class:`UsageError` naming a directory without ``probes.csv`` or with no rows.
    """
    if labels is not None and len(labels) != len(paths):
        raise UsageError(f"{len(labels)} labels for {len(paths)} probe directories; give one label per directory")
    probes, drops, incomplete, names, families = [], [], [], [], []
    for k, path in enumerate(paths):
        path = Path(path)
        if not is_probe_dir(path):
            raise UsageError(f"{path} is not a probe directory (no {PROBES_FILE}); make one with `gradflow probe`")
        frame = pd.read_csv(path / PROBES_FILE).astype({c: t for c, t in PROBE_DTYPES.items() if t != "float64"})
        if frame.empty:
            raise UsageError(f"{path / PROBES_FILE} has no rows (the run stopped before its first probe)")
        drop = (pd.read_csv(path / PROBE_DROPS_FILE) if (path / PROBE_DROPS_FILE).is_file()
                else pd.DataFrame(columns=list(PROBE_DROP_COLUMNS)))
        drop = drop.astype({c: t for c, t in PROBE_DROP_DTYPES.items() if t == "str"})
        label = labels[k] if labels is not None else str(frame["model"].iloc[0])
        names.append(label)
        probes.append(frame.assign(label=label))
        drops.append(drop.assign(label=label))
        meta_path = path / META_FILE
        meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
        if not meta.get("complete", False):
            incomplete.append(label)
        families.append(str(meta.get("options", {}).get("probe", "logistic")))
    return ProbeTables(pd.concat(probes, ignore_index=True), pd.concat(drops, ignore_index=True), tuple(incomplete),
                       tuple(names), tuple(families))


@dataclass(frozen=True)
class ProbeDifferences:
    """:func:`probe_drop_differences`: ``table`` (columns ``PROBE_DIFFERENCE_COLUMNS``, possibly empty)
    and ``notes``, one sentence per pair that could not be compared and why."""

    table: pd.DataFrame
    notes: tuple[str, ...]


def _task_of(path: Path) -> tuple[str, str]:
    meta_path = path / META_FILE
    meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
    task = meta.get("task", {})
    return str(task.get("name", "")), str(task.get("source", ""))


def _correct_by_layer(words: pd.DataFrame, regime: str) -> pd.DataFrame:
    """(sentence, word) x layer table of probe correctness for one regime."""
    rows = words[words["regime"] == regime]
    return rows.pivot(index=["sentence", "word"], columns="layer", values="correct").dropna()


def probe_drop_differences(paths: Sequence[str | Path], labels: Sequence[str] | None = None,
                           n_resamples: int = 1000, seed: int = 0) -> ProbeDifferences:
    """Last-layer accuracy drop of each probe directory minus its task's baseline, per regime.

    The baseline of a task is the first directory that probed it (directories of several tasks may
    be passed together). Paired over the test words both directories scored (same task and source;
    a word is keyed by its sentence and its index there, so models whose tokenizers cut different
    words off are compared on the words both kept), with
    :func:`~gradflow.analysis.probes.drop_difference_ci`. A directory without
    ``probe_words.parquet`` (gradflow probe writes it since it keeps per-word results) is left out
    with a note.
    """
    names = load_probe_dirs(paths, labels).labels  # the same checks and messages as the figures
    rows, notes = [], []
    baselines: dict[tuple[str, str], tuple[pd.DataFrame, str]] = {}  # task -> the baseline's words and label
    for path, label in zip(map(Path, paths), names):
        if not (path / PROBE_WORDS_FILE).is_file():
            notes.append(f"{path} has no {PROBE_WORDS_FILE} (rerun gradflow probe there): it has no paired drop "
                         "difference.")
            continue
        task, words = _task_of(path), pd.read_parquet(path / PROBE_WORDS_FILE)
        if task not in baselines:
            baselines[task] = (words, label)
            continue
        base_words, base_label = baselines[task]
        rows += _differences(words, label, base_words, base_label, task[0], n_resamples, seed, notes)
    return ProbeDifferences(pd.DataFrame(rows, columns=list(PROBE_DIFFERENCE_COLUMNS)), tuple(notes))


def _differences(words: pd.DataFrame, label: str, base_words: pd.DataFrame, base_label: str, task: str,
                 n_resamples: int, seed: int, notes: list[str]) -> list[dict]:
    """One row per regime both probed: drop(words) - drop(base_words), paired over the shared words."""
    rows = []
    for regime in [r for r in base_words["regime"].unique() if r in set(words["regime"])]:
        a = _correct_by_layer(words, regime).add_prefix("a:")
        b = _correct_by_layer(base_words, regime).add_prefix("b:")
        joined = a.join(b, how="inner")
        if joined.empty:
            notes.append(f"{label} and {base_label} share no test word in regime {regime}.")
            continue
        sentence = joined.index.get_level_values("sentence").to_numpy()
        diff, low, high = drop_difference_ci([joined[k].to_numpy(bool) for k in a.columns],
                                             [joined[k].to_numpy(bool) for k in b.columns],
                                             sentence, n_resamples, seed)
        rows.append({"task": task, "regime": regime, "metric": "accuracy", "label": label, "baseline": base_label,
                     "difference": diff, "ci_low": low, "ci_high": high, "n_words": len(joined),
                     "n_sentences": int(pd.unique(sentence).size)})
    return rows


__all__ = ["ProbeDifferences", "ProbeTables", "is_probe_dir", "load_probe_dirs", "probe_drop_differences"]
