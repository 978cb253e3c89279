"""Run-directory files: channels.csv, sublayers.csv, sequences.parquet, sublayer_sequences.parquet, meta.json.

Every file is written atomically (a temporary file in the same directory, then ``os.replace``), so
a reader never sees a half-written table. Floats are written with 10 significant digits, so two
runs with the same inputs give byte-identical CSVs. Column order and dtypes are those of
:mod:`gradflow.schema` (public; see README "Output tables").
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from gradflow.errors import OutputDirError
from gradflow.runs.checkpoint import CHECKPOINT_DIR, fsync_dir, has_checkpoint
from gradflow.schema import OPTIONAL_RUN_FILES, RUN_FILES, SEQUENCE_DTYPES, SUBLAYER_SEQUENCE_DTYPES, arrow_schema

SEQUENCE_SCHEMA = arrow_schema(SEQUENCE_DTYPES)
SUBLAYER_SEQUENCE_SCHEMA = arrow_schema(SUBLAYER_SEQUENCE_DTYPES)


def prepare_output_dir(out: Path, overwrite: bool, resume: bool = False) -> None:
    """Create ``out``; refuse a non-empty one unless ``overwrite`` (then only run files are replaced, and an
    unfinished run's parts and checkpoints removed: ``--overwrite`` starts over deliberately). ``resume``: the
    directory of a run to continue: only the temporary files of writes a killed process left are removed."""
    if resume:
        remove_stale_temporaries(out)
        return
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"output path {out} exists and is a file; pass a directory path with --out.")
    if out.exists() and has_checkpoint(out) and not overwrite:
        raise OutputDirError(f"output directory {out} holds an unfinished run with a checkpoint; pass --resume to "
                             "continue it, --overwrite to start over, or choose another --out.")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise OutputDirError(f"output directory {out} exists and is not empty; pass --overwrite to replace "
                             "its run files, or choose another --out.")
    out.mkdir(parents=True, exist_ok=True)
    if overwrite:
        remove_run_files(out)


def remove_stale_temporaries(out: Path) -> list[str]:
    """Remove the temporary files of writes a killed process left in ``out`` (:func:`atomic_write_text`'s
    ``.<file>.<random>.tmp``: a SIGKILL or SIGTERM, as torchrun sends the other ranks when one dies, runs no cleanup);
    returns their names. Other files are left."""
    stems = {name.split(".")[0] for name in (*RUN_FILES, *OPTIONAL_RUN_FILES)}
    stale = [p for p in out.glob(".*.tmp") if p.is_file() and p.name[1:].split(".")[0] in stems]
    for path in stale:
        path.unlink(missing_ok=True)
    return sorted(p.name for p in stale)


def remove_run_files(out: Path) -> None:
    """Remove a run's files, its hidden parts and its checkpoints from ``out`` (other files are left)."""
    remove_stale_temporaries(out)
    for name in (*RUN_FILES, *OPTIONAL_RUN_FILES):
        (out / name).unlink(missing_ok=True)
    for hidden in [p for pattern in (".sequences*", ".sublayer_sequences*") for p in out.glob(pattern)]:
        hidden.unlink(missing_ok=True)
    shutil.rmtree(out / CHECKPOINT_DIR, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file (flushed and fsync'd) and a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
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
    """Appends per-sequence rows to a parquet table as they come, in durable parts.

    ``schema``: :data:`SEQUENCE_SCHEMA` (``sequences.parquet``, the default) or
    :data:`SUBLAYER_SEQUENCE_SCHEMA` (``sublayer_sequences.parquet``). Rows go to a hidden partial
    file (one row group per ``flush_rows``); :meth:`checkpoint` closes it as the next numbered part
    (``.<name>.part<k>``: a complete parquet file, fsync'd and renamed), and :meth:`close` writes the
    visible file from the parts, so it is always a complete parquet file. ``parts``: the parts kept
    from an earlier process (a resumed run); later parts and a partial file are removed.
    """

    def __init__(self, path: Path, flush_rows: int = 10_000, schema: pa.Schema = SEQUENCE_SCHEMA, parts: int = 0):
        self.path = path
        self.partial = path.with_name(f".{path.name}.partial")
        self.flush_rows = flush_rows
        self.schema = schema
        self.parts = parts
        self._pending: list[pd.DataFrame] = []
        self._rows = 0
        self._writer: pq.ParquetWriter | None = None
        for stale in [*part_paths(path)[parts:], self.partial]:
            stale.unlink(missing_ok=True)

    def add(self, frame: pd.DataFrame) -> None:
        """Queue rows; a row group is written every ``flush_rows`` rows."""
        self._pending.append(frame)
        self._rows += len(frame)
        if self._rows >= self.flush_rows:
            self.flush()

    def flush(self) -> None:
        """Write the queued rows as a row group of the partial file."""
        if self._pending:
            table = pa.Table.from_pandas(pd.concat(self._pending, ignore_index=True), schema=self.schema,
                                         preserve_index=False)
            if self._writer is None:
                self._writer = pq.ParquetWriter(self.partial, self.schema)
            self._writer.write_table(table)
        self._pending, self._rows = [], 0

    def checkpoint(self) -> int:
        """Close the rows so far as a durable part; the number of parts (what a resumed writer keeps)."""
        self.flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            with open(self.partial, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(self.partial, _part_path(self.path, self.parts))
            self.parts += 1
            fsync_dir(self.path.parent)
        return self.parts

    def close(self, keep_parts: bool = False) -> None:
        """Close the last part and write the visible file from every part (atomically); the parts are
        removed unless ``keep_parts`` (an unfinished run keeps them for ``--resume``)."""
        self.checkpoint()
        parts = part_paths(self.path)[: self.parts]
        if len(parts) == 1 and not keep_parts:  # one part is the whole table already
            os.replace(parts[0], self.path)
            return
        tmp = self.path.with_name(f".{self.path.name}.merge")
        with pq.ParquetWriter(tmp, self.schema) as writer:
            for part in parts:
                source = pq.ParquetFile(part)
                for group in range(source.num_row_groups):
                    writer.write_table(source.read_row_group(group))
        os.replace(tmp, self.path)
        if not keep_parts:
            for part in parts:
                part.unlink(missing_ok=True)

    def abandon(self) -> None:
        """After a failure: drop the unwritten rows and the partial file, keep the durable parts."""
        self._pending, self._rows = [], 0
        if self._writer is not None:
            try:
                self._writer.close()
            except OSError:
                pass
            self._writer = None
        self.partial.unlink(missing_ok=True)


def _part_path(path: Path, number: int) -> Path:
    return path.with_name(f".{path.name}.part{number:06d}")


def part_paths(path: Path) -> list[Path]:
    """The durable parts of table ``path`` on disk, in order."""
    return sorted(path.parent.glob(f".{path.name}.part[0-9]*"))


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
