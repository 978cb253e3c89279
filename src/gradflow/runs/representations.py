"""Representation diagnostics per layer and role, as bounded streaming accumulators.

- input shift: how separable the FFN inputs (``blocks.{i}.mid``) of loss and context positions
  are (cross-validated probe AUROC on a seeded sample, Hanley-McNeil standard error) and the
  Frechet distance between the two groups' Gaussians (streamed moments);
- anisotropy: mean pairwise cosine of a role's hidden states, from the running sum of unit vectors;
- transformation: per block, relative change ``||h_i - h_{i-1}|| / ||h_{i-1}||`` per position.

State per layer is bounded (sums, a fixed-size sample, H x H moments).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from gradflow.hooks.states import SiteStates
from gradflow.inputs.masking import MaskedBatch
from gradflow.roles import TOKEN_ROLES, Role, role_code
from gradflow.schema import DIAGNOSTIC_COLUMNS as TABLE_COLUMNS
from gradflow.schema import DIAGNOSTIC_GROUPS as GROUPS
from gradflow.schema import DIAGNOSTIC_ROLES as DIAG_ROLES
from gradflow.schema import LOSS
from gradflow.site_names import layer_site, site_name


def diagnostic_role_masks(roles: torch.Tensor) -> dict[str, torch.Tensor]:
    """(B, T) bool mask of each reported role, ``loss`` pooled."""
    masks = {name: roles == role_code(name) for name in TOKEN_ROLES if name in DIAG_ROLES}
    masks[LOSS] = roles <= Role.KEPT
    return masks


def array_tensor(array: np.ndarray) -> torch.Tensor:
    """A numpy array as a contiguous tensor of the same dtype and values (for a checkpoint)."""
    return torch.from_numpy(np.ascontiguousarray(array))


def tensor_array(tensor: torch.Tensor) -> np.ndarray:
    """A checkpoint's tensor back as a writable numpy array of the same dtype and values."""
    return tensor.numpy().copy()


def keyed_state(prefix: str, entries: dict[tuple[int, str], np.ndarray]) -> dict[str, Any]:
    """``{(layer, role): array}`` as ``prefix.keys`` (JSON, in insertion order) and one tensor per entry."""
    state: dict[str, Any] = {f"{prefix}.keys": [list(key) for key in entries]}
    state.update({f"{prefix}.{k}": array_tensor(value) for k, value in enumerate(entries.values())})
    return state


def keyed_arrays(prefix: str, state: dict[str, Any]) -> dict[tuple[int, str], np.ndarray]:
    """The inverse of :func:`keyed_state`."""
    return {(int(layer), str(role)): tensor_array(state[f"{prefix}.{k}"])
            for k, (layer, role) in enumerate(state[f"{prefix}.keys"])}


def sorted_by_layer_and_role(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows ordered by layer, then by the diagnostics' role order."""
    if frame.empty:
        return frame
    frame = frame.assign(_r=frame["role"].map(DIAG_ROLES.index))
    return frame.sort_values(["layer", "_r"]).drop(columns="_r").reset_index(drop=True)



# ----------------------------------------------------------------------------------------------
# Input shift: probe AUROC and Frechet distance
# ----------------------------------------------------------------------------------------------

class Reservoir:
    """A uniform sample of at most ``capacity`` vectors from a stream (bottom-k random keys).

    Every vector gets a key from a generator seeded by ``seed``; the ``capacity`` smallest keys
    are kept. Keys are drawn in stream order, so the sample does not depend on how the stream is
    batched.
    """

    def __init__(self, capacity: int, seed: Sequence[int]):
        self.capacity = capacity
        self.rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(seed))))
        self.keys = np.empty(0)
        self.values: np.ndarray | None = None
        self.seen = 0

    def add(self, x: np.ndarray) -> None:
        """Offer (N, H) vectors."""
        if x.shape[0] == 0:
            return
        keys = self.rng.random(x.shape[0])
        self.seen += x.shape[0]
        values = x if self.values is None else np.concatenate([self.values, x])
        keys = np.concatenate([self.keys, keys])
        if keys.size > self.capacity:
            keep = np.argpartition(keys, self.capacity - 1)[: self.capacity]
        else:
            keep = np.arange(keys.size)
        keep = keep[np.argsort(keys[keep], kind="stable")]
        self.keys, self.values = keys[keep], values[keep]

    def sample(self) -> np.ndarray:
        """(n, H) the current sample, in key order (a random order)."""
        return self.values if self.values is not None else np.empty((0, 0))

    def state_dict(self) -> dict[str, Any]:
        """Keys, sample, count and the generator's state (plain tensors, ints and dicts): :meth:`load_state_dict`
        continues the stream exactly."""
        return {"keys": array_tensor(self.keys), "values": None if self.values is None else array_tensor(self.values),
                "seen": self.seen, "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.keys = tensor_array(state["keys"])
        self.values = None if state["values"] is None else tensor_array(state["values"])
        self.seen = int(state["seen"])
        self.rng.bit_generator.state = state["rng"]


class RunningMoments:
    """Count, mean and scatter matrix of a stream of vectors (Chan et al. merge, float64)."""

    def __init__(self) -> None:
        self.n = 0
        self.mean: np.ndarray | None = None
        self.m2: np.ndarray | None = None

    def add(self, x: np.ndarray) -> None:
        """Add (N, H) vectors."""
        nb = x.shape[0]
        if nb == 0:
            return
        x = x.astype(np.float64)
        mb = x.mean(axis=0)
        centred = x - mb
        m2b = centred.T @ centred
        if self.mean is None:
            self.n, self.mean, self.m2 = nb, mb, m2b
            return
        n = self.n + nb
        delta = mb - self.mean
        self.mean = self.mean + delta * (nb / n)
        self.m2 = self.m2 + m2b + np.outer(delta, delta) * (self.n * nb / n)
        self.n = n

    def state_dict(self) -> dict[str, Any]:
        """Count, mean and scatter matrix (float64 tensors; None before the first vector)."""
        return {"n": self.n, "mean": None if self.mean is None else array_tensor(self.mean),
                "m2": None if self.m2 is None else array_tensor(self.m2)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"])
        self.mean = None if state["mean"] is None else tensor_array(state["mean"])
        self.m2 = None if state["m2"] is None else tensor_array(state["m2"])

    def covariance(self) -> np.ndarray:
        """Unbiased (H, H) covariance (needs n >= 2)."""
        return self.m2 / max(self.n - 1, 1)


def _sqrt_psd(matrix: np.ndarray) -> np.ndarray:
    vals, vecs = np.linalg.eigh((matrix + matrix.T) / 2)
    return (vecs * np.sqrt(np.clip(vals, 0.0, None))) @ vecs.T


def frechet_distance(mu1: np.ndarray, cov1: np.ndarray, mu2: np.ndarray, cov2: np.ndarray) -> float:
    """Frechet (2-Wasserstein squared) distance of two Gaussians, in squared activation units.

    ``||mu1 - mu2||^2 + tr(C1 + C2 - 2 (C1^1/2 C2 C1^1/2)^1/2)``, with symmetric square roots.
    """
    root1 = _sqrt_psd(cov1)
    cross = np.linalg.eigvalsh((root1 @ cov2 @ root1 + (root1 @ cov2 @ root1).T) / 2)
    trace = np.trace(cov1) + np.trace(cov2) - 2.0 * np.sqrt(np.clip(cross, 0.0, None)).sum()
    return float(np.sum((mu1 - mu2) ** 2) + max(trace, 0.0))


def auroc_standard_error(auc: float, n_pos: int, n_neg: int) -> float:
    """Hanley and McNeil (1982) standard error of an AUROC."""
    q1 = auc / (2 - auc)
    q2 = 2 * auc * auc / (1 + auc)
    var = (auc * (1 - auc) + (n_pos - 1) * (q1 - auc * auc) + (n_neg - 1) * (q2 - auc * auc)) / (n_pos * n_neg)
    return math.sqrt(max(var, 0.0))


def probe_auroc(positive: np.ndarray, negative: np.ndarray, folds: int = 5, seed: int = 0) -> tuple[float, float]:
    """(AUROC, standard error) of a stratified ``folds``-fold cross-validated linear probe.

    Standardised features, L2 logistic regression; the AUROC is computed on the pooled
    out-of-fold decision values. NaN when a group has fewer than 2 vectors. The standard error
    is Hanley and McNeil's, which ignores the probe's fitting noise: for two identical 8-d
    Gaussians (600 vectors each) cross-validated AUROCs spread about 1.35x wider, so the 95%
    interval covers 0.5 about 85% of the time. Read AUROCs within ~0.05 of 0.5 as "no shift".
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.model_selection import StratifiedKFold, cross_val_predict
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    k = min(folds, positive.shape[0], negative.shape[0])
    if k < 2:
        return float("nan"), float("nan")
    x = np.concatenate([positive, negative]).astype(np.float64)
    y = np.concatenate([np.ones(positive.shape[0]), np.zeros(negative.shape[0])])
    probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    scores = cross_val_predict(probe, x, y, cv=StratifiedKFold(k, shuffle=True, random_state=seed),
                               method="decision_function")
    auc = float(roc_auc_score(y, scores))
    return auc, auroc_standard_error(auc, positive.shape[0], negative.shape[0])


class InputShiftAccumulator:
    """Per block: a sample and the moments of the FFN inputs of loss and context positions."""

    def __init__(self, num_blocks: int, max_per_group: int = 2000, seed: int = 0):
        self.seed = seed
        self.reservoirs = {(i, g): Reservoir(max_per_group, (seed, i, k)) for i in range(num_blocks)
                           for k, g in enumerate(GROUPS)}
        self.moments = {(i, g): RunningMoments() for i in range(num_blocks) for g in GROUPS}

    def add(self, states: SiteStates, batch: MaskedBatch) -> None:
        roles = batch.roles.cpu()
        groups = {LOSS: roles <= Role.KEPT, "context": roles == Role.CONTEXT}
        for i, mid in enumerate(states.mid):
            for g, mask in groups.items():
                x = mid[mask].numpy()
                self.reservoirs[(i, g)].add(x.astype(np.float32))
                self.moments[(i, g)].add(x)

    def state_dict(self) -> dict[str, Any]:
        """Every block's and group's reservoir and moments, flat: ``reservoir.<i>.<group>.<field>``, ``moments...``."""
        state: dict[str, Any] = {}
        for kind, parts in (("reservoir", self.reservoirs), ("moments", self.moments)):
            for (i, group), part in parts.items():
                state.update({f"{kind}.{i}.{group}.{k}": v for k, v in part.state_dict().items()})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for kind, parts in (("reservoir", self.reservoirs), ("moments", self.moments)):
            for (i, group), part in parts.items():
                prefix = f"{kind}.{i}.{group}."
                part.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})

    def frame(self) -> pd.DataFrame:
        rows = []
        for i in sorted({i for i, _ in self.moments}):
            loss, ctx = self.moments[(i, LOSS)], self.moments[(i, "context")]
            a, b = self.reservoirs[(i, LOSS)].sample(), self.reservoirs[(i, "context")].sample()
            auc, se = probe_auroc(a, b, seed=self.seed) if a.size and b.size else (float("nan"), float("nan"))
            fd = shift = float("nan")
            if loss.n >= 2 and ctx.n >= 2:
                fd = frechet_distance(loss.mean, loss.covariance(), ctx.mean, ctx.covariance())
                shift = float(np.sum((loss.mean - ctx.mean) ** 2))
            rows.append({"layer": i + 1, "site": site_name(i, "mid"), "n_loss": loss.n, "n_context": ctx.n,
                         "n_sample_loss": a.shape[0] if a.size else 0, "n_sample_context": b.shape[0] if b.size else 0,
                         "auroc": auc, "auroc_se": se, "auroc_ci_low": auc - 1.96 * se,
                         "auroc_ci_high": auc + 1.96 * se, "frechet_distance": fd, "mean_shift_sq": shift})
        return pd.DataFrame(rows, columns=list(TABLE_COLUMNS["input_shift"]))


# ----------------------------------------------------------------------------------------------
# Anisotropy and last-block transformation
# ----------------------------------------------------------------------------------------------

def mean_pairwise_cosine(unit_sum: np.ndarray, n: int) -> float:
    """Mean cosine over ordered pairs i != j of n unit vectors whose sum is ``unit_sum``."""
    if n < 2:
        return float("nan")
    return float((np.dot(unit_sum, unit_sum) - n) / (n * (n - 1)))


class AnisotropyAccumulator:
    """Running sum of unit hidden vectors and their count, per layer and role (float64)."""

    def __init__(self) -> None:
        self.sums: dict[tuple[int, str], np.ndarray] = {}
        self.counts: dict[tuple[int, str], int] = {}

    def add(self, states: SiteStates, batch: MaskedBatch) -> None:
        masks = diagnostic_role_masks(batch.roles.cpu())
        for layer, hidden in enumerate(states.hidden):
            norms = torch.linalg.vector_norm(hidden.double(), dim=-1, keepdim=True)
            units = hidden.double() / norms.clamp_min(1e-300)  # zero vectors are left out below
            nonzero = norms.squeeze(-1) > 0
            for role, mask in masks.items():
                pick = mask & nonzero
                n = int(pick.sum())
                if n == 0:
                    continue
                key = (layer, role)
                total = units[pick].sum(dim=0).numpy()
                self.sums[key] = self.sums.get(key, 0.0) + total
                self.counts[key] = self.counts.get(key, 0) + n

    def state_dict(self) -> dict[str, Any]:
        """The running sums (one float64 tensor per layer and role, in insertion order) and counts."""
        return {**keyed_state("sums", self.sums), "counts": [self.counts[key] for key in self.sums]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sums = keyed_arrays("sums", state)
        self.counts = {key: int(n) for key, n in zip(self.sums, state["counts"])}

    def frame(self) -> pd.DataFrame:
        rows = [{"layer": layer, "site": layer_site(layer), "role": role, "n_positions": self.counts[(layer, role)],
                 "mean_pairwise_cosine": mean_pairwise_cosine(s, self.counts[(layer, role)])}
                for (layer, role), s in self.sums.items()]
        return sorted_by_layer_and_role(pd.DataFrame(rows, columns=list(TABLE_COLUMNS["anisotropy"])))


class TransformationAccumulator:
    """Per block and role: count, sum and sum of squares of ``||h_i - h_{i-1}|| / ||h_{i-1}||``."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.stats: dict[tuple[int, str], np.ndarray] = {}

    def add(self, states: SiteStates, batch: MaskedBatch) -> None:
        masks = diagnostic_role_masks(batch.roles.cpu())
        for i in range(1, len(states.hidden)):
            before, after = states.hidden[i - 1].double(), states.hidden[i].double()
            if before.shape != after.shape:
                continue  # factorised embeddings: block 0's input is the projection, not this site
            ref = torch.linalg.vector_norm(before, dim=-1)
            rel = torch.linalg.vector_norm(after - before, dim=-1) / ref.clamp_min(1e-30)
            valid = ref > 0
            for role, mask in masks.items():
                values = rel[mask & valid]
                if values.numel():
                    entry = self.stats.setdefault((i, role), np.zeros(3))
                    entry += (values.numel(), float(values.sum()), float((values * values).sum()))

    def state_dict(self) -> dict[str, Any]:
        """[count, sum, sum of squares] per block and role (float64 tensors, in insertion order)."""
        return keyed_state("stats", self.stats)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats = keyed_arrays("stats", state)

    def frame(self) -> pd.DataFrame:
        rows = []
        for (layer, role), (n, s, ss) in self.stats.items():
            mean = s / n
            var = max(ss / n - mean * mean, 0.0) * n / (n - 1) if n > 1 else float("nan")
            rows.append({"layer": layer, "role": role, "n_positions": int(n), "rel_change_mean": mean,
                         "rel_change_std": math.sqrt(var) if n > 1 else float("nan"),
                         "last_block": layer == self.num_blocks})
        return sorted_by_layer_and_role(pd.DataFrame(rows, columns=list(TABLE_COLUMNS["transformation"])))

