"""``gradflow atlas --merge``: one ``atlas.csv``, its figures and ``meta.json`` from finished atlas directories.

The table is :func:`gradflow.analysis.atlas.atlas_table` (columns :data:`gradflow.schema.ATLAS_COLUMNS`),
the figures :func:`gradflow.figures.atlas.write_atlas_figures`, the tables (every model at matched depth
fractions, the last block's row; ``tables.md``, ``tables.tex``, ``latex/<name>.tex``)
:func:`gradflow.figures.atlas_tables.write_atlas_tables`. Unfinished models (a directory the
atlas started but did not finish) are left out and listed in ``meta.json`` under ``unfinished``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from gradflow.analysis.atlas import atlas_table, find_model_dirs
from gradflow.errors import OutputDirError
from gradflow.figures.atlas import write_atlas_figures
from gradflow.figures.atlas_tables import write_atlas_tables
from gradflow.provenance import portable_command, portable_path
from gradflow.runs.files import write_csv, write_meta
from gradflow.runs.meta import versions
from gradflow.schema import ATLAS_COLUMNS, ATLAS_FILE, META_FILE


def merge_atlas(atlas_dirs: Sequence[str | Path], out: str | Path, formats: Sequence[str] = ("pdf", "png"),
                resamples: int = 2000, seed: int = 0, command: str | Sequence[str] = "",
                latex_layout: str = "page") -> Path:
    """Write ``out/atlas.csv``, the atlas figures, its tables (``latex_layout``: one of
    :data:`gradflow.figures.tables.LATEX_LAYOUTS`) and ``out/meta.json``; returns the table's path."""
    start = time.time()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"output path {out} exists and is a file; pass a directory with --out.")
    done, unfinished = find_model_dirs(atlas_dirs)
    table = atlas_table(atlas_dirs, n_resamples=resamples, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(table, out / ATLAS_FILE, ATLAS_COLUMNS)
    figures = write_atlas_figures(table, out, formats)
    tables = write_atlas_tables(table, out, latex_layout)
    models = [{"model": info["model"], "family": info["family"], "n_layers": info["n_layers"],
               "dir": portable_path(path, out), "steps": info.get("steps", {}),
               "probe_skip_reason": info.get("probe_skip_reason")} for path, info in done]
    meta = {
        "kind": "atlas", "complete": True, "error": None, "inputs": [portable_path(d, out) for d in atlas_dirs],
        "models": models, "unfinished": [portable_path(p, out) for p in unfinished],
        "rows": len(table), "resamples": resamples, "seed": seed,
        "files": [ATLAS_FILE, *(p.name for p in figures), *(p.relative_to(out).as_posix() for p in tables)],
        "versions": versions(),
        "command": portable_command(command or sys.argv, out), "wall_s": round(time.time() - start, 2),
    }
    write_meta(out / META_FILE, meta)
    return out / ATLAS_FILE


__all__ = ["merge_atlas"]
