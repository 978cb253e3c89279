"""Run-directory files: channels.csv, sublayers.csv, sequences.parquet, sublayer_sequences.parquet, meta.json.

Every file is written atomically (a temporary file in the same directory, then ``os.replace``), so
a reader never sees a half-written table. Floats are written with 10 significant digits, so two
runs with the same inputs give byte-identical CSVs. Column order and dtypes are those of
:mod:`gradflow.schema` (public; see README "Output tables").
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from gradflow.errors import OutputDirError
from gradflow.schema import OPTIONAL_RUN_FILES, RUN_FILES, SEQUENCE_DTYPES, SUBLAYER_SEQUENCE_DTYPES, arrow_schema

SEQUENCE_SCHEMA = arrow_schema(SEQUENCE_DTYPES)
SUBLAYER_SEQUENCE_SCHEMA = arrow_schema(SUBLAYER_SEQUENCE_DTYPES)


def prepare_output_dir(out: Path, overwrite: bool) -> None:
    """Create ``out``; refuse a non-empty one unless ``overwrite`` (then only run files are replaced)."""
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"output path {out} exists and is a file; pass a directory path with --out.")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise OutputDirError(f"output directory {out} exists and is not empty; pass --overwrite to replace "
                             "its run files, or choose another --out.")
    out.mkdir(parents=True, exist_ok=True)
    if overwrite:
        for name in (*RUN_FILES, *OPTIONAL_RUN_FILES):
            (out / name).unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file and a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_csv(frame: pd.DataFrame, path: Path, columns: tuple[str, ...]) -> None:
    """Write a table with a fixed column order and deterministic float formatting."""
    frame = frame.reindex(columns=list(columns))
    atomic_write_text(path, frame.to_csv(index=False, float_format="%.10g", lineterminator="\n"))


def write_meta(path: Path, meta: dict) -> None:
    """meta.json, sorted keys, atomically."""
    atomic_write_text(path, json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")


class SequenceWriter:
    """Appends per-sequence rows to a parquet table as they come (one row group per flush).

    ``schema``: :data:`SEQUENCE_SCHEMA` (``sequences.parquet``, the default) or
    :data:`SUBLAYER_SEQUENCE_SCHEMA` (``sublayer_sequences.parquet``). Rows go to a hidden partial
    file that :meth:`close` renames into place, so the visible file is always a complete parquet file.
    """

    def __init__(self, path: Path, flush_rows: int = 10_000, schema: pa.Schema = SEQUENCE_SCHEMA):
        self.path = path
        self.partial = path.with_name(f".{path.name}.partial")
        self.flush_rows = flush_rows
        self.schema = schema
        self._pending: list[pd.DataFrame] = []
        self._rows = 0
        self._writer = pq.ParquetWriter(self.partial, schema)

    def add(self, frame: pd.DataFrame) -> None:
        self._pending.append(frame)
        self._rows += len(frame)
        if self._rows >= self.flush_rows:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            table = pa.Table.from_pandas(pd.concat(self._pending, ignore_index=True), schema=self.schema,
                                         preserve_index=False)
            self._writer.write_table(table)
        self._pending, self._rows = [], 0

    def close(self) -> None:
        """Flush, finish the file and move it into place."""
        self.flush()
        self._writer.close()
        os.replace(self.partial, self.path)


def merge_sequence_parts(parts: list[Path], path: Path, schema: pa.Schema = SEQUENCE_SCHEMA) -> None:
    """Concatenate per-process parquet parts of ``schema``, sorted by sequence, into ``path`` (atomically)."""
    tables = [pq.read_table(p) for p in parts if p.exists()]
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    table = table.sort_by([("sequence_index", "ascending")])
    tmp = path.with_name(f".{path.name}.merge")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    for p in parts:
        if p != path:
            p.unlink(missing_ok=True)
