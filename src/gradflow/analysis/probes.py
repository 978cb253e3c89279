"""Layer-wise linear probes: how good each layer's representations are as features (issue 14).

Pure functions over feature arrays (no model access). Shapes: features ``(N, H)`` float (N tokens,
H hidden units), labels ``(N,)`` int in ``0..K-1`` (or any ints for :func:`fit_probe`), sentence
ids ``(N,)`` (any values; tokens sharing an id form one bootstrap unit).

- :func:`fit_probe`: a standardised multinomial logistic-regression probe, C chosen on validation
  accuracy, scored on test (accuracy and a per-token correctness vector); the MLP family,
  :func:`gradflow.analysis.mlp_probe.fit_mlp_probe`, returns the same :class:`ProbeResult`;
- :func:`control_labels` and :func:`selectivity`: the Hewitt & Liang (2019) control task;
- :func:`online_code_length`: the Voita & Titov (2020) prequential code length, in bits;
- :func:`sentence_bootstrap_ci`, :func:`paired_difference_ci`, :func:`last_layer_drop_ci`: percentile
  intervals resampling whole sentences (:mod:`gradflow.analysis.stats`);
- :func:`last_layer_drop`: ``score(L) - max_{l<L} score(l)`` (negative when the last layer is worse).
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from gradflow.analysis.stats import bootstrap_sums, percentile_interval
from gradflow.errors import UsageError

DEFAULT_CS: tuple[float, ...] = (0.001, 0.01, 0.1, 1.0, 10.0)
"""Inverse regularisation strengths tried by :func:`fit_probe` (smaller = stronger L2 penalty)."""

DEFAULT_FRACTIONS: tuple[float, ...] = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.0625, 0.125, 0.25, 0.5, 1.0)
"""Block boundaries of the online code, as fractions of the data (Voita & Titov 2020)."""


@dataclass(frozen=True)
class ProbeResult:
    """One probe scored on test.

    ``accuracy`` is a fraction in [0, 1]; ``correct`` (N_test,) bool and ``predictions`` (N_test,)
    int are per test token, in input order; ``val_accuracy`` maps each tried C to its validation
    accuracy; ``majority_accuracy`` is the test accuracy of always predicting the most frequent
    training label (the baseline a featureless probe reaches).
    """

    accuracy: float
    correct: np.ndarray
    predictions: np.ndarray
    best_c: float
    val_accuracy: dict[float, float]
    majority_accuracy: float


@dataclass(frozen=True)
class CodeLength:
    """A prequential (online) code length, in bits.

    ``online_bits``: total code length of the labels; ``uniform_bits``: ``n * log2 K`` for the same
    n labels; ``compression``: ``uniform_bits / online_bits`` (> 1 when the probe beats the uniform
    code); ``block_bits``: bits per block, the first one uniform-coded; ``block_ends``: the exclusive
    end index of each block (its start is the previous end, or 0); ``token_bits`` (N,): each label's
    cost in input order (``log2 K`` for the first block), summing to ``online_bits``.
    """

    online_bits: float
    uniform_bits: float
    compression: float
    block_bits: tuple[float, ...]
    block_ends: tuple[int, ...]
    token_bits: np.ndarray | None = None


def _check_xy(x: np.ndarray, y: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Validate a (N, H) feature matrix and its (N,) labels; return them as float64 / int64 arrays."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y)
    if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise UsageError(f"{name}: features must be (N, H) and labels (N,), got {x.shape} and {y.shape}")
    if x.shape[0] == 0:
        raise UsageError(f"{name}: no tokens")
    if not np.issubdtype(y.dtype, np.integer):
        raise UsageError(f"{name}: labels must be integers, got dtype {y.dtype}")
    return x, y.astype(np.int64)


def _probe(c: float, seed: int, max_iter: int) -> Pipeline:
    """Standardise features, then multinomial L2 logistic regression with inverse strength ``c``."""
    return make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=max_iter, random_state=seed))


def _fit(model: Pipeline | LogisticRegression, x: np.ndarray, y: np.ndarray) -> Pipeline | LogisticRegression:
    """Fit ``model``; an unconverged lbfgs (large C on separable data) is still a usable probe.

    BLAS and OpenMP run on one thread: measured 15x faster than the default pools for probe-sized
    problems (4,300 x 256, 12 classes) on a 2-core machine with another process busy.
    """
    with warnings.catch_warnings(), threadpool_limits(1):
        warnings.simplefilter("ignore", ConvergenceWarning)
        return model.fit(x, y)


def checked_splits(train_x: np.ndarray, train_y: np.ndarray, val_x: np.ndarray, val_y: np.ndarray,
                   test_x: np.ndarray, test_y: np.ndarray, Cs: Sequence[float]
                   ) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """The three (features (N, H) float64, labels (N,) int64) pairs of a probe, checked (every probe family).

    Raises :class:`UsageError` on bad shapes, unequal widths, fewer than 2 train labels or an empty ``Cs``.
    """
    train = _check_xy(train_x, train_y, "train")
    val = _check_xy(val_x, val_y, "validation")
    test = _check_xy(test_x, test_y, "test")
    if not (train[0].shape[1] == val[0].shape[1] == test[0].shape[1]):
        raise UsageError("train, validation and test features must have the same width H")
    if np.unique(train[1]).size < 2:
        raise UsageError("a probe needs at least 2 distinct labels in train")
    if not Cs:
        raise UsageError("Cs must name at least one regularisation strength")
    return train, val, test


def fit_probe(train_x: np.ndarray, train_y: np.ndarray, val_x: np.ndarray, val_y: np.ndarray,
              test_x: np.ndarray, test_y: np.ndarray, Cs: Sequence[float] = DEFAULT_CS,
              seed: int = 0, max_iter: int = 1000) -> ProbeResult:
    """Fit one probe per C on train, keep the best on validation accuracy, score it on test.

    Features are (N_split, H), labels (N_split,) int. Ties in validation accuracy go to the smaller
    C (the stronger penalty). Raises :class:`UsageError` on bad shapes or fewer than 2 train labels.
    """
    (train_x, train_y), (val_x, val_y), (test_x, test_y) = checked_splits(
        train_x, train_y, val_x, val_y, test_x, test_y, Cs)
    scaler = StandardScaler().fit(train_x)
    train_z, val_z, test_z = scaler.transform(train_x), scaler.transform(val_x), scaler.transform(test_x)
    # One estimator walks the C path from strong to weak penalty, each fit warm-started from the last
    # (the optimum is unique, so only the iteration count changes).
    probe = LogisticRegression(max_iter=max_iter, random_state=seed, warm_start=True)
    best_c, scores, predictions = math.nan, {}, np.empty(0)
    for c in sorted(float(c) for c in Cs):
        _fit(probe.set_params(C=c), train_z, train_y)
        scores[c] = float(np.mean(probe.predict(val_z) == val_y))
        if math.isnan(best_c) or scores[c] > scores[best_c]:
            best_c, predictions = c, probe.predict(test_z)
    correct = predictions == test_y
    values, counts = np.unique(train_y, return_counts=True)
    majority = float(np.mean(test_y == values[np.argmax(counts)]))
    return ProbeResult(float(correct.mean()), correct, predictions, best_c, scores, majority)


def control_labels(word_types: Sequence[Hashable] | np.ndarray, labels: np.ndarray, seed: int = 0) -> np.ndarray:
    """Hewitt & Liang (2019) control task: one random label per word type -> (N,) int.

    Each distinct type (first-appearance order) draws a label from the empirical token-level
    distribution of ``labels`` (N,); every token of that type gets it. Pass all splits together so a
    type keeps its label across train, validation and test. The token-level control distribution
    matches the real one in expectation (exactly as the number of types grows).
    """
    labels = np.asarray(labels)
    if len(word_types) != labels.shape[0] or labels.ndim != 1:
        raise UsageError(f"word_types and labels must both be (N,), got {len(word_types)} and {labels.shape}")
    index: dict[Hashable, int] = {}
    type_of = np.fromiter((index.setdefault(t, len(index)) for t in word_types), dtype=np.int64,
                          count=labels.shape[0])
    values, counts = np.unique(labels, return_counts=True)
    rng = np.random.default_rng(seed)
    drawn = rng.choice(values, size=len(index), p=counts / counts.sum())
    return drawn[type_of].astype(np.int64)


def selectivity(task: ProbeResult, control: ProbeResult) -> float:
    """Task accuracy minus control-task accuracy (Hewitt & Liang 2019), in accuracy units."""
    return task.accuracy - control.accuracy


def _block_ends(n: int, fractions: Sequence[float]) -> list[int]:
    """Exclusive block ends ``round(f * n)`` (at least 1), strictly increasing, deduplicated."""
    fr = np.asarray(fractions, dtype=np.float64)
    if fr.size < 2 or np.any(fr <= 0) or np.any(fr > 1) or np.any(np.diff(fr) <= 0):
        raise UsageError("fractions must be at least 2 strictly increasing values in (0, 1]")
    ends: list[int] = []
    for f in fr:
        end = max(1, round(f * n))
        if not ends or end > ends[-1]:
            ends.append(end)
    return ends


def _label_proba(train_x: np.ndarray, train_y: np.ndarray, x: np.ndarray, num_classes: int,
                 c: float, seed: int, max_iter: int, eps: float) -> np.ndarray:
    """(n, K) probabilities of every label for ``x`` from a probe trained on the earlier blocks.

    With one training label only, the Laplace-smoothed label frequencies are used. Labels unseen in
    training get probability 0 from the probe, so the result is mixed with ``eps`` of uniform.
    """
    if np.unique(train_y).size < 2:
        prior = (np.bincount(train_y, minlength=num_classes) + 1.0) / (train_y.size + num_classes)
        return np.broadcast_to(prior, (x.shape[0], num_classes))
    model = _fit(_probe(c, seed, max_iter), train_x, train_y)
    proba = np.zeros((x.shape[0], num_classes))
    proba[:, model.classes_] = model.predict_proba(x)
    return (1.0 - eps) * proba + eps / num_classes


def online_code_length(x: np.ndarray, y: np.ndarray, num_classes: int,
                       fractions: Sequence[float] = DEFAULT_FRACTIONS, c: float = 1.0, seed: int = 0,
                       max_iter: int = 1000, eps: float = 1e-6) -> CodeLength:
    """Voita & Titov (2020) prequential (online) code length of labels ``y`` (N,) given ``x`` (N, H).

    The tokens are shuffled with ``seed`` and cut at ``fractions`` of N. The first block is coded
    with the uniform code (``n_1 log2 K`` bits); each later block with a probe (fixed ``c``) trained
    on all earlier blocks, costing ``sum -log2 p(label)`` bits. Labels must lie in ``0..K-1``.
    ``eps`` (a uniform mixture weight) keeps a label unseen so far at a finite cost.
    """
    x, y = _check_xy(x, y, "online code")
    if num_classes < 2 or y.min() < 0 or y.max() >= num_classes:
        raise UsageError(f"labels must lie in 0..{num_classes - 1} with num_classes >= 2")
    order = np.random.default_rng(seed).permutation(y.size)
    x, y = x[order], y[order]
    ends = _block_ends(y.size, fractions)
    token_bits = np.full(y.size, math.log2(num_classes))
    for start, stop in itertools.pairwise(ends):
        proba = _label_proba(x[:start], y[:start], x[start:stop], num_classes, c, seed, max_iter, eps)
        token_bits[start:stop] = -np.log2(proba[np.arange(stop - start), y[start:stop]])
    bits = [float(token_bits[a:b].sum()) for a, b in zip([0, *ends[:-1]], ends)]
    online = float(sum(bits))
    uniform = ends[-1] * math.log2(num_classes)
    in_input_order = np.empty_like(token_bits)
    in_input_order[order] = token_bits
    return CodeLength(online, uniform, uniform / online, tuple(bits), tuple(ends), in_input_order)


def _sentence_sums(columns: Sequence[np.ndarray], sentence_ids: np.ndarray) -> np.ndarray:
    """(S, C + 1) per-sentence sums of each (N,) column, then the per-sentence token count."""
    sentence_ids = np.asarray(sentence_ids)
    for col in columns:
        if np.shape(col) != sentence_ids.shape or sentence_ids.ndim != 1:
            raise UsageError(f"correctness and sentence ids must be (N,) of one length, got "
                             f"{np.shape(col)} and {sentence_ids.shape}")
    if sentence_ids.size == 0:
        raise UsageError("no tokens to bootstrap")
    _, inverse = np.unique(sentence_ids, return_inverse=True)
    sums = [np.bincount(inverse, weights=np.asarray(col, dtype=np.float64)) for col in columns]
    sums.append(np.bincount(inverse).astype(np.float64))
    return np.stack(sums, axis=1)


def _accuracy_replicates(columns: Sequence[np.ndarray], sentence_ids: np.ndarray, n_resamples: int,
                         seed: int | None) -> np.ndarray:
    """(n_resamples, C) bootstrap accuracies of each correctness column, resampling sentences."""
    reps = bootstrap_sums(_sentence_sums(columns, sentence_ids), n_resamples, seed)
    return reps[:, :-1] / reps[:, -1:]


def sentence_bootstrap_ci(correct: np.ndarray, sentence_ids: np.ndarray, n_resamples: int = 1000,
                          seed: int | None = 0, confidence: float = 0.95) -> tuple[float, float]:
    """Percentile interval (low, high) of accuracy (N,) bool -> fraction, resampling whole sentences."""
    reps = _accuracy_replicates([correct], sentence_ids, n_resamples, seed)[:, 0]
    low, high = percentile_interval(reps, confidence)
    return float(low), float(high)


def paired_difference_ci(correct_a: np.ndarray, correct_b: np.ndarray, sentence_ids: np.ndarray,
                         n_resamples: int = 1000, seed: int | None = 0,
                         confidence: float = 0.95) -> tuple[float, float]:
    """Percentile interval (low, high) of ``accuracy(a) - accuracy(b)`` on the same (N,) tokens.

    Both correctness vectors are resampled with the same sentences (a paired bootstrap).
    """
    reps = _accuracy_replicates([correct_a, correct_b], sentence_ids, n_resamples, seed)
    low, high = percentile_interval(reps[:, 0] - reps[:, 1], confidence)
    return float(low), float(high)


def _by_layer(values: Mapping[int, object] | Sequence[object]) -> list[object]:
    """Values in layer order: a mapping sorted by layer, or a sequence indexed by layer."""
    items = [values[k] for k in sorted(values)] if isinstance(values, Mapping) else list(values)
    if len(items) < 2:
        raise UsageError("the last-layer drop needs at least 2 layers")
    return items


def last_layer_drop(scores_by_layer: Mapping[int, float] | Sequence[float] | np.ndarray) -> float:
    """``score(L) - max_{l<L} score(l)`` over layers (mapping layer -> score, or a sequence).

    Negative when the last layer scores below the best earlier one; in the scores' own units.
    """
    scores = np.asarray(_by_layer(scores_by_layer), dtype=np.float64)
    return float(scores[-1] - scores[:-1].max())


def last_layer_drop_ci(correct_by_layer: Mapping[int, np.ndarray] | Sequence[np.ndarray],
                       sentence_ids: np.ndarray, n_resamples: int = 1000, seed: int | None = 0,
                       confidence: float = 0.95) -> tuple[float, float]:
    """Percentile interval (low, high) of the last-layer accuracy drop, resampling sentences.

    ``correct_by_layer`` holds one (N,) bool vector per layer on the same tokens; each replicate
    takes the last layer's accuracy minus the best earlier layer's (the max is re-taken per replicate).
    """
    columns = [np.asarray(c) for c in _by_layer(correct_by_layer)]
    reps = _accuracy_replicates(columns, sentence_ids, n_resamples, seed)
    low, high = percentile_interval(_drop_replicates(reps), confidence)
    return float(low), float(high)


def _drop_replicates(accuracy_replicates: np.ndarray) -> np.ndarray:
    """(B, L) bootstrap accuracies per layer -> (B,) last layer minus the best earlier layer."""
    return accuracy_replicates[:, -1] - accuracy_replicates[:, :-1].max(axis=1)


def drop_difference_ci(correct_a_by_layer: Mapping[int, np.ndarray] | Sequence[np.ndarray],
                       correct_b_by_layer: Mapping[int, np.ndarray] | Sequence[np.ndarray],
                       sentence_ids: np.ndarray, n_resamples: int = 1000, seed: int | None = 0,
                       confidence: float = 0.95) -> tuple[float, float, float]:
    """``last_layer_drop(a) - last_layer_drop(b)`` (accuracy) of two models probed on the same (N,) words.

    Each ``correct_*_by_layer`` holds one (N,) bool vector per layer of that model (the depths may
    differ). Returns (difference, low, high): the percentile interval resamples whole sentences, the
    same ones for both models (a paired bootstrap), and re-takes each model's best earlier layer per
    replicate. Negative when model a's last layer loses more than model b's.
    """
    a = [np.asarray(c) for c in _by_layer(correct_a_by_layer)]
    b = [np.asarray(c) for c in _by_layer(correct_b_by_layer)]
    point = last_layer_drop([c.mean() for c in a]) - last_layer_drop([c.mean() for c in b])
    reps = _accuracy_replicates([*a, *b], sentence_ids, n_resamples, seed)
    diffs = _drop_replicates(reps[:, : len(a)]) - _drop_replicates(reps[:, len(a):])
    low, high = percentile_interval(diffs, confidence)
    return float(point), float(low), float(high)


def code_length_drop(bits_by_layer: Mapping[int, float] | Sequence[float] | np.ndarray) -> float:
    """``min_{l<L} bits(l) - bits(L)``: the last layer's code-length drop in bits (negative when the
    last layer needs more bits than the best earlier one, i.e. is the worse feature)."""
    bits = np.asarray(_by_layer(bits_by_layer), dtype=np.float64)
    return float(bits[:-1].min() - bits[-1])


def code_length_drop_ci(token_bits_by_layer: Mapping[int, np.ndarray] | Sequence[np.ndarray],
                        sentence_ids: np.ndarray, n_resamples: int = 1000, seed: int | None = 0,
                        confidence: float = 0.95) -> tuple[float, float]:
    """Percentile interval (low, high) of :func:`code_length_drop` resampling whole sentences.

    ``token_bits_by_layer`` holds one (N,) per-label cost vector (bits, :attr:`CodeLength.token_bits`)
    per layer on the same tokens; each replicate sums the resampled sentences' bits per layer.
    """
    columns = [np.asarray(c, dtype=np.float64) for c in _by_layer(token_bits_by_layer)]
    reps = bootstrap_sums(_sentence_sums(columns, sentence_ids), n_resamples, seed)[:, :-1]
    low, high = percentile_interval(reps[:, :-1].min(axis=1) - reps[:, -1], confidence)
    return float(low), float(high)


__all__ = ["DEFAULT_CS", "DEFAULT_FRACTIONS", "CodeLength", "ProbeResult", "checked_splits", "code_length_drop",
           "code_length_drop_ci", "control_labels", "drop_difference_ci", "fit_probe",
           "last_layer_drop", "last_layer_drop_ci", "online_code_length", "paired_difference_ci",
           "selectivity", "sentence_bootstrap_ci"]
