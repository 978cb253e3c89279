"""Statistical building blocks: the sequence bootstrap, percentile intervals, Holm, Mann-Whitney, rank-biserial.

Bootstrap arrays are (sequences, ...) per-sequence sums: a resample draws whole sequences with
replacement (the sequence is the unit), seeded so that runs measured on the same sequences are
resampled together.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence

import numpy as np
from scipy import stats


def resample_weights(n_sequences: int, n_resamples: int, seed: int | None, chunk: int = 256) -> Iterator[np.ndarray]:
    """Yield (chunk, n_sequences) multinomial count matrices: sequences drawn with replacement.

    Row ``b`` counts how often each sequence appears in bootstrap resample ``b``. The same seed and
    ``n_sequences`` give the same resamples, which pairs runs measured on the same sequences.
    """
    rng = np.random.default_rng(seed)
    probs = np.full(n_sequences, 1.0 / n_sequences)
    done = 0
    while done < n_resamples:
        size = min(chunk, n_resamples - done)
        yield rng.multinomial(n_sequences, probs, size=size).astype(np.float64)
        done += size


def bootstrap_sums(values: np.ndarray, n_resamples: int = 2000, seed: int | None = 0) -> np.ndarray:
    """Bootstrap replicates of column sums of ``values`` (sequences, ...) -> (n_resamples, ...).

    With fewer than 2 sequences there is nothing to resample: every replicate is NaN, so intervals
    built on them are NaN (shown as "–"), never a zero-width interval that looks certain."""
    values = np.asarray(values, dtype=np.float64)
    if values.shape[0] < 2:
        return np.full((n_resamples, *values.shape[1:]), np.nan)
    flat = values.reshape(values.shape[0], -1)
    reps = [w @ flat for w in resample_weights(values.shape[0], n_resamples, seed)]
    return np.concatenate(reps, axis=0).reshape((n_resamples, *values.shape[1:]))


def percentile_interval(replicates: np.ndarray, confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval over axis 0 of bootstrap replicates, ignoring NaN replicates."""
    alpha = (1.0 - confidence) / 2.0
    reps = np.asarray(replicates, dtype=np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices give NaN, on purpose
        low, high = np.nanquantile(reps, [alpha, 1.0 - alpha], axis=0)
    return low, high


def bootstrap_ratio(num_sums: np.ndarray, num_counts: np.ndarray, den_sums: np.ndarray, den_counts: np.ndarray,
                    n_resamples: int = 2000, confidence: float = 0.95,
                    seed: int | None = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ratio of pooled means ``(sum num_sums / sum num_counts) / (sum den_sums / sum den_counts)``.

    Arrays are (sequences, ...) per-sequence sums and position counts. Returns (ratio, low, high)
    with the trailing shape; CIs are seeded percentile bootstrap intervals over sequences.
    """
    stacked = np.stack([np.asarray(a, dtype=np.float64) for a in (num_sums, num_counts, den_sums, den_counts)], -1)
    point = _ratio_from_sums(stacked.sum(axis=0))
    reps = _ratio_from_sums(bootstrap_sums(stacked, n_resamples, seed))
    low, high = percentile_interval(reps, confidence)
    return point, low, high


def _ratio_from_sums(sums: np.ndarray) -> np.ndarray:
    """(..., 4) of (num_sum, num_n, den_sum, den_n) -> ratio of means; NaN where undefined."""
    with np.errstate(divide="ignore", invalid="ignore"):
        num = sums[..., 0] / sums[..., 1]
        den = sums[..., 2] / sums[..., 3]
        out = num / den
    return np.where(np.isfinite(out), out, np.nan)


def holm(pvalues: Sequence[float] | np.ndarray) -> np.ndarray:
    """Holm-Bonferroni adjusted p-values (NaNs stay NaN and do not count as tests)."""
    p = np.asarray(pvalues, dtype=np.float64)
    out = np.full_like(p, np.nan)
    ok = np.flatnonzero(~np.isnan(p))
    m = ok.size
    if m == 0:
        return out
    order = ok[np.argsort(p[ok], kind="stable")]
    adjusted = np.minimum(1.0, (m - np.arange(m)) * p[order])
    out[order] = np.maximum.accumulate(adjusted)
    return out


def rank_biserial(u_statistic: float, n1: int, n2: int) -> float:
    """Rank-biserial correlation ``2 U1 / (n1 n2) - 1`` in [-1, 1]; > 0 when sample 1 tends larger."""
    if n1 == 0 or n2 == 0:
        return math.nan
    return 2.0 * float(u_statistic) / (n1 * n2) - 1.0


def mann_whitney(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Two-sided Mann-Whitney U: (U of ``x``, p). NaN for an empty sample; p = 1 when all values tie."""
    if x.size == 0 or y.size == 0:
        return math.nan, math.nan
    if np.ptp(np.concatenate([x, y])) == 0:
        return x.size * y.size / 2.0, 1.0
    res = stats.mannwhitneyu(x, y, alternative="two-sided")
    return float(res.statistic), float(res.pvalue)


__all__ = ["bootstrap_ratio", "bootstrap_sums", "holm", "mann_whitney", "percentile_interval", "rank_biserial",
           "resample_weights"]
