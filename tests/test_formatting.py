"""One rule for numbers as text (gradflow.formatting): summaries, tables, figures and option ranges."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from gradflow.formatting import MISSING, format_estimate, format_number, format_p_value


@pytest.mark.parametrize(("value", "text"), [
    (0.50123, "0.501"), (0.5, "0.5"), (1, "1"), (2.0, "2"), (12.345, "12.3"), (123.456, "123"),
    (0.012345, "0.0123"), (0.001, "0.001"), (0.0012345, "0.00123"),
    (0.99951, "1"), (9.9951, "10"), (0.1235, "0.123"),  # rounded to three significant digits, zeros dropped
])
def test_three_significant_digits(value, text):
    assert format_number(value) == text


@pytest.mark.parametrize(("value", "text"), [
    (0.000123456, "1.23e-04"), (0.0009994, "9.99e-04"), (1e-12, "1.00e-12"),  # below 1e-3: scientific
    (123456, "1.23e+05"), (1e5, "1.00e+05"), (-2.5e6, "-2.50e+06"),             # from 1e5: scientific
    (1234.5, "1.23e+03"), (99999.4, "1e+05"),  # more integer digits than significant ones: g's exponent form
])
def test_small_and_large_numbers(value, text):
    assert format_number(value) == text


@pytest.mark.parametrize(("value", "text"), [
    (-0.50123, "-0.501"), (-2, "-2"), (-0.000123456, "-1.23e-04"), (-123456, "-1.23e+05"), (-0.0, "0"),
    (0, "0"), (math.inf, "inf"), (-math.inf, "-inf"),
])
def test_negative_zero_and_infinite(value, text):
    assert format_number(value) == text


@pytest.mark.parametrize("value", [math.nan, np.nan, None, np.float32("nan"), pd.Series([1.0, None])[1]])
def test_missing_is_a_dash(value):
    assert format_number(value) == MISSING == "–"
    assert format_p_value(value) == MISSING


def test_numpy_scalars_and_labels():
    assert format_number(np.float64(0.25)) == "0.25" and format_number(np.int64(7)) == "7"
    assert format_number(np.float32(0.3)) == "0.3"
    assert format_number("attn.q") == "attn.q"  # not a number: written as it is


def test_digits():
    assert format_number(0.123456, 2) == "0.12" and format_number(0.123456, 5) == "0.12346"
    assert format_number(0.000123456, 2) == "1.2e-04" and format_number(123456, 5) == "1.2346e+05"


def test_exact_form_for_option_ranges():
    assert [format_number(x, None) for x in (0, 1, 1.0, 0.15, 65535, 1e-06, -0.5)] == [
        "0", "1", "1", "0.15", "65535", "1e-06", "-0.5"]
    assert format_number(math.nan, None) == MISSING


@pytest.mark.parametrize(("args", "text"), [
    ((0.50123, 0.43, 0.57), "0.501 [0.43, 0.57]"),
    ((1.0, 0.9995, 1.0004), "1 [1, 1]"),
    ((-0.25, -0.5, 0.0), "-0.25 [-0.5, 0]"),
    ((0.5, math.nan, math.nan), "0.5 [–, –]"),    # one sequence: no interval
    ((0.5, None, None), "0.5 [–, –]"),
    ((0.000123, 0.0001, 0.00015), "1.23e-04 [1.00e-04, 1.50e-04]"),
    ((2.5e5, 1e5, 4e5), "2.50e+05 [1.00e+05, 4.00e+05]"),
])
def test_estimate_with_its_interval(args, text):
    assert format_estimate(*args) == text


def test_estimate_digits():
    assert format_estimate(0.50123, 0.4321, 0.5789, digits=2) == "0.5 [0.43, 0.58]"


@pytest.mark.parametrize(("p", "text"), [(0.5, "0.500"), (0.04213, "0.042"), (0.001, "0.001"),
                                         (0.000032, "3.2e-05"), (0.0, "0.0e+00"), (1.0, "1.000")])
def test_p_values(p, text):
    assert format_p_value(p) == text


def test_the_report_and_the_pressure_section_use_the_one_rule():
    """summary.md's tables (figures.report, figures.pressure) and the option ranges of the CLI format
    through gradflow.formatting; no module keeps a formatter of its own."""
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "gradflow"
    for rel in ("figures/report.py", "figures/pressure.py", "cli/options.py"):
        text = (src / rel).read_text(encoding="utf-8")
        assert "from gradflow.formatting import" in text, rel
        assert "def _num(" not in text and "def _ci(" not in text and "def _pval(" not in text, rel


@pytest.mark.parametrize("masking, label", [
    ({"policy": "bert", "rate": 0.15, "split": [0.8, 0.1, 0.1], "whole_word": False}, "BERT 15% (80/10/10)"),
    ({"policy": "bert", "rate": 0.4, "split": [0.8, 0.1, 0.1], "whole_word": True, "shift": True},
     "BERT 40% (80/10/10), whole words, shifted"),
    ({"policy": "span", "rate": 0.15, "split": [0.8, 0.1, 0.1], "shift": False}, "span 15% (80/10/10)"),
    ({"policy": "diffusion", "eps": 0.001, "ratio": None, "ratios": []}, "diffusion t ~ U(0.001, 1), 1/t"),
    ({"policy": "diffusion", "eps": 0.001, "ratio": None, "ratios": [0.1, 0.5]}, "diffusion t in {0.1, 0.5}, 1/t"),
    ({"policy": "diffusion", "eps": 0.001, "ratio": 0.3, "ratios": [], "shift": True}, "diffusion t = 0.3, 1/t, shifted"),
    ({"policy": "explicit", "positions": [3]}, "explicit positions"),
    ({"policy": "other"}, "{'policy': 'other'}"), (None, "None"),
], ids=["bert", "bert 40 whole shifted", "span", "diffusion drawn", "diffusion grid", "diffusion fixed shifted",
        "explicit", "unknown policy", "missing"])
def test_masking_label_names_each_objective(masking, label):
    from gradflow.formatting import masking_label

    assert masking_label(masking) == label
