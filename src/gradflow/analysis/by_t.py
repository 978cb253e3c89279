"""A masked-diffusion run's sequences selected by their masking ratio t, and what a run pools over t.

A masked-diffusion run (``mask_ratios.parquet``: each sequence's t) pools, in every whole-run table, sequences
whose gradients differ several-fold with t (a loss position's gradient scales like 1/t). Put beside a BERT run
(its selection rate fixed, 15%) such a pooled run compares unlike things. :func:`select_by_t` keeps the
sequences of one grid value or one bin of t, so that ``gradflow compare --mask-ratio 0.15`` sets a BERT run
beside a diffusion run at a matched t; :func:`t_scope` says, in a few words for a figure's legend, what a run's
numbers pool over t.

The per-sequence tables are selected (``sequences.parquet``, ``mask_ratios.parquet``): the ratios, the profiles
and their CIs. The sublayer shares (the last block's deficit) are rebuilt from the selected sequences'
``sublayer_sequences.parquet`` when the run has it (the same magnitude sums as ``sublayers.csv``; the coverage,
which has no per-sequence count, is NaN); without it they pool every t, and so do the zero fractions of
``channels.csv`` (:data:`POOLED_TABLES`, :func:`sublayers_selected`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from gradflow.analysis.run_data import Run, read_sublayer_sequences
from gradflow.errors import RunError
from gradflow.formatting import format_number
from gradflow.schema import SUBLAYER_SEQUENCES_FILE

GRID_TOLERANCE = 1e-9
"""A sequence's t matches a grid value within this (the grid's values are stored as float64)."""
POOLED_TABLES = "channels.csv has no per-sequence rows, so the zero fractions"
"""The start of the sentence that says which numbers a selection by t cannot reach (with sublayer_sequences.parquet)."""
POOLED_TABLES_WITHOUT_SEQUENCES = ("channels.csv and sublayers.csv have no per-sequence rows (and the run has no "
                                   f"{SUBLAYER_SEQUENCES_FILE}), so the zero fractions and the sublayer shares")
"""The same without ``sublayer_sequences.parquet``: the last block's shares pool every t too."""


@dataclass(frozen=True)
class TSelection:
    """One grid value of t (``low == high``) or one bin ``[low, high)`` of t (closed at 1)."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if not (0.0 < self.low <= 1.0 and 0.0 < self.high <= 1.0) or self.high < self.low:
            raise ValueError(f"a masking ratio t is in (0, 1] and a bin's low end is below its high end, got "
                             f"{self.describe()}")

    @property
    def is_value(self) -> bool:
        """Whether this is one grid value rather than a bin."""
        return self.low == self.high

    def contains(self, ratios: np.ndarray) -> np.ndarray:
        """Boolean mask (the shape of ``ratios``) of the masking ratios this selection keeps."""
        ratios = np.asarray(ratios, dtype=np.float64)
        if self.is_value:
            return np.abs(ratios - self.low) <= GRID_TOLERANCE
        return (ratios >= self.low) & ((ratios < self.high) | ((self.high == 1.0) & (ratios == 1.0)))

    def describe(self) -> str:
        """``t = 0.15`` or ``t in [0.1, 0.2)`` (``]`` when the bin ends at 1)."""
        if self.low == self.high:
            return f"t = {format_number(self.low, None)}"
        return f"t in [{format_number(self.low, None)}, {format_number(self.high, None)}{']' if self.high == 1 else ')'}"


def parse_t_selection(text: str) -> TSelection:
    """``"0.15"`` (a grid value) or ``"0.1,0.2"`` (the bin [0.1, 0.2)) as a :class:`TSelection`; ``ValueError``
    names the bad part and what is expected."""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) not in (1, 2) or not all(parts):
        raise ValueError(f"expected one masking ratio t (a grid value, e.g. 0.15) or a bin LOW,HIGH (e.g. 0.1,0.2), "
                         f"got {text!r}")
    values = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"{part!r} in {text!r} is not a number; give t as 0.15 or a bin as 0.1,0.2") from None
        if not math.isfinite(value) or not 0.0 < value <= 1.0:
            raise ValueError(f"{part!r} in {text!r} is not a masking ratio: t is in (0, 1]")
        values.append(value)
    low, high = values[0], values[-1]
    if len(values) == 2 and high <= low:
        raise ValueError(f"the bin {text!r} is empty: its low end must be below its high end (e.g. 0.1,0.2)")
    return TSelection(low, high)


def select_by_t(run: Run, selection: TSelection) -> Run:
    """``run`` with only the sequences whose t is in ``selection`` (``sequences`` and ``mask_ratios``).

    Raises :class:`RunError` for a run without ``mask_ratios.parquet`` (not a masked-diffusion run) and for a
    selection that keeps no sequence, naming the run's values of t (or their range when they were drawn)."""
    if run.mask_ratios is None:
        raise RunError(f"{run.label}: no mask_ratios.parquet, so its sequences have no masking ratio t to select "
                       "(only a run recorded with --objective diffusion has one).")
    ratios = run.mask_ratios
    keep = selection.contains(ratios["mask_ratio"].to_numpy())
    if not keep.any():
        raise RunError(f"{run.label}: no sequence has {selection.describe()}; its sequences have "
                       f"{_t_values(ratios['mask_ratio'].to_numpy())}. Choose one of those values, or a bin LOW,HIGH "
                       "that holds some (t drawn per sequence takes a bin, e.g. --mask-ratio 0.1,0.2).")
    members = ratios["sequence_index"].to_numpy()[keep]
    sequences = run.sequences[run.sequences["sequence_index"].isin(members)].reset_index(drop=True)
    sublayers = _selected_sublayers(run, members)
    return replace(run, sequences=sequences, mask_ratios=ratios[keep].reset_index(drop=True),
                   sublayers=run.sublayers if sublayers is None else sublayers)


def sublayers_selected(run: Run) -> bool:
    """Whether :func:`select_by_t` rebuilds ``run``'s sublayer shares from the selected sequences (the run has
    ``sublayer_sequences.parquet``)."""
    return (run.path / SUBLAYER_SEQUENCES_FILE).is_file()


def _selected_sublayers(run: Run, members: np.ndarray) -> pd.DataFrame | None:
    """``sublayers.csv``'s rows rebuilt from the ``members``' rows of ``sublayer_sequences.parquet`` (every param):
    ``magnitude_sum`` and ``n_positions`` summed, ``share`` = the role's magnitude over the (layer, sublayer, param)
    total; ``n_nonzero`` and the per-batch statistics, not kept per sequence, are NaN. None without the file."""
    if not sublayers_selected(run):
        return None
    part = read_sublayer_sequences(run, param=None)
    part = part[part["sequence_index"].isin(members)]
    keys = ["layer", "sublayer", "param", "role"]
    out = part.groupby(keys, as_index=False, observed=True)[["n_positions", "magnitude_sum"]].sum()
    total = out.groupby(keys[:3], observed=True)["magnitude_sum"].transform("sum").to_numpy(np.float64)
    magnitude = out["magnitude_sum"].to_numpy(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out["share"] = np.where(total > 0, magnitude / total, 0.0)
    return out.reindex(columns=list(run.sublayers.columns))


def t_scope(run: Run, selection: TSelection | None = None) -> str | None:
    """A few words for a legend: what ``run``'s numbers pool over t (None for a run without t).

    ``t = 0.15`` or ``t in [0.1, 0.2)`` for a selected run; ``t = 0.3`` for a run of one t;
    ``pooled over t 0.1-0.9`` for a run of several (its smallest and largest t, 3 significant digits)."""
    if run.mask_ratios is None:
        return None
    if selection is not None:
        return selection.describe()
    values = np.unique(run.mask_ratios["mask_ratio"].to_numpy(np.float64))
    if values.size == 1:
        return f"t = {format_number(float(values[0]), None)}"
    return f"pooled over t {format_number(float(values[0]))}\u2013{format_number(float(values[-1]))}"


def _t_values(ratios: np.ndarray) -> str:
    """``t in {0.1, 0.5}`` for a few values, ``t from 0.003 to 0.998 (drawn)`` for many."""
    values = np.unique(np.asarray(ratios, dtype=np.float64))
    if values.size <= 12:
        return "t in {" + ", ".join(format_number(float(v), None) for v in values) + "}"
    return (f"t from {format_number(float(values[0]))} to {format_number(float(values[-1]))} "
            f"({values.size} values, drawn per sequence)")


__all__ = ["GRID_TOLERANCE", "POOLED_TABLES", "POOLED_TABLES_WITHOUT_SEQUENCES", "TSelection", "parse_t_selection",
           "select_by_t", "sublayers_selected", "t_scope"]
