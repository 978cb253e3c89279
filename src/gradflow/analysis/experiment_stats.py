"""Statistics of fine-tuning experiments (issue 15): curve summaries, paired tests, power.

Pure functions over numbers. Curves are validation scores ``values`` (n,) at increasing optimiser
``steps`` (n,); differences are per-seed paired differences ``arm - baseline`` (n_seeds,).

- :func:`area_under_curve`: trapezoidal area over the step range, divided by its length (the
  curve's mean score, in the metric's units);
- :func:`steps_to_threshold`: the first evaluated step whose score reaches a threshold;
- :func:`paired_test`: mean paired difference, Student-t CI and two-sided p-value;
- :func:`minimum_detectable_effect`: the smallest true mean difference a two-sided paired t-test
  at level ``alpha`` detects with probability ``power`` given the observed spread, and
  :func:`paired_power` (exact, non-central t) to check it;
- Holm's correction is :func:`gradflow.analysis.stats.holm`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats

from gradflow.errors import UsageError


def _curve(steps: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    steps = np.asarray(steps, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    if steps.ndim != 1 or steps.shape != values.shape or steps.size < 2:
        raise UsageError(f"a curve needs at least 2 (step, value) points of equal length, got {steps.shape} "
                         f"and {values.shape}")
    if np.any(np.diff(steps) <= 0):
        raise UsageError("curve steps must be strictly increasing")
    return steps, values


def area_under_curve(steps: np.ndarray, values: np.ndarray) -> float:
    """Trapezoidal area under ``values`` over ``steps``, divided by ``steps[-1] - steps[0]``.

    A constant curve c gives c; a straight line from 0 to 1 gives 0.5 (metric units).
    """
    steps, values = _curve(steps, values)
    return float(np.trapezoid(values, steps) / (steps[-1] - steps[0]))


def steps_to_threshold(steps: np.ndarray, values: np.ndarray, threshold: float) -> float:
    """The first evaluated step with ``value >= threshold``; ``inf`` when the curve never reaches it."""
    steps, values = _curve(steps, values)
    reached = np.flatnonzero(values >= threshold)
    return float(steps[reached[0]]) if reached.size else math.inf


@dataclass(frozen=True)
class PairedTest:
    """Mean of (n,) paired differences with its Student-t interval and two-sided p-value."""

    mean: float
    ci_low: float
    ci_high: float
    p_value: float
    sd: float
    n: int


def _differences(differences: np.ndarray) -> np.ndarray:
    d = np.asarray(differences, dtype=np.float64)
    d = d[np.isfinite(d)]
    if d.size < 2:
        raise UsageError(f"a paired test needs at least 2 finite paired differences, got {d.size}")
    return d


def paired_test(differences: np.ndarray, confidence: float = 0.95) -> PairedTest:
    """One-sample t-test of paired differences against 0 (two-sided) and the t interval of the mean."""
    d = _differences(differences)
    n, mean, sd = d.size, float(d.mean()), float(d.std(ddof=1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n))
    p = 1.0 if sd == 0 and mean == 0 else (0.0 if sd == 0 else float(stats.ttest_1samp(d, 0.0).pvalue))
    return PairedTest(mean, mean - half, mean + half, p, sd, n)


def minimum_detectable_effect(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """Smallest true mean difference a two-sided paired t-test at ``alpha`` detects with ``power``.

    ``sd``: the standard deviation of the paired differences; ``n``: the number of pairs. Solved
    exactly on the non-central t distribution (:func:`paired_power`), in the differences' units.
    """
    if n < 2 or not sd >= 0 or not 0 < alpha < 1 or not 0 < power < 1:
        raise UsageError("minimum_detectable_effect needs n >= 2, sd >= 0, alpha and power in (0, 1)")
    if sd == 0:
        return 0.0
    guess = (stats.t.ppf(1 - alpha / 2, n - 1) + stats.t.ppf(power, n - 1)) * sd / math.sqrt(n)
    return float(optimize.brentq(lambda e: paired_power(e, sd, n, alpha) - power, 1e-9 * sd, 3 * guess))


def paired_power(effect: float, sd: float, n: int, alpha: float = 0.05) -> float:
    """Exact power of the two-sided paired t-test at ``alpha`` for a true mean difference ``effect``."""
    df = n - 1
    crit = stats.t.ppf(1 - alpha / 2, df)
    delta = effect * math.sqrt(n) / sd
    upper, lower = float(stats.nct.sf(crit, df, abs(delta))), float(stats.nct.cdf(-crit, df, abs(delta)))
    # scipy's nct returns NaN far in the tails (|delta| around 9 and beyond): there the tail is 1 or 0
    upper = upper if math.isfinite(upper) else (1.0 if abs(delta) > crit else 0.0)
    lower = lower if math.isfinite(lower) else 0.0
    return upper + lower


__all__ = ["PairedTest", "area_under_curve", "minimum_detectable_effect", "paired_power", "paired_test",
           "steps_to_threshold"]
