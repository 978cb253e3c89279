"""A small MLP probe (issue 31): the second probe family beside the logistic regression.

:func:`fit_mlp_probe` takes the arguments of :func:`gradflow.analysis.probes.fit_probe` and returns the
same :class:`~gradflow.analysis.probes.ProbeResult`, so every CI and drop function works unchanged.

The probe: inputs standardised on train (as the logistic probe's), one hidden layer of ``hidden`` (256)
ReLU units, a linear softmax read-out, trained with Adam on the mean cross-entropy plus the logistic
probe's L2 penalty at the same ``C`` (``||W||^2 / (2 C N_train)`` over both weight matrices, biases
free: sklearn's ``LogisticRegression`` objective divided by ``C N``), in mini-batches of
``batch_size`` words for at most ``max_epochs`` epochs. Regularisation is chosen on validation twice:
per C, the epoch with the best validation accuracy is kept (early stopping after ``patience`` epochs
without improvement); across C, the best validation accuracy wins (ties to the smaller C, as for the
logistic probe). Everything is seeded (initialisation and batch order) and runs on one CPU thread,
so a fit is bit-for-bit reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from sklearn.preprocessing import StandardScaler

from gradflow.analysis.probes import ProbeResult, checked_splits

DEFAULT_MLP_CS: tuple[float, ...] = (0.1, 10.0)
"""Inverse L2 strengths tried by :func:`fit_mlp_probe` (the logistic probe's C, same meaning)."""

HIDDEN_UNITS = 256
"""Width of the MLP probe's one hidden layer (the pre-registered plan, figures/twelve-blocks/plan.md)."""


def _network(width: int, hidden: int, classes: int, seed: int) -> torch.nn.Sequential:
    """Linear(width, hidden) -> ReLU -> Linear(hidden, classes), initialised from ``seed`` only."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes))


def _predict(net: torch.nn.Sequential, x: torch.Tensor, chunk: int = 8192) -> np.ndarray:
    """(N,) int class index (into the network's outputs) of each row of ``x`` (N, H)."""
    with torch.no_grad():
        return torch.cat([net(x[i:i + chunk]).argmax(dim=1) for i in range(0, x.shape[0], chunk)]).numpy()


def _train_one(x: torch.Tensor, y: torch.Tensor, val_x: torch.Tensor, val_y: np.ndarray, classes: int, c: float,
               seed: int, hidden: int, max_epochs: int, patience: int, batch_size: int, lr: float
               ) -> tuple[float, dict[str, torch.Tensor]]:
    """Train one MLP at inverse strength ``c``; return (best validation accuracy, the weights at its epoch)."""
    net = _network(x.shape[1], hidden, classes, seed)
    weights = [net[0].weight, net[2].weight]
    optimiser = torch.optim.Adam(net.parameters(), lr=lr)
    penalty = 1.0 / (2.0 * c * x.shape[0])
    rng = np.random.default_rng(seed)
    best, best_state, waited = -1.0, {}, 0
    for _ in range(max_epochs):
        order = torch.from_numpy(rng.permutation(x.shape[0]))
        for start in range(0, x.shape[0], batch_size):
            rows = order[start:start + batch_size]
            loss = torch.nn.functional.cross_entropy(net(x[rows]), y[rows])
            loss = loss + penalty * sum(w.pow(2).sum() for w in weights)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
        score = float(np.mean(_predict(net, val_x) == val_y))
        if score > best:
            best, waited = score, 0
            best_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
        else:
            waited += 1
            if waited >= patience:
                break
    return best, best_state


def fit_mlp_probe(train_x: np.ndarray, train_y: np.ndarray, val_x: np.ndarray, val_y: np.ndarray,
                  test_x: np.ndarray, test_y: np.ndarray, Cs: Sequence[float] = DEFAULT_MLP_CS, seed: int = 0,
                  hidden: int = HIDDEN_UNITS, max_epochs: int = 40, patience: int = 4, batch_size: int = 256,
                  lr: float = 1e-3) -> ProbeResult:
    """Fit one MLP probe per C on train (early-stopped on validation), keep the best on validation, score on test.

    Features are (N_split, H), labels (N_split,) int (any values; the network predicts the train labels).
    Returns a :class:`ProbeResult` whose ``best_c`` and ``val_accuracy`` are over ``Cs``. Raises
    :class:`~gradflow.errors.UsageError` on bad shapes, fewer than 2 train labels or an empty ``Cs``.
    """
    (train_x, train_y), (val_x, val_y), (test_x, test_y) = checked_splits(
        train_x, train_y, val_x, val_y, test_x, test_y, Cs)
    classes, train_index = np.unique(train_y, return_inverse=True)
    scaler = StandardScaler().fit(train_x)

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(scaler.transform(a).astype(np.float32))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, y, vx, tx = tensor(train_x), torch.from_numpy(train_index), tensor(val_x), tensor(test_x)
        val_index = np.searchsorted(classes, val_y).clip(0, classes.size - 1)
        val_index = np.where(classes[val_index] == val_y, val_index, -1)  # a label unseen in train: never right
        best_c, scores, state = math.nan, {}, {}
        for c in sorted(float(c) for c in Cs):
            scores[c], weights = _train_one(x, y, vx, val_index, classes.size, c, seed, hidden, max_epochs,
                                            patience, batch_size, lr)
            if math.isnan(best_c) or scores[c] > scores[best_c]:
                best_c, state = c, weights
        net = _network(x.shape[1], hidden, classes.size, seed)
        net.load_state_dict(state)
        predictions = classes[_predict(net, tx)]
    finally:
        torch.set_num_threads(threads)
    correct = predictions == test_y
    counts = np.bincount(train_index)
    majority = float(np.mean(test_y == classes[np.argmax(counts)]))
    return ProbeResult(float(correct.mean()), correct, predictions, best_c, scores, majority)


__all__ = ["DEFAULT_MLP_CS", "HIDDEN_UNITS", "fit_mlp_probe"]
