"""Planted checks of tests/reference_tables.py: float32-kernel noise passes, everything else fails."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from reference_tables import assert_table_matches_reference, table_differences

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "demo_reference_limit16" / "mini-en_mlm" / "channels.csv"


@pytest.fixture
def table() -> pd.DataFrame:
    return pd.read_csv(REFERENCE)


def _first(frame: pd.DataFrame, column: str, zero: bool) -> int:
    rows = frame.index[(frame[column] == 0) if zero else (frame[column] != 0)]
    assert len(rows), column
    return int(rows[0])


def test_the_reference_matches_itself_as_file_and_as_frame(table):
    assert_table_matches_reference(REFERENCE, REFERENCE)
    assert_table_matches_reference(table, REFERENCE)


def test_float32_kernel_noise_passes(table):
    """(a) a relative 1e-7 perturbation of every nonzero float (the issue's 0.01756506698 vs ...629 is 4e-8)."""
    for column in ("grad_norm_mean", "grad_norm_std", "act_norm_mean"):
        table[column] = table[column] * (1 + 1e-7)
    assert pd.read_csv(REFERENCE).loc[0, "grad_norm_mean"] == 0.01756506629
    table.loc[0, "grad_norm_mean"] = 0.01756506698  # the value the Xeon of issue 25 wrote
    assert_table_matches_reference(table, REFERENCE)


def test_a_real_change_of_a_float_fails(table):
    """(b) a relative 1e-3 perturbation of one float."""
    row = _first(table, "grad_norm_mean", zero=False)
    table.loc[row, "grad_norm_mean"] *= 1 + 1e-3
    with pytest.raises(AssertionError, match=r"'grad_norm_mean'.*relative difference 0.001"):
        assert_table_matches_reference(table, REFERENCE)


def test_an_exact_zero_turned_tiny_fails_and_a_nonzero_turned_zero_fails(table):
    """(c) a structural zero that became 1e-30 (within any rtol/atol) is a failure; so is the reverse."""
    row = _first(table, "grad_norm_mean", zero=True)
    planted = table.copy()
    planted["grad_norm_mean"] = planted["grad_norm_mean"].astype(float)
    planted.loc[row, "grad_norm_mean"] = 1e-30
    with pytest.raises(AssertionError, match="zero must stay exactly zero"):
        assert_table_matches_reference(planted, REFERENCE)
    tiny = _first(table, "grad_norm_q05", zero=False)
    planted = table.copy()
    planted.loc[tiny, "grad_norm_q05"] = 0.0
    assert any("zero must stay exactly zero" in p for p in table_differences(planted, REFERENCE, atol=1.0))
    planted = table.copy()  # an integer-looking float column (all 0 or 1 in the reference)
    planted["grad_norm_zero_fraction"] = planted["grad_norm_zero_fraction"].astype(float)
    planted.loc[_first(table, "grad_norm_zero_fraction", zero=True), "grad_norm_zero_fraction"] = 1e-30
    with pytest.raises(AssertionError, match="zero must stay exactly zero"):
        assert_table_matches_reference(planted, REFERENCE)


def test_a_changed_count_or_name_fails(table):
    """(d) counts and strings are exact: one position more, or another role name."""
    planted = table.copy()
    planted.loc[3, "n_positions"] += 1
    with pytest.raises(AssertionError, match=r"'n_positions' \(integer\)"):
        assert_table_matches_reference(planted, REFERENCE)
    planted = table.copy()  # a count written as a float close to it is still refused where declared exact
    planted["n_positions"] = planted["n_positions"] * (1 + 1e-7)
    with pytest.raises(AssertionError, match="'n_positions'"):
        assert_table_matches_reference(planted, REFERENCE, exact_columns=["n_positions"])
    planted = table.copy()
    planted.loc[0, "role"] = "context" if planted.loc[0, "role"] != "context" else "masked"
    with pytest.raises(AssertionError, match="'role'"):
        assert_table_matches_reference(planted, REFERENCE)


def test_reordered_columns_rows_or_missing_rows_fail(table):
    """(e) column order is part of the table, and so are row order and row count."""
    columns = list(table.columns)
    columns[5], columns[6] = columns[6], columns[5]
    with pytest.raises(AssertionError, match="columns differ"):
        assert_table_matches_reference(table[columns], REFERENCE)
    swapped = table.iloc[[1, 0, *range(2, len(table))]]
    with pytest.raises(AssertionError, match="'role'"):
        assert_table_matches_reference(swapped, REFERENCE)
    with pytest.raises(AssertionError, match="shape differs"):
        assert_table_matches_reference(table.iloc[:-1], REFERENCE)


def test_nan_positions_must_match(table):
    planted = table.copy()
    planted.loc[0, "act_norm_std"] = float("nan")
    with pytest.raises(AssertionError, match="'act_norm_std'"):
        assert_table_matches_reference(planted, REFERENCE)


# ------------------------------------------------ the demo's per-column tolerances keep their bite
DEMO = Path(__file__).resolve().parents[1] / "data" / "demo_reference_limit16" / "mini-en-alltoken_all-positions"


def _demo_fails(name: str, planted: pd.DataFrame, message: str) -> None:
    from test_behaviour_preserved import TOLERANCES

    assert table_differences(pd.read_csv(DEMO / name), DEMO / name, **TOLERANCES[name]) == []
    with pytest.raises(AssertionError, match=message):
        assert_table_matches_reference(planted, DEMO / name, **TOLERANCES[name])


def test_demo_tolerances_refuse_what_kernels_do_not_do():
    channels = pd.read_csv(DEMO / "channels.csv")
    planted = channels.copy()
    planted.loc[0, "grad_norm_mean"] *= 1 + 3e-3  # 10x the largest kernel difference measured
    _demo_fails("channels.csv", planted, "'grad_norm_mean'")
    planted = channels.copy()
    planted.loc[0, "grad_norm_q05"] *= 10 ** 0.04  # two histogram bins
    _demo_fails("channels.csv", planted, "'grad_norm_q05'")
    planted = channels.copy()
    row = _first(channels, "act_norm_std", zero=False)
    planted.loc[row, "act_norm_std"] += 1e-3 * channels.loc[row, "act_norm_mean"]
    _demo_fails("channels.csv", planted, "'act_norm_std'")
    planted = channels.copy()  # a zero fraction is a ratio of counts: exact
    planted["grad_norm_zero_fraction"] = planted["grad_norm_zero_fraction"].astype(float)
    planted.loc[_first(channels, "grad_norm_zero_fraction", zero=False), "grad_norm_zero_fraction"] = 1 - 1e-9
    _demo_fails("channels.csv", planted, "'grad_norm_zero_fraction' \\(exact\\)")
    sublayers = pd.read_csv(DEMO / "sublayers.csv")
    planted = sublayers.copy()  # the last block's structural zero
    planted["share"] = planted["share"].astype(float)
    planted.loc[_first(sublayers, "share", zero=True), "share"] = 1e-30
    _demo_fails("sublayers.csv", planted, "zero must stay exactly zero")
    planted = sublayers.copy()
    row = _first(sublayers, "contribution_norm_std", zero=False)
    planted.loc[row, "contribution_norm_std"] += 3e-3 * sublayers.loc[row, "contribution_norm_mean"]
    _demo_fails("sublayers.csv", planted, "'contribution_norm_std'")
