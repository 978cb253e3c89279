"""Known answers for the issue-15 statistics: AUC, steps to threshold, paired test, power and MDE."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from gradflow.analysis.experiment_stats import (
    area_under_curve,
    minimum_detectable_effect,
    paired_power,
    paired_test,
    steps_to_threshold,
)
from gradflow.analysis.stats import holm
from gradflow.errors import UsageError


def test_area_under_curve_known_shapes():
    steps = np.array([0, 50, 100, 200])
    assert area_under_curve(steps, np.full(4, 0.7)) == pytest.approx(0.7)
    assert area_under_curve(steps, steps / 200) == pytest.approx(0.5)
    # trapezoids: 0 (0-50), 0.5 * 50 * (0 + 1) = 25 (50-100), 100 * 1 = 100 (100-200); over 200 steps
    assert area_under_curve(steps, np.array([0, 0, 1, 1])) == pytest.approx(125 / 200)


def test_steps_to_threshold():
    steps = np.array([50, 100, 150, 200])
    values = np.array([0.1, 0.5, 0.9, 0.95])
    assert steps_to_threshold(steps, values, 0.9) == 150
    assert steps_to_threshold(steps, values, 0.05) == 50
    assert steps_to_threshold(steps, values, 0.99) == math.inf


def test_curves_reject_bad_input():
    with pytest.raises(UsageError, match="strictly increasing"):
        area_under_curve(np.array([0, 0]), np.array([1, 1]))
    with pytest.raises(UsageError, match="at least 2"):
        steps_to_threshold(np.array([1]), np.array([1]), 0.5)


def test_paired_test_matches_scipy_and_its_interval():
    d = np.array([0.02, -0.01, 0.03, 0.05, 0.0, 0.01, 0.04, -0.02, 0.03, 0.02])
    res = paired_test(d)
    assert res.mean == pytest.approx(d.mean()) and res.n == 10
    assert res.p_value == pytest.approx(stats.ttest_1samp(d, 0).pvalue)
    half = stats.t.ppf(0.975, 9) * d.std(ddof=1) / math.sqrt(10)
    assert (res.ci_low, res.ci_high) == pytest.approx((d.mean() - half, d.mean() + half))
    assert paired_test(np.zeros(5)).p_value == 1.0


def test_mde_has_the_requested_power_and_matches_the_textbook_approximation():
    mde = minimum_detectable_effect(sd=1.0, n=10, alpha=0.05, power=0.8)
    assert paired_power(mde, 1.0, 10, 0.05) == pytest.approx(0.8, abs=1e-6)
    approx = (stats.t.ppf(0.975, 9) + stats.t.ppf(0.8, 9)) / math.sqrt(10)  # 0.9946
    assert mde == pytest.approx(approx, rel=0.03)
    assert minimum_detectable_effect(2.0, 10) == pytest.approx(2 * mde)  # scales with sd
    assert minimum_detectable_effect(1.0, 40) < mde / 1.9  # about 1/sqrt(n)


def test_power_by_simulation():
    rng = np.random.default_rng(0)
    mde = minimum_detectable_effect(0.5, 12)
    hits = [stats.ttest_1samp(rng.normal(mde, 0.5, 12), 0).pvalue < 0.05 for _ in range(4000)]
    assert np.mean(hits) == pytest.approx(0.8, abs=0.02)
    assert paired_power(0.0, 1.0, 10) == pytest.approx(0.05, abs=1e-9)


def test_holm_known_answer():
    np.testing.assert_allclose(holm([0.01, 0.04, 0.03, 0.2]), [0.04, 0.09, 0.09, 0.2])
