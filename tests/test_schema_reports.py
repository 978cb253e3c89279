"""Every column and key a command writes has a meaning, a dtype and a unit in gradflow.schema_reports.

The commands run on tiny models (record under both losses, report, compare, check --json, the Trainer callback);
a column or key the schema modules do not declare fails here, naming it.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from gradflow import schema as S
from gradflow import schema_reports as R
from gradflow.cli import main
from gradflow.figures.report_moe import MOE_TABLES
from gradflow.roles import ALL_ROLES

DTYPE_KINDS = {"str": "O", "int64": "i", "float64": "fi", "bool": "b"}


def _undescribed(table: str, columns) -> list[str]:
    missing = []
    for column in columns:
        try:
            R.describe(table, column)
        except KeyError:
            missing.append(f"{table}.{column}")
    return missing


def test_every_declared_table_column_is_described():
    missing = [m for key, (_, _, columns) in R.TABLE_FILES.items() for m in _undescribed(R.table_name(key), columns)]
    assert missing == []
    for column in R.COLUMNS.values():
        assert column.dtype in DTYPE_KINDS and column.unit and column.meaning and "\n" not in column.meaning


def test_record_table_dtypes_agree_with_the_schema():
    for name, dtypes in S.TABLE_DTYPES.items():
        assert {c: R.describe(name, c).dtype for c in dtypes} == dtypes
    assert {c: R.describe(S.SUBLAYER_SEQUENCES_FILE, c).dtype for c in S.SUBLAYER_SEQUENCE_COLUMNS} \
        == S.SUBLAYER_SEQUENCE_DTYPES


def test_every_table_of_the_schema_is_in_the_reference():
    keys = {R.table_name(k) for k in R.TABLE_FILES}
    assert set(S.REPORT_TABLES) | set(S.COMPARISON_TABLES) | set(S.DIAGNOSTIC_COLUMNS) | set(S.TABLE_DTYPES) <= keys
    assert S.SUBLAYER_SEQUENCES_FILE in keys and set(R.TABLE_KEYS) == set(R.TABLE_FILES)
    for key, (_file, _cmd, columns) in R.TABLE_FILES.items():
        assert set(_keys(key)) <= set(columns), key


def _keys(key: str) -> list[str]:
    return R.TABLE_KEYS[key].split(", ")


def _one_row_per_key(key: str, frame: pd.DataFrame) -> None:
    """No two rows of ``frame`` share the values of the table's key columns."""
    assert len(frame) and not frame.duplicated(_keys(key)).any(), (key, frame[frame.duplicated(_keys(key))].head())


def test_describe_names_what_to_add():
    with pytest.raises(KeyError, match="role_ratios: column 'mystery'.*schema_reports"):
        R.describe("role_ratios", "mystery")
    assert R.describe("context_pressure", "earlier_mean") != R.describe("last_block", "earlier_mean")


def test_the_key_walker_finds_an_undeclared_key():
    declared = {"a": "", "a.<role>": "", "b": "", "b[].c": ""}
    value = {"a": {"context": 1, "masked": 2}, "b": [{"c": 1, "d": 2}], "e": 3}
    assert R.undeclared_keys(value, declared, ALL_ROLES) == ["b[].d", "e"]


@pytest.fixture(scope="module")
def commands(tiny_mlm_dir, tiny_corpus, tmp_path_factory):
    """Record the tiny model under both losses, report an all-positions run and compare two (their pressure too)."""
    root = tmp_path_factory.mktemp("commands")
    common = ["--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--max-length", "24", "--batch-size", "4",
              "--limit", "8", "--quiet"]
    assert main(["record", *common, "--out", str(root / "mlm")]) == 0
    assert main(["record", *common, "--loss", "all-positions", "--out", str(root / "all")]) == 0
    assert main(["record", *common, "--loss", "all-positions", "--seed", "1", "--out", str(root / "all2")]) == 0
    assert main(["report", str(root / "all"), "--out", str(root / "report"), "--format", "png"]) == 0
    assert main(["compare", str(root / "all"), str(root / "all2"), "--out", str(root / "compare"),
                 "--format", "png"]) == 0
    return root


@pytest.mark.slow
@pytest.mark.parametrize("command", ["report", "compare"])
def test_report_and_compare_tables_are_declared_and_described(commands, command):
    written = {p.stem: pd.read_csv(p) for p in sorted((commands / command / "tables").glob("*.csv"))}
    declared = S.REPORT_TABLES if command == "report" else S.COMPARISON_TABLES
    assert set(written) == set(declared) - {"mask_ratio_profile", *MOE_TABLES}  # context_pressure included: the
    # run's loss is all-positions; mask_ratio_profile (diffusion runs only) in tests/figures/test_mask_ratio_figure.py,
    # the tables of mixtures of experts in tests/figures/test_report_moe.py
    for name, frame in written.items():
        assert tuple(frame.columns) == declared[name]
        assert _undescribed(name, frame.columns) == []
        _one_row_per_key(f"{command}:{name}", frame)
        for column in frame.columns:
            values = frame[column].dropna()
            if len(values):
                assert values.dtype.kind in DTYPE_KINDS[R.describe(name, column).dtype], (name, column)


def test_record_tables_have_one_row_per_key(commands):
    import pyarrow.parquet as pq

    for name in (S.CHANNELS_FILE, S.SUBLAYERS_FILE):
        _one_row_per_key(name, pd.read_csv(commands / "mlm" / name))
    for name in (S.SEQUENCES_FILE, S.SUBLAYER_SEQUENCES_FILE):
        _one_row_per_key(name, pq.read_table(commands / "mlm" / name).to_pandas())


def test_record_meta_keys_are_declared(commands):
    for run in ("mlm", "all"):
        meta = json.loads((commands / run / S.META_FILE).read_text())
        assert R.undeclared_keys(meta, R.RECORD_META_KEYS, ALL_ROLES) == []
        assert set(S.REQUIRED_META_KEYS) | set(S.PROVENANCE_KEYS) <= set(R.RECORD_META_KEYS)


def test_check_json_keys_are_declared(tiny_mlm_dir, tiny_corpus, capsys):
    assert main(["check", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--batch-size", "4",
                 "--max-length", "32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert R.undeclared_keys(data, R.CHECK_JSON_KEYS, ALL_ROLES) == []
    # and every declared top-level key is written
    assert {k for k in R.CHECK_JSON_KEYS if "." not in k and "[" not in k} == set(data)


def test_the_callback_log_is_declared(tiny_mlm_dir, tmp_path):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    import torch
    from transformers import AutoTokenizer, BertForMaskedLM, DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from conftest import SAMPLE_LINES
    from gradflow.interventions.callback import GradFlowCallback

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_mlm_dir)
    model = BertForMaskedLM.from_pretrained(tiny_mlm_dir)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, logging_strategy="no", seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=[tokenizer(line) for line in SAMPLE_LINES * 2],
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3),
                      processing_class=tokenizer)
    GradFlowCallback.attach(trainer, every=1)
    trainer.train()
    log = pd.read_csv(tmp_path / S.CALLBACK_FILE)
    assert tuple(log.columns) == tuple(S.CALLBACK_FIELDS)
    assert set(log.quantity) == set(S.CALLBACK_QUANTITIES) == set(R.CALLBACK_UNITS)
    assert set(log.role) <= {*ALL_ROLES, "all"}


def test_diagnostics_tables_are_declared_and_described(tiny_mlm_dir, tiny_corpus, tmp_path):
    out = tmp_path / "diag"
    assert main(["diagnose", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--max-length", "24",
                 "--batch-size", "4", "--limit", "8", "--out", str(out), "--format", "png"]) == 0
    written = {p.stem: pd.read_csv(p) for p in sorted(out.glob("*.csv"))}
    assert set(written) == set(S.DIAGNOSTIC_COLUMNS)
    for name, frame in written.items():
        assert tuple(frame.columns) == S.DIAGNOSTIC_COLUMNS[name] and _undescribed(name, frame.columns) == []
        _one_row_per_key(name, frame)
    meta = json.loads((out / S.META_FILE).read_text())
    assert set(S.PROVENANCE_KEYS) <= set(meta)
