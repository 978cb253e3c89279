"""Comparing a freshly computed table with a reference table committed in the repository.

The rule (issue 25). A committed reference was written on the developers' machine; float32 kernels
on another CPU (another SIMD width, hence another blocking and summation order in the matrix
products) change the last bits of a norm, so a table's float may differ in its 8th significant digit
(0.01756506698 vs 0.01756506629 on a Xeon with AVX-512). A comparison with a *committed* file
therefore allows, in float columns only, a relative difference of ``rtol`` (1e-5 by default) plus a
tiny absolute ``atol`` (1e-12), and stays exact wherever exactness is the claim:

* column names and column order, the number of rows, and row order (a row is compared with the
  reference row at the same position, so key columns must agree row by row);
* non-float columns: strings and categories (site, role, sublayer, ...) compared as the text in the
  file, integer columns (layer, counts) compared as integers, both exactly;
* zeros: where the reference holds 0.0 the table must hold exactly 0.0, and where the reference
  holds a nonzero the table must not hold 0.0 (a structural zero is no "small number");
* NaN and infinities at exactly the same cells.

A column is a float column when either side has a value that is not an integer literal; a column
whose values are integers on both sides is compared exactly. ``exact_columns`` names columns that
are compared exactly as text whatever they hold (counts, and ratios of counts, that must never be
accepted "close").

``rtol`` holds for a quantity a float32 kernel computes directly. Some quantities amplify kernel
noise, and a caller states that per column, with its reason, where it calls the helper:
``column_rtol`` gives a column its own relative tolerance (a value read off a histogram moves by a
whole bin when a norm crosses a bin edge; a gradient that is a small difference of large terms
keeps fewer digits), and ``scale_columns`` measures a column's difference against another column of
the same row (a standard deviation much smaller than its mean is as precise as the values it
spreads over: ``|actual - reference| <= rtol * |reference mean|``). Neither loosens the exact parts.

Before/after comparisons made within one run on one machine (two runs of the same code, shards vs
an unsharded run, a resume vs a straight run) stay byte-identical and do not use this helper.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import pandas as pd

RTOL = 1e-5
ATOL = 1e-12
_INTEGER = re.compile(r"^[+-]?\d+$")
_SHOWN = 20  # mismatching cells listed in a failure message


def _raw(table: Path | str | pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The table as text cells (exactly as in the file), and a name for messages.

    A DataFrame is written to CSV first (its index dropped; floats keep full precision), so a frame
    and a file are compared by the same rules.
    """
    if isinstance(table, pd.DataFrame):
        source, name = io.StringIO(table.to_csv(index=False)), "<DataFrame>"
    else:
        source, name = Path(table), str(table)
    return pd.read_csv(source, dtype=str, keep_default_na=False), name


def _numbers(cells: pd.Series) -> np.ndarray | None:
    """Float values of a text column ("" is NaN), or None when some cell is not a number."""
    try:
        return pd.to_numeric(cells.replace("", "nan"), errors="raise").to_numpy(dtype=float)
    except (ValueError, TypeError):
        return None


def _row_label(frame: pd.DataFrame, row: int, keys: list[str]) -> str:
    shown = ", ".join(f"{k}={frame.at[row, k]}" for k in keys[:6])
    return f"row {row}" + (f" ({shown})" if shown else "")


def table_differences(actual: Path | str | pd.DataFrame, reference: Path | str | pd.DataFrame, *,
                      rtol: float = RTOL, atol: float = ATOL, exact_columns: Iterable[str] = (),
                      column_rtol: Mapping[str, float] | None = None,
                      scale_columns: Mapping[str, str] | None = None) -> list[str]:
    """Every way ``actual`` departs from ``reference`` under the rule of this module (empty: it matches)."""
    got, got_name = _raw(actual)
    want, want_name = _raw(reference)
    if list(got.columns) != list(want.columns):
        return [(f"columns differ (names and order must be identical):\n  actual:    {list(got.columns)}\n"
                 f"  reference: {list(want.columns)}")]
    if got.shape != want.shape:
        return [f"shape differs: actual {got.shape}, reference {want.shape} ({got_name} vs {want_name})"]
    exact, column_rtol, scale_columns = set(exact_columns), dict(column_rtol or {}), dict(scale_columns or {})
    named = exact | set(column_rtol) | set(scale_columns) | set(scale_columns.values())
    unknown = named - set(want.columns)
    if unknown:
        raise ValueError(f"columns named in the tolerances are not in the table: {sorted(unknown)}")
    float_columns: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    exact_kind: dict[str, str] = {}
    for column in want.columns:
        a_text, r_text = got[column], want[column]
        a_num = None if column in exact else _numbers(a_text)
        r_num = None if column in exact else _numbers(r_text)
        if a_num is None or r_num is None:  # text (or declared exact): identical cells
            exact_kind[column] = "exact"
        elif all((t.str.match(_INTEGER) | (t == "")).all() for t in (a_text, r_text)):
            exact_kind[column] = "integer"  # counts, layers: exactly equal
        else:
            float_columns[column] = (a_num, r_num)
    keys = [c for c in want.columns if c not in float_columns]
    problems: list[str] = []
    for column, kind in exact_kind.items():
        for row in np.flatnonzero((got[column] != want[column]).to_numpy()):
            problems.append(f"{column!r} ({kind}): actual {got[column].iat[row]!r} != reference "
                            f"{want[column].iat[row]!r} [{_row_label(want, row, keys)}]")
    for column, (a, r) in float_columns.items():
        tol = column_rtol.get(column, rtol)
        if column in scale_columns:  # the difference measured against another column's reference value
            scale = _numbers(want[scale_columns[column]])
            if scale is None:
                raise ValueError(f"scale column {scale_columns[column]!r} of {column!r} is not numeric")
            scale = np.fmax(np.abs(r), np.abs(scale))
        else:
            scale = np.abs(r)
        a_nan, r_nan = np.isnan(a), np.isnan(r)
        finite = np.isfinite(a) & np.isfinite(r)
        zero = (a == 0) | (r == 0)
        with np.errstate(invalid="ignore"):
            close = np.abs(a - r) <= atol + tol * scale
        ok = np.where(a_nan | r_nan, a_nan & r_nan,                      # NaN exactly where the reference has it
                      np.where(~finite, a == r,                           # infinities equal, sign included
                               np.where(zero, a == r, close)))            # zeros exact, the rest within rtol
        for row in np.flatnonzero(~ok):
            if not (np.isfinite(a[row]) and np.isfinite(r[row])):
                kind = "NaN/inf must match exactly"
            elif r[row] == 0 or a[row] == 0:
                kind = "zero must stay exactly zero"
            elif column in scale_columns:
                kind = (f"difference {abs(a[row] - r[row]):.3g} > rtol {tol:g} x {scale[row]:.10g}, "
                        f"the larger of the reference and its {scale_columns[column]}")
            else:
                kind = f"relative difference {abs(a[row] - r[row]) / abs(r[row]):.3g} > rtol {tol:g}"
            problems.append(f"{column!r}: actual {got[column].iat[row]} vs reference {want[column].iat[row]}"
                            f" ({kind}) [{_row_label(want, row, keys)}]")
    return problems


def assert_table_matches_reference(actual: Path | str | pd.DataFrame, reference: Path | str | pd.DataFrame, *,
                                   rtol: float = RTOL, atol: float = ATOL, exact_columns: Iterable[str] = (),
                                   column_rtol: Mapping[str, float] | None = None,
                                   scale_columns: Mapping[str, str] | None = None, what: str = "") -> None:
    """Assert that ``actual`` equals the committed ``reference`` within float32 kernel tolerance.

    Floats within ``rtol`` (relative to the reference; per column ``column_rtol``, against another
    column ``scale_columns``) plus ``atol``; exact zeros, NaN/inf cells,
    integers, strings, column names and order, shape and row order exactly (see the module docstring).
    ``actual`` and ``reference`` are CSV paths or DataFrames; ``what`` prefixes the failure message.
    """
    problems = table_differences(actual, reference, rtol=rtol, atol=atol, exact_columns=exact_columns,
                                 column_rtol=column_rtol, scale_columns=scale_columns)
    if problems:
        head = f"{what}: " if what else ""
        listed = "\n  ".join(problems[:_SHOWN])
        more = f"\n  ... and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        raise AssertionError(f"{head}{len(problems)} difference(s) from the reference:\n  {listed}{more}")
