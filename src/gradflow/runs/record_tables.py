"""The per-sequence tables of a record run, written as the batches come: which ones a run writes, and their rows.

``sequences.parquet`` always; ``sublayer_sequences.parquet`` when sublayers are recorded;
``mask_ratios.parquet`` under masked diffusion (each sequence's ratio t, which the report bins the
gradient flow by). Each is a :class:`gradflow.runs.files.SequenceWriter` fed by a row function of
the batch's record and the batch itself; under ``torchrun`` each process writes its own part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa

from gradflow.hooks.recorder import BatchRecord
from gradflow.inputs.masking import MaskedBatch
from gradflow.runs.aggregate import sequence_rows, sublayer_sequence_rows
from gradflow.runs.files import SEQUENCE_SCHEMA, SUBLAYER_SEQUENCE_SCHEMA, SequenceWriter
from gradflow.schema import MASK_RATIO_DTYPES, MASK_RATIOS_FILE, SEQUENCES_FILE, SUBLAYER_SEQUENCES_FILE, arrow_schema

MASK_RATIO_SCHEMA = arrow_schema(MASK_RATIO_DTYPES)
Rows = Callable[[BatchRecord, MaskedBatch], pd.DataFrame]


@dataclass(frozen=True)
class SequenceTable:
    """One per-sequence table: its file name, arrow schema, rows a row group and row function."""

    name: str
    schema: pa.Schema
    flush_rows: int
    rows: Rows


def mask_ratio_rows(record: BatchRecord, batch: MaskedBatch) -> pd.DataFrame:
    """``mask_ratios.parquet`` rows of one batch: each sequence's index and masking ratio t (B rows)."""
    assert batch.mask_ratio is not None
    return pd.DataFrame({"sequence_index": batch.sequence_index.cpu().numpy().astype("int64"),
                         "mask_ratio": batch.mask_ratio.cpu().numpy().astype("float64")})


def sequence_tables(sublayers: bool, diffusion: bool) -> list[SequenceTable]:
    """The per-sequence tables a run writes: sublayer sums with ``sublayers``, ratios under masked ``diffusion``."""
    tables = [SequenceTable(SEQUENCES_FILE, SEQUENCE_SCHEMA, 10_000, lambda record, batch: sequence_rows(record))]
    if sublayers:
        tables.append(SequenceTable(SUBLAYER_SEQUENCES_FILE, SUBLAYER_SEQUENCE_SCHEMA, 50_000,
                                    lambda record, batch: sublayer_sequence_rows(record)))
    if diffusion:
        tables.append(SequenceTable(MASK_RATIOS_FILE, MASK_RATIO_SCHEMA, 10_000, mask_ratio_rows))
    return tables


def part_name(name: str, rank: int, world: int) -> str:
    """Table ``name`` of this run or, with several processes, rank ``rank``'s part of it (``x.rank1.parquet``)."""
    return name.replace(".parquet", f".rank{rank}.parquet") if world > 1 else name


def open_writers(out: Path, tables: list[SequenceTable], rank: int, world: int,
                 parts: dict[str, int]) -> list[tuple[SequenceWriter, Rows]]:
    """A writer per table in ``out`` and its row function; ``parts``: each table's durable parts kept from the
    checkpoint a resumed job continues."""
    writers = []
    for table in tables:
        path = out / part_name(table.name, rank, world)
        writers.append((SequenceWriter(path, table.flush_rows, table.schema, parts.get(path.name, 0)), table.rows))
    return writers


DISCARD_PATTERNS: tuple[str, ...] = ("sequences*.parquet", ".sequences*", "sublayer_sequences*.parquet",
                                     ".sublayer_sequences*", "mask_ratios*.parquet", ".mask_ratios*")
"""Globs of everything the per-sequence writers leave in a run directory (tables, parts, partial files)."""


__all__ = ["DISCARD_PATTERNS", "MASK_RATIO_SCHEMA", "SequenceTable", "mask_ratio_rows", "open_writers", "part_name",
           "sequence_tables"]
