"""gradflow.schema is the one run-directory contract: writers and readers use it, no other module spells it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from gradflow import analysis as A
from gradflow import schema as S
from gradflow.adapters import SUBLAYER_NAMES
from gradflow.roles import TOKEN_ROLES, Role

SRC = Path(S.__file__).resolve().parent  # src/gradflow
LITERAL_RUN = re.compile(r'(?:"[a-z_0-9.]+",\s*){2,}"[a-z_0-9.]+"')


def _literal_runs(min_names: int):
    """(module path relative to the package, line, names) of every run of >= min_names string literals."""
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for match in LITERAL_RUN.finditer(text):
            names = re.findall(r'"([a-z_0-9.]+)"', match.group())
            if len(names) >= min_names:
                yield path.relative_to(SRC).as_posix(), text[:match.start()].count("\n") + 1, names


def test_columns_are_the_dtype_keys():
    for dtypes, columns in ((S.CHANNEL_DTYPES, S.CHANNEL_COLUMNS), (S.SUBLAYER_DTYPES, S.SUBLAYER_COLUMNS),
                            (S.SEQUENCE_DTYPES, S.SEQUENCE_COLUMNS)):
        assert tuple(dtypes) == columns
        assert set(dtypes.values()) <= {"str", "int64", "float64"}
    assert list(S.TABLE_DTYPES) == [S.CHANNELS_FILE, S.SUBLAYERS_FILE, S.SEQUENCES_FILE]
    assert S.RUN_FILES == (*S.TABLE_DTYPES, S.META_FILE)


def test_sequence_arrow_schema():
    from gradflow.runs.files import SEQUENCE_SCHEMA

    assert SEQUENCE_SCHEMA.equals(S.arrow_schema(S.SEQUENCE_DTYPES))
    assert tuple(SEQUENCE_SCHEMA.names) == S.SEQUENCE_COLUMNS
    assert SEQUENCE_SCHEMA.field("site").type == pa.string() and SEQUENCE_SCHEMA.field("layer").type == pa.int64()
    assert SEQUENCE_SCHEMA.field("grad_norm_sum").type == pa.float64()


def test_role_and_sublayer_order():
    assert S.REPORTED_ROLES == TOKEN_ROLES[:Role.PAD]  # aggregators index roles by code
    assert S.DIAGNOSTIC_ROLES == (*S.REPORTED_ROLES, S.LOSS)
    assert S.SUBLAYER_ORDER == SUBLAYER_NAMES
    assert S.sorted_sublayers(["ffn.out", "mystery", "attn.q", "ffn.out"]) == ["attn.q", "ffn.out", "mystery"]
    rows = [(2, "attn.q", "weight", "kept"), (1, "ffn.out", "bias", "masked"), (1, "ffn.out", "weight", "relpos"),
            (1, "attn.v", "weight", "context"), (1, "ffn.out", "weight", "masked")]
    assert sorted(rows, key=lambda r: S.sublayer_key(*r)) == [
        (1, "attn.v", "weight", "context"), (1, "ffn.out", "weight", "masked"), (1, "ffn.out", "weight", "relpos"),
        (1, "ffn.out", "bias", "masked"), (2, "attn.q", "weight", "kept")]
    assert S.role_rank("loss", ("context", "loss")) == 1 and S.role_rank("pad", ("context",)) == 1


def test_readers_share_the_schema_objects():
    from gradflow.analysis import run_data
    from gradflow.figures import PLOT_ROLES
    from gradflow.runs import aggregate

    assert A.CHANNEL_COLUMNS is S.CHANNEL_COLUMNS and A.SEQUENCE_COLUMNS is S.SEQUENCE_COLUMNS
    assert A.SUBLAYER_COLUMNS is S.SUBLAYER_COLUMNS and A.SUBLAYER_ORDER is S.SUBLAYER_ORDER
    assert A.DEFAULT_ROLES is S.REPORTED_ROLES and PLOT_ROLES is S.REPORTED_ROLES
    assert run_data.TABLE_DTYPES is S.TABLE_DTYPES and aggregate.REPORTED_ROLES is S.REPORTED_ROLES


def test_no_column_list_outside_the_schema():
    """A run of five or more names of one table is a column list: only schema.py may spell one."""
    tables = [S.CHANNEL_COLUMNS, S.SUBLAYER_COLUMNS, S.SEQUENCE_COLUMNS, S.CHANNEL_VIEW_COLUMNS,
              *S.DIAGNOSTIC_COLUMNS.values(), *S.ANALYSIS_COLUMNS.values()]
    found = [(path, line) for path, line, names in _literal_runs(5)
             if path != "schema.py" and any(set(names) <= set(t) for t in tables)]
    assert found == []


def test_no_role_or_sublayer_order_outside_its_home():
    roles = set(TOKEN_ROLES) | {S.LOSS, "relpos"}
    found = [(path, line) for path, line, names in _literal_runs(5)
             if (set(names) <= roles and path not in ("roles.py", "schema.py"))
             or (set(names) <= set(SUBLAYER_NAMES) and len(names) == len(SUBLAYER_NAMES)
                 and path != "adapters/base.py")]
    assert found == []


def test_record_run_follows_the_schema(tmp_path, tiny_mlm_dir, tiny_corpus):
    from gradflow.cli import main

    out = tmp_path / "run"
    assert main(["record", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--out", str(out),
                 "--max-length", "24", "--batch-size", "4", "--limit", "8", "--quiet"]) == 0
    assert tuple(pd.read_csv(out / S.CHANNELS_FILE).columns) == S.CHANNEL_COLUMNS
    assert tuple(pd.read_csv(out / S.SUBLAYERS_FILE).columns) == S.SUBLAYER_COLUMNS
    assert pq.read_schema(out / S.SEQUENCES_FILE).remove_metadata().equals(S.arrow_schema(S.SEQUENCE_DTYPES))
    meta = json.loads((out / S.META_FILE).read_text())
    assert set(S.PROVENANCE_KEYS) <= set(meta) and set(S.REQUIRED_META_KEYS) <= set(meta)
    run = A.load_run(out)
    for frame, dtypes in ((run.channels, S.CHANNEL_DTYPES), (run.sublayers, S.SUBLAYER_DTYPES),
                          (run.sequences, S.SEQUENCE_DTYPES)):
        ints = [c for c, t in dtypes.items() if t == "int64"]
        assert all(str(frame[c].dtype) == "int64" for c in ints)


def test_the_old_import_path_still_works():
    """README and docs of gradflow 0.1 imported ``gradflow.runs.schema``; it is the same contract."""
    from gradflow.runs import schema as old

    assert old.CHANNEL_COLUMNS == S.CHANNEL_COLUMNS and old.SUBLAYER_ORDER == S.SUBLAYER_ORDER
