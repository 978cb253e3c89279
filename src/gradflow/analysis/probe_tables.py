"""Reading probe directories (``gradflow probe``) into one tidy table for figures and comparisons."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from gradflow.errors import UsageError
from gradflow.runs.schema import (
    META_FILE,
    PROBE_DROP_COLUMNS,
    PROBE_DROP_DTYPES,
    PROBE_DROPS_FILE,
    PROBE_DTYPES,
    PROBES_FILE,
)


@dataclass(frozen=True)
class ProbeTables:
    """Probe rows and last-layer drops of one or more probe directories, each row labelled ``label``."""

    probes: pd.DataFrame
    drops: pd.DataFrame
    incomplete: tuple[str, ...]


def is_probe_dir(path: str | Path) -> bool:
    """True when ``path`` holds a ``probes.csv`` (a ``gradflow probe`` output)."""
    return (Path(path) / PROBES_FILE).is_file()


def load_probe_dirs(paths: Sequence[str | Path], labels: Sequence[str] | None = None) -> ProbeTables:
    """Concatenate the tables of probe directories; ``labels`` default to each table's model name.

    Raises :class:`UsageError` naming a directory without ``probes.csv`` or with no rows.
    """
    if labels is not None and len(labels) != len(paths):
        raise UsageError(f"{len(labels)} labels for {len(paths)} probe directories; give one label per directory")
    probes, drops, incomplete = [], [], []
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
        probes.append(frame.assign(label=label))
        drops.append(drop.assign(label=label))
        meta_path = path / META_FILE
        meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
        if not meta.get("complete", False):
            incomplete.append(label)
    return ProbeTables(pd.concat(probes, ignore_index=True), pd.concat(drops, ignore_index=True), tuple(incomplete))


__all__ = ["ProbeTables", "is_probe_dir", "load_probe_dirs"]
