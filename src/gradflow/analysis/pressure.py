"""Counterfactual context pressure: the weight-gradient signal a sublayer gets per context position.

Recorded under the all-positions loss (``gradflow record --loss all-positions``), every
non-special position carries the loss, so what a context position contributes to a sublayer's
weight gradient measures how much that sublayer *would* learn from context channels if it were
trained on them: the pressure on it. A last block that never learned from context (under the MLM
loss its sublayers after attention mixing get exactly zero context gradient) should be under
large pressure; a model trained on every position, near its optimum there, under small pressure.

Definitions, per (layer, sublayer) of one parameter (``weight`` by default), from
``sublayer_sequences.parquet`` (layers as in ``sublayers.csv``: block i is layer i + 1, the last
block is layer L). A position's contribution is the Frobenius norm ``||g_t|| * ||x_t||`` of its
term ``g_t x_t^T`` of the weight gradient (the loss gradient w.r.t. the sublayer's output times
its input; for a LayerNorm gain ``||g_t * xhat_t||``):

- ``context_per_position``: summed contributions of the context positions / their number;
- ``loss_per_position``: the same, pooled over the loss positions (masked + random + kept);
- ``pressure`` = ``context_per_position / loss_per_position`` (dimensionless; 1: a context
  position sends as much signal as a loss position; 0: none);
- ``earlier_mean`` (last block only): the **mean** of the same sublayer's pressure over layers
  1 .. L-1; ``vs_earlier`` = last-block ``pressure / earlier_mean``.

CIs are seeded percentile bootstrap intervals over sequences: whole sequences are resampled
with replacement, the same resamples for every layer and sublayer, so ``vs_earlier``'s interval
accounts for the correlation between blocks. Under the MLM loss the same numbers are the actual
(not counterfactual) context signal: exactly 0 for the last block's sublayers after mixing.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from gradflow.analysis.run_data import Run, read_sublayer_sequences
from gradflow.analysis.stats import bootstrap_sums, percentile_interval
from gradflow.errors import RunError, UsageError
from gradflow.roles import LOSS_ROLES
from gradflow.schema import PARAMS, PRESSURE_COLUMNS, SUBLAYER_SEQUENCES_FILE, sublayer_key


def context_pressure(run: Run, n_resamples: int = 2000, seed: int | None = 0, confidence: float = 0.95,
                     param: str = "weight") -> pd.DataFrame:
    """Context pressure of every (layer, sublayer) of ``run``, with sequence-bootstrap CIs.

    Returns one row per (layer, sublayer) in standard order, columns
    :data:`gradflow.schema.PRESSURE_COLUMNS`: ``layer``, ``sublayer``, ``param``, ``loss``
    (the run's loss), ``last_block``, ``pressure`` with ``ci_low``/``ci_high``,
    ``context_per_position`` and ``loss_per_position`` (summed magnitudes per position, the units
    of a weight gradient), ``n_context`` and ``n_loss`` (positions), ``n_sequences``, and for the
    last block ``earlier_mean``, ``vs_earlier`` with ``vs_earlier_ci_low``/``vs_earlier_ci_high``
    (NaN elsewhere, and where undefined). See the module docstring for the definitions.

    Raises :class:`RunError` when the run has no ``sublayer_sequences.parquet`` or no loss
    positions, :class:`UsageError` for a bad ``n_resamples``, ``confidence`` or ``param``.
    """
    if int(n_resamples) < 1:
        raise UsageError(f"context_pressure: n_resamples must be >= 1, got {n_resamples}")
    if not 0.0 < confidence < 1.0:
        raise UsageError(f"context_pressure: confidence must be in (0, 1), got {confidence}")
    if param not in PARAMS:
        raise UsageError(f"context_pressure: param must be one of {', '.join(PARAMS)}, got {param!r}")
    table = read_sublayer_sequences(run, param)
    if table.empty:
        raise RunError(f"{run.path / SUBLAYER_SEQUENCES_FILE} has no {param!r} rows: no sublayer of this model has a "
                       f"{param}; use another param.")
    sums, keys = pressure_sums(table)
    if sums[..., 3].sum() == 0:
        raise RunError(f"{run.path} recorded no loss positions (masked, random or kept), so the context pressure "
                       "(relative to them) is undefined; record with a mask rate above 0.")
    point = _pressure(sums.sum(axis=0))
    reps = _pressure(bootstrap_sums(sums, int(n_resamples), seed))
    low, high = percentile_interval(reps, confidence)
    totals = sums.sum(axis=0)
    last = max(layer for layer, _ in keys)
    out = pd.DataFrame({
        "layer": [k[0] for k in keys], "sublayer": [k[1] for k in keys], "param": param,
        "loss": str(run.meta.get("loss")), "last_block": [k[0] == last for k in keys],
        "pressure": point, "ci_low": low, "ci_high": high,
        "context_per_position": _divide(totals[:, 0], totals[:, 1]),
        "loss_per_position": _divide(totals[:, 2], totals[:, 3]),
        "n_context": totals[:, 1].astype(np.int64), "n_loss": totals[:, 3].astype(np.int64),
        "n_sequences": sums.shape[0],
    })
    vs = {c: np.full(len(keys), np.nan) for c in PRESSURE_COLUMNS[-4:]}
    for i, (layer, sub) in enumerate(keys):
        earlier = [j for j, (lay, s) in enumerate(keys) if s == sub and lay < last]
        if layer != last or not earlier:
            continue
        vs["earlier_mean"][i] = point[earlier].mean()
        vs["vs_earlier"][i] = _divide(point[i], vs["earlier_mean"][i])
        reps_vs = _divide(reps[:, i], reps[:, earlier].mean(axis=1))
        vs["vs_earlier_ci_low"][i], vs["vs_earlier_ci_high"][i] = percentile_interval(reps_vs, confidence)
    out = out.assign(**vs)
    return out[list(PRESSURE_COLUMNS)]


def pressure_sums(table: pd.DataFrame) -> tuple[np.ndarray, list[tuple[int, str]]]:
    """Per-sequence sums of a ``sublayer_sequences`` table (one param), for the bootstrap.

    Returns ``(sums, keys)``: ``sums`` is (sequences, keys, 4) float64 with, per sequence and
    (layer, sublayer) key, the context magnitude sum, context position count, loss-position
    magnitude sum and loss-position count; ``keys`` are the (layer, sublayer) pairs in standard
    order. Every sequence of the table is a row (zeros where it has no context or loss position).
    """
    seq_codes, seq_values = pd.factorize(table["sequence_index"], sort=True)
    is_context = (table["role"] == "context").to_numpy()
    used = is_context | table["role"].isin(LOSS_ROLES).to_numpy()
    t = table[used]
    param = str(t["param"].iloc[0]) if len(t) else PARAMS[0]
    keys = sorted({(int(lay), str(s)) for lay, s in zip(t["layer"], t["sublayer"])},
                  key=lambda k: sublayer_key(k[0], k[1], param))
    key_codes = pd.MultiIndex.from_tuples(keys, names=["layer", "sublayer"]).get_indexer(
        pd.MultiIndex.from_arrays([t["layer"].astype(int), t["sublayer"].astype(str)]))
    n_keys, size = len(keys), len(seq_values) * len(keys) * 4
    flat = (seq_codes[used] * n_keys + key_codes) * 4 + np.where(is_context[used], 0, 2)
    sums = np.bincount(flat, weights=t["magnitude_sum"].to_numpy(np.float64), minlength=size)
    sums += np.bincount(flat + 1, weights=t["n_positions"].to_numpy(np.float64), minlength=size)
    return sums.reshape(len(seq_values), n_keys, 4), keys


def _pressure(sums: np.ndarray) -> np.ndarray:
    """(..., 4) sums of (context magnitude, context count, loss magnitude, loss count) -> pressure."""
    return _divide(_divide(sums[..., 0], sums[..., 1]), _divide(sums[..., 2], sums[..., 3]))


def _divide(num: np.ndarray | float, den: np.ndarray | float) -> np.ndarray:
    """``num / den`` with NaN where undefined (0/0, x/0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.asarray(num, dtype=np.float64) / np.asarray(den, dtype=np.float64)
    return np.where(np.isfinite(out), out, np.nan)


__all__ = ["context_pressure", "pressure_sums"]
