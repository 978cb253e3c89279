"""gradflow.schema is the one run-directory contract: writers and readers use it, no other module spells it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gradflow import analysis as A
from gradflow import schema as S
from gradflow.adapters import SUBLAYER_NAMES
from gradflow.roles import TOKEN_ROLES

SRC = Path(S.__file__).resolve().parent  # src/gradflow
LITERAL_RUN = re.compile(r'(?:"[a-z_0-9.]+",\s*){2,}"[a-z_0-9.]+"')


def _literal_runs(min_names: int, root: Path = SRC):
    """(module path relative to ``root``, line, names) of every run of >= min_names string literals."""
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for match in LITERAL_RUN.finditer(text):
            names = re.findall(r'"([a-z_0-9.]+)"', match.group())
            if len(names) >= min_names:
                yield path.relative_to(root).as_posix(), text[:match.start()].count("\n") + 1, names


def _schema_tables() -> list[tuple[str, ...]]:
    """Every column list the schema defines: each ``*_COLUMNS`` tuple (or dict of tuples), each ``*_TABLES``
    dict of tuples and the columns of each ``*_FIELDS`` dict (column -> description)."""
    tables = []
    for name, value in vars(S).items():
        if name.endswith(("_COLUMNS", "_TABLES")):
            tables += list(value.values()) if isinstance(value, dict) else [value]
        elif name.endswith("_FIELDS"):
            tables.append(tuple(value))
    return [tuple(t) for t in tables]


def _column_lists(root: Path = SRC) -> list[tuple[str, int]]:
    """(module, line) of each column list outside schema.py: a run of five or more names of one table, or
    a whole table of three or more names spelled out (``("step", "loss", "learning_rate")``)."""
    tables = _schema_tables()
    return [(path, line) for path, line, names in _literal_runs(3, root) if path != "schema.py"
            and any((len(names) >= 5 and set(names) <= set(t)) or set(names) == set(t) for t in tables)]


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
    assert S.REPORTED_ROLES == tuple(r for r in TOKEN_ROLES if r != "pad")  # display order, prompt beside context
    assert S.DIAGNOSTIC_ROLES == (*S.REPORTED_ROLES, S.LOSS)
    assert S.SUBLAYER_ORDER == SUBLAYER_NAMES
    assert S.sorted_sublayers(["ffn.out", "mystery", "attn.q", "ffn.out"]) == ["attn.q", "ffn.out", "mystery"]
    rows = [(2, "attn.q", "weight", "kept"), (1, "ffn.out", "bias", "masked"), (1, "ffn.out", "weight", "relpos"),
            (1, "attn.v", "weight", "context"), (1, "ffn.out", "weight", "masked")]
    assert sorted(rows, key=lambda r: S.sublayer_key(*r)) == [
        (1, "attn.v", "weight", "context"), (1, "ffn.out", "weight", "masked"), (1, "ffn.out", "weight", "relpos"),
        (1, "ffn.out", "bias", "masked"), (2, "attn.q", "weight", "kept")]
    assert S.role_rank("loss", ("context", "loss")) == 1 and S.role_rank("pad", ("context",)) == 1
    assert sorted(["relpos", "special", "prompt", "pad", "context"], key=S.role_rank) == [
        "context", "prompt", "special", "pad", "relpos"]  # prompt (code 7) beside context (3)


def test_readers_share_the_schema_objects():
    from gradflow.analysis import run_data
    from gradflow.figures import PLOT_ROLES
    from gradflow.runs import aggregate

    assert A.CHANNEL_COLUMNS is S.CHANNEL_COLUMNS and A.SEQUENCE_COLUMNS is S.SEQUENCE_COLUMNS
    assert A.SUBLAYER_COLUMNS is S.SUBLAYER_COLUMNS and A.SUBLAYER_ORDER is S.SUBLAYER_ORDER
    assert A.DEFAULT_ROLES is S.REPORTED_ROLES and PLOT_ROLES is S.REPORTED_ROLES
    assert run_data.TABLE_DTYPES is S.TABLE_DTYPES and aggregate.REPORTED_ROLES is S.REPORTED_ROLES


def test_no_column_list_outside_the_schema():
    """A run of five or more names of one table, or a whole table, is a column list: only schema.py may spell one."""
    tables = _schema_tables()
    for table in (S.CHANNEL_COLUMNS, S.SUBLAYER_COLUMNS, S.SEQUENCE_COLUMNS, S.CHANNEL_VIEW_COLUMNS,
                  *S.DIAGNOSTIC_COLUMNS.values(), *S.ANALYSIS_COLUMNS.values(), *S.REPORT_TABLES.values(),
                  *S.COMPARISON_TABLES.values(), S.CALLBACK_COLUMNS, S.NEW_ROWS_COLUMNS, S.EVAL_COLUMNS,
                  S.MLM_LOG_COLUMNS, S.PRESSURE_COLUMNS, S.PROBE_COLUMNS, S.ATLAS_COLUMNS):
        assert table in tables
    assert _column_lists() == []


def test_a_planted_column_list_is_found(tmp_path):
    """The rule knows the training logs and the report tables: spelling one of their lists elsewhere fails."""
    (tmp_path / "writer.py").write_text(
        'CSV_COLUMNS = ("step", "group", "role", "quantity", "value")\n'
        'LOG = ["step", "loss", "learning_rate"]\n'
        'ROWS = ("step", "side", "role", "grad_norm", "n_positions")\n'
        'DEFICIT = ("sublayer", "share", "earlier_mean", "earlier_coverage_mean", "n_earlier")\n'
        'FINE = ("step", "split", "value")\n', encoding="utf-8")
    assert _column_lists(tmp_path) == [("writer.py", 1), ("writer.py", 2), ("writer.py", 3), ("writer.py", 4)]


def test_every_table_column_is_described_or_named_plainly():
    """Each training-log column has a description; the analysis notes describe only columns that exist."""
    for fields in (S.CALLBACK_FIELDS, S.NEW_ROWS_FIELDS, S.EVAL_FIELDS, S.MLM_LOG_FIELDS, S.CALLBACK_QUANTITIES):
        assert all(isinstance(text, str) and text for text in fields.values())
    analysis = {c for t in (*S.REPORT_TABLES.values(), *S.COMPARISON_TABLES.values()) for c in t}
    assert set(S.ANALYSIS_NOTES) <= analysis
    for name in ("earlier_coverage_mean", "n_earlier", "median_role", "ratio_to_earlier", "paired", "rank_biserial"):
        assert name in S.ANALYSIS_NOTES
    assert "||W0||" in S.CALLBACK_QUANTITIES["drift"]


def test_report_and_comparison_tables_build_on_the_analysis_tables():
    assert list(S.REPORT_TABLES) == ["role_profile", "role_ratios", "layer_tests", "sublayer_shares", "last_block",
                                     "channel_quantiles", "context_pressure", "mask_ratio_profile", "expert_roles",
                                     "expert_rows", "router_aux_ratio"]
    assert S.REPORT_TABLES["mask_ratio_profile"] is S.ANALYSIS_COLUMNS["mask_ratio_profile"]
    assert S.REPORT_TABLES["last_block"] is S.ANALYSIS_COLUMNS["last_block"]
    assert S.COMPARISON_TABLES["context_pressure"] == ("label", *S.PRESSURE_COLUMNS)
    for name, columns in S.COMPARISON_TABLES.items():
        assert columns[0] == "label" and len(set(columns)) == len(columns), name


def test_conform_orders_checks_and_fills_columns():
    frame = pd.DataFrame({"b": [1], "a": [2]})
    assert list(S.conform(frame, ("a", "b"), "t").columns) == ["a", "b"]
    assert list(S.conform(pd.DataFrame(), ("a", "b"), "t").columns) == ["a", "b"]
    with pytest.raises(ValueError, match=r"t: columns \['b', 'c'\]"):
        S.conform(frame, ("a", "c"), "t")


def test_writers_take_their_names_from_the_schema():
    from gradflow.inputs import masking
    from gradflow.interventions import callback, new_rows
    from gradflow.interventions.finetune import continued

    assert callback.CSV_NAME is S.CALLBACK_FILE and callback.CSV_COLUMNS is S.CALLBACK_COLUMNS
    assert new_rows.CSV_NAME is S.NEW_ROWS_FILE and new_rows.CSV_COLUMNS is S.NEW_ROWS_COLUMNS
    assert continued.LOG_NAME is S.MLM_LOG_FILE and continued.META_NAME is S.CONTINUED_META_FILE
    assert callback.mlm_roles is masking.mlm_roles  # the old import path (tests/interventions/test_vocabulary.py) still works


def test_finetune_eval_csv_follows_the_schema(tmp_path):
    from gradflow.interventions.finetune import EvalRecord, FinetuneConfig, FinetuneResult
    from gradflow.interventions.finetune.outputs import write_history

    result = FinetuneResult(FinetuneConfig(model="m", task="t"), "t", {},
                            history=[EvalRecord(10, "train", {"loss": 1.5}), EvalRecord(10, "validation",
                                                                                     {"loss": 1.2, "accuracy": 0.5})])
    assert tuple(result.frame().columns) == S.EVAL_COLUMNS
    assert tuple(FinetuneResult(result.config, "t", {}).frame().columns) == S.EVAL_COLUMNS
    write_history(result, tmp_path)
    frame = pd.read_csv(tmp_path / S.EVAL_FILE)
    assert tuple(frame.columns) == S.EVAL_COLUMNS and len(frame) == 3


def test_new_rows_follow_the_schema(tmp_path, tiny_mlm_dir):
    """The rows NewRowsCallback writes: ``step`` plus NewRowGradients.split's fields, in schema order."""
    import torch
    from transformers import AutoTokenizer, BertForMaskedLM

    from gradflow.inputs.masking import mlm_roles
    from gradflow.interventions.new_rows import NewRowGradients

    tok = AutoTokenizer.from_pretrained(tiny_mlm_dir)
    model = BertForMaskedLM.from_pretrained(tiny_mlm_dir)
    enc = tok(["the market rose and the bank fell"], return_tensors="pt")
    ids, labels = enc["input_ids"].clone(), torch.full_like(enc["input_ids"], -100)
    labels[0, 2], ids[0, 2] = ids[0, 2], tok.mask_token_id
    with NewRowGradients(model, [int(enc["input_ids"][0, 1]), int(enc["input_ids"][0, 2])]) as watch:
        model(input_ids=ids, attention_mask=enc["attention_mask"], labels=labels).loss.backward()
    rows = watch.split(mlm_roles(ids, labels, enc["attention_mask"], tok.mask_token_id, tuple(tok.all_special_ids)))
    assert rows and all(("step", *row) == S.NEW_ROWS_COLUMNS for row in rows)


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
