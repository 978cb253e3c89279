"""Layer-wise linear probes (issue 14) on planted signals: decodability, selectivity, code length, CIs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradflow.analysis import (
    control_labels,
    fit_probe,
    last_layer_drop,
    last_layer_drop_ci,
    online_code_length,
    paired_difference_ci,
    selectivity,
    sentence_bootstrap_ci,
)
from gradflow.errors import UsageError

K, H = 4, 16
PROBS = (0.4, 0.3, 0.2, 0.1)  # majority baseline 0.4
SPLITS = (1500, 2000)  # the train | validation | test boundaries _probe uses on 3000 tokens


def _layers(strengths, n=3000, seed=0):
    """Labels (n,) and one (n, H) Gaussian feature matrix per layer, the label one-hot added at ``strength``."""
    rng = np.random.default_rng(seed)
    y = rng.choice(K, size=n, p=PROBS)
    feats = []
    for s in strengths:
        x = rng.normal(size=(n, H))
        x[:, :K] += s * np.eye(K)[y]
        feats.append(x)
    return y, feats


def _probe(x, y):
    """Fit and score a probe on a 50 / 17 / 33 % train / validation / test split of ``x`` (n, H)."""
    n = y.size
    a, b = n // 2, n * 2 // 3
    return fit_probe(x[:a], y[:a], x[a:b], y[a:b], x[b:], y[b:], seed=0)


def test_label_planted_at_one_layer_is_decodable_there_only():
    y, feats = _layers([0, 0, 4.0, 0, 0])
    results = [_probe(x, y) for x in feats]
    assert results[2].accuracy >= 0.95
    for layer, r in enumerate(results):
        assert r.correct.shape == (3000 - SPLITS[1],) and r.correct.dtype == bool
        assert r.accuracy == pytest.approx(r.correct.mean())
        assert set(r.val_accuracy) == {0.001, 0.01, 0.1, 1.0, 10.0} and r.best_c in r.val_accuracy
        if layer != 2:
            assert abs(r.accuracy - r.majority_accuracy) <= 0.1
            assert abs(r.majority_accuracy - 0.4) < 0.05


def test_random_labels_have_no_selectivity_and_planted_labels_do():
    rng = np.random.default_rng(1)
    n, n_types = 12000, 6000  # large enough that control and real majority baselines agree
    types = rng.integers(0, n_types, size=n)
    y = rng.choice(K, size=n, p=(0.55, 0.25, 0.1, 0.1))
    control = control_labels(types, y, seed=0)
    noise = rng.normal(size=(n, H))
    sel = selectivity(_probe(noise, y), _probe(noise, control))
    assert abs(sel) < 0.05
    planted = noise.copy()
    planted[:, :K] += 4.0 * np.eye(K)[y]
    assert selectivity(_probe(planted, y), _probe(planted, control)) > 0.3


def test_control_labels_are_a_function_of_type_and_keep_the_distribution():
    rng = np.random.default_rng(2)
    types = np.array([f"w{i}" for i in rng.integers(0, 4000, size=20000)], dtype=object)
    y = rng.choice(K, size=types.size, p=PROBS)
    control = control_labels(types, y, seed=3)
    assert control.shape == y.shape and control.dtype == np.int64
    for t in np.unique(types)[:300]:
        assert np.unique(control[types == t]).size == 1
    real = np.bincount(y, minlength=K) / y.size
    fake = np.bincount(control, minlength=K) / y.size
    assert np.abs(real - fake).max() < 0.03
    assert np.array_equal(control, control_labels(list(types), y, seed=3))
    assert not np.array_equal(control, control_labels(types, y, seed=4))


def test_code_length_ordering_matches_accuracy_ordering():
    y, feats = _layers([0, 0.5, 1.0, 4.0, 0])
    accs = [_probe(x, y).accuracy for x in feats]
    codes = [online_code_length(x[:SPLITS[1]], y[:SPLITS[1]], K, seed=0) for x in feats]
    bits = [c.online_bits for c in codes]
    assert int(np.argmax(accs)) == int(np.argmin(bits)) == 3
    assert np.array_equal(np.argsort(accs[:4]), np.argsort(bits[:4])[::-1])
    best = codes[3]
    assert best.uniform_bits == pytest.approx(SPLITS[1] * math.log2(K))
    assert best.online_bits < 0.3 * best.uniform_bits and best.compression > 3
    assert best.online_bits == pytest.approx(sum(best.block_bits))
    assert best.block_ends[-1] == SPLITS[1] and best.block_bits[0] == pytest.approx(2 * math.log2(K))


def test_online_code_rejects_labels_outside_the_classes():
    with pytest.raises(UsageError):
        online_code_length(np.zeros((10, 2)), np.arange(10), num_classes=4)


def _sentences(n_sentences, p=0.8, tokens=10, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.repeat(np.arange(n_sentences), tokens)
    per_sentence = np.clip(p + rng.normal(0, 0.1, n_sentences), 0, 1)  # sentence-level clustering
    return rng.random(ids.size) < per_sentence[ids], ids


def test_sentence_bootstrap_ci_covers_the_truth_and_shrinks():
    small, small_ids = _sentences(100)
    big, big_ids = _sentences(1600, seed=1)
    lo_s, hi_s = sentence_bootstrap_ci(small, small_ids, seed=0)
    lo_b, hi_b = sentence_bootstrap_ci(big, big_ids, seed=0)
    assert lo_s < 0.8 < hi_s and lo_b < 0.8 < hi_b
    assert lo_s < small.mean() < hi_s
    assert (hi_b - lo_b) < 0.4 * (hi_s - lo_s)


def test_paired_difference_ci():
    a, ids = _sentences(400)
    same = paired_difference_ci(a, a, ids)
    assert same == (0.0, 0.0)
    b = a.copy()
    b[::5] = False  # b loses about 0.2 * 0.8 of accuracy
    lo, hi = paired_difference_ci(a, b, ids)
    assert 0 < lo < (a.mean() - b.mean()) < hi


def test_last_layer_drop_values_and_sign():
    assert last_layer_drop({0: 0.5, 1: 0.9, 2: 0.7, 3: 0.6}) == pytest.approx(-0.3)
    assert last_layer_drop([0.5, 0.6, 0.8]) == pytest.approx(0.2)
    assert last_layer_drop({3: 0.6, 0: 0.5, 1: 0.9}) == pytest.approx(-0.3)  # sorted by layer
    with pytest.raises(UsageError):
        last_layer_drop([0.5])


def test_last_layer_drop_ci_brackets_the_drop():
    rng = np.random.default_rng(5)
    ids = np.repeat(np.arange(300), 10)
    layers = {k: rng.random(ids.size) < p for k, p in enumerate((0.6, 0.9, 0.8, 0.7))}
    point = last_layer_drop({k: v.mean() for k, v in layers.items()})
    lo, hi = last_layer_drop_ci(layers, ids, seed=0)
    assert hi < 0 and lo < point < hi
    assert point == pytest.approx(-0.2, abs=0.03)


def test_fit_probe_rejects_bad_inputs():
    x, y = np.zeros((6, 2)), np.zeros(6, dtype=int)
    with pytest.raises(UsageError):
        fit_probe(x, y, x, y, x, y)  # one label only
    with pytest.raises(UsageError):
        fit_probe(x, np.arange(5), x, y, x, y)  # shape mismatch
