"""Streaming accumulators: memory independent of corpus length, mergeable across processes.

Per (site, role) the site aggregator keeps the count, mean and M2 (Welford/Chan, float64) of the
per-position gradient norm and activation norm, plus a fixed log-spaced histogram of each (bin
width 0.02 decades from 1e-14 to 1e6, an exact-zero bin, an under- and an overflow bin), from which
medians and quantiles are read (resolution about 5% relative). Per (layer, sublayer, param, role)
the sublayer aggregator sums positions, non-zero positions and per-position magnitudes over the
corpus, and keeps the mean and spread *across batches* of the role's contribution norm
``||G_r||_F`` (a batch-level quantity). Padding depends on how sequences are batched, so ``pad``
positions are not aggregated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from gradflow.hooks.recorder import BatchRecord
from gradflow.roles import ALL_ROLES, NUM_ROLES, role_code
from gradflow.schema import REPORTED_ROLES, SUBLAYER_SEQUENCE_COLUMNS, sublayer_key

SublayerKey = tuple[int, str, str, str]
"""(layer, sublayer, param, role) of a sublayers.csv row."""
LOG_LO, LOG_HI, LOG_STEP = -14.0, 6.0, 0.02
N_LOG_BINS = int(round((LOG_HI - LOG_LO) / LOG_STEP))
N_BINS = N_LOG_BINS + 3  # [zero, underflow, log bins..., overflow]
REPORTED_SLOT = torch.full((NUM_ROLES,), -1, dtype=torch.long)
REPORTED_SLOT[[role_code(r) for r in REPORTED_ROLES]] = torch.arange(len(REPORTED_ROLES))
"""(NUM_ROLES,) long: each role code's column in the per-role arrays (:data:`REPORTED_ROLES` order), -1 for the
codes never aggregated (``pad``, and ``relpos``, which no position has)."""


def reported_slots(roles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep, slots) of flat role codes: which positions are aggregated (all but ``pad``) and their columns."""
    slots = REPORTED_SLOT[roles.reshape(-1).long()]
    keep = slots >= 0
    return keep, slots[keep]


def histogram_bins(values: torch.Tensor) -> torch.Tensor:
    """Bin index of each non-negative value: 0 exact zero, 1 below 1e-14, last above 1e6."""
    v = values.double()
    idx = torch.floor((torch.log10(v.clamp_min(1e-300)) - LOG_LO) / LOG_STEP).long() + 2
    idx = idx.clamp(1, N_BINS - 1)
    return torch.where(v == 0, torch.zeros_like(idx), idx)


def histogram_quantile(hist: np.ndarray, q: float) -> float:
    """Quantile ``q`` of the values binned in ``hist`` (geometric bin centres; 0 for the zero bin)."""
    total = hist.sum()
    if total == 0:
        return float("nan")
    target = q * (total - 1)
    cum = np.cumsum(hist)
    b = int(np.searchsorted(cum, target, side="right"))
    if b == 0:
        return 0.0
    if b == 1:
        return 10.0 ** LOG_LO
    if b >= N_BINS - 1:
        return 10.0 ** LOG_HI
    return 10.0 ** (LOG_LO + (b - 2 + 0.5) * LOG_STEP)


def _chan_merge(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    n = n_a + n_b
    safe = np.where(n > 0, n, 1)
    delta = mean_b - mean_a
    mean = mean_a + delta * n_b / safe
    m2 = m2_a + m2_b + delta ** 2 * n_a * n_b / safe
    return n, mean, m2


@dataclass
class SiteAggregator:
    """Per (site, role) moments and histograms of gradient and activation norms."""

    site_names: tuple[str, ...]
    site_layers: tuple[int, ...]
    site_points: tuple[str, ...]
    count: np.ndarray = field(init=False)
    grad_mean: np.ndarray = field(init=False)
    grad_m2: np.ndarray = field(init=False)
    act_mean: np.ndarray = field(init=False)
    act_m2: np.ndarray = field(init=False)
    grad_hist: np.ndarray = field(init=False)
    act_hist: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        shape = (len(self.site_names), len(REPORTED_ROLES))
        self.count = np.zeros(shape)
        self.grad_mean, self.grad_m2 = np.zeros(shape), np.zeros(shape)
        self.act_mean, self.act_m2 = np.zeros(shape), np.zeros(shape)
        self.grad_hist = np.zeros((*shape, N_BINS), dtype=np.int64)
        self.act_hist = np.zeros((*shape, N_BINS), dtype=np.int64)

    def add(self, record: BatchRecord) -> None:
        """Fold one batch in (pad positions are skipped)."""
        s_count, r_count = self.count.shape
        keep, roles = reported_slots(record.roles)
        grad = record.grad_norm.reshape(s_count, -1)[:, keep].double()
        act = record.act_norm.reshape(s_count, -1)[:, keep].double()
        group = (torch.arange(s_count).unsqueeze(1) * r_count + roles.unsqueeze(0)).reshape(-1)
        n = torch.bincount(group, minlength=s_count * r_count).double()
        for values, mean_attr, m2_attr, hist_attr in ((grad, "grad_mean", "grad_m2", "grad_hist"),
                                                      (act, "act_mean", "act_m2", "act_hist")):
            flat = values.reshape(-1)
            sums = torch.zeros(s_count * r_count, dtype=torch.float64).index_add_(0, group, flat)
            mean_b = sums / n.clamp_min(1)
            m2_b = torch.zeros_like(sums).index_add_(0, group, (flat - mean_b[group]) ** 2)
            _, mean, m2 = _chan_merge(self.count, getattr(self, mean_attr), getattr(self, m2_attr),
                                      n.numpy().reshape(s_count, r_count), mean_b.numpy().reshape(s_count, r_count),
                                      m2_b.numpy().reshape(s_count, r_count))
            setattr(self, mean_attr, mean)
            setattr(self, m2_attr, m2)
            bins = histogram_bins(flat)
            hist = torch.bincount(group * N_BINS + bins, minlength=s_count * r_count * N_BINS)
            getattr(self, hist_attr).__iadd__(hist.numpy().reshape(s_count, r_count, N_BINS))
        self.count = self.count + n.numpy().reshape(s_count, r_count)

    def merge(self, other: "SiteAggregator") -> None:
        """Fold another aggregator (e.g. another process's) into this one."""
        for mean_attr, m2_attr in (("grad_mean", "grad_m2"), ("act_mean", "act_m2")):
            _, mean, m2 = _chan_merge(self.count, getattr(self, mean_attr), getattr(self, m2_attr),
                                      other.count, getattr(other, mean_attr), getattr(other, m2_attr))
            setattr(self, mean_attr, mean)
            setattr(self, m2_attr, m2)
        self.count = self.count + other.count
        self.grad_hist += other.grad_hist
        self.act_hist += other.act_hist

    def frame(self) -> pd.DataFrame:
        """channels.csv rows: one per (site, role) with at least one position."""
        rows = []
        for s, site in enumerate(self.site_names):
            for r, role in enumerate(REPORTED_ROLES):
                n = self.count[s, r]
                if n == 0:
                    continue
                g_hist, a_hist = self.grad_hist[s, r], self.act_hist[s, r]
                rows.append({
                    "site": site, "layer": self.site_layers[s], "point": self.site_points[s], "role": role,
                    "n_positions": int(n),
                    "grad_norm_mean": self.grad_mean[s, r],
                    "grad_norm_std": math.sqrt(self.grad_m2[s, r] / (n - 1)) if n > 1 else 0.0,
                    "grad_norm_median": histogram_quantile(g_hist, 0.5),
                    "grad_norm_q05": histogram_quantile(g_hist, 0.05),
                    "grad_norm_q95": histogram_quantile(g_hist, 0.95),
                    "grad_norm_zero_fraction": g_hist[0] / n,
                    "act_norm_mean": self.act_mean[s, r],
                    "act_norm_std": math.sqrt(self.act_m2[s, r] / (n - 1)) if n > 1 else 0.0,
                    "act_norm_median": histogram_quantile(a_hist, 0.5),
                })
        return pd.DataFrame(rows)


@dataclass
class SublayerAggregator:
    """Per (layer, sublayer, param, role): corpus sums and across-batch moments of ||G_r||_F."""

    sums: dict[SublayerKey, np.ndarray] = field(default_factory=dict)

    # per key: [n_positions, n_nonzero, magnitude_sum, n_batches, norm_mean, norm_m2]
    def add(self, record: BatchRecord) -> None:
        """Fold one batch in (pad skipped)."""
        for rec in record.sublayers:
            for code, role in enumerate(ALL_ROLES):
                if role == "pad" or int(rec.n_positions[code]) == 0:
                    continue
                key = (rec.depth + 1, rec.sublayer, rec.param, role)
                norm = float(rec.contribution_norm[code])
                batch = np.array([float(rec.n_positions[code]), float(rec.n_nonzero[code]),
                                  float(rec.magnitude_sum[code]), 1.0, norm, 0.0])
                self._fold(key, batch)

    def _fold(self, key: SublayerKey, batch: np.ndarray) -> None:
        if key not in self.sums:
            self.sums[key] = batch.copy()
            return
        old = self.sums[key]
        n, mean, m2 = _chan_merge(old[3], old[4], old[5], batch[3], batch[4], batch[5])
        self.sums[key] = np.array([old[0] + batch[0], old[1] + batch[1], old[2] + batch[2], n, mean, m2])

    def merge(self, other: "SublayerAggregator") -> None:
        """Fold another aggregator in (order-independent up to float rounding)."""
        for key in sorted(other.sums, key=_key_order):
            self._fold(key, other.sums[key])

    def frame(self) -> pd.DataFrame:
        """sublayers.csv rows, sorted by layer, standard sublayer order, param, role."""
        rows = []
        totals: dict[tuple, float] = {}
        for key, v in self.sums.items():
            totals[key[:3]] = totals.get(key[:3], 0.0) + v[2]
        for key in sorted(self.sums, key=_key_order):
            layer, sublayer, param, role = key
            n_pos, n_nz, mag, n_b, mean, m2 = self.sums[key]
            total = totals[key[:3]]
            rows.append({
                "layer": layer, "sublayer": sublayer, "param": param, "role": role,
                "n_positions": int(n_pos), "n_nonzero": int(n_nz), "coverage": n_nz / n_pos if n_pos else 0.0,
                "magnitude_sum": mag, "share": mag / total if total > 0 else 0.0,
                "contribution_norm_mean": mean,
                "contribution_norm_std": math.sqrt(m2 / (n_b - 1)) if n_b > 1 else 0.0,
                "n_batches": int(n_b),
            })
        return pd.DataFrame(rows)


def _key_order(key: SublayerKey) -> tuple[int, ...]:
    """Row order of sublayers.csv (see :func:`gradflow.schema.sublayer_key`)."""
    return sublayer_key(*key)


def sequence_rows(record: BatchRecord) -> pd.DataFrame:
    """Per (sequence, site, role) sums for sequences.parquet (pad skipped).

    Columns: :data:`gradflow.schema.SEQUENCE_COLUMNS`.
    """
    s_count, b, t = record.grad_norm.shape
    r_count = len(REPORTED_ROLES)
    keep, slots = reported_slots(record.roles)
    pos_group = (torch.arange(b).unsqueeze(1) * r_count).expand(b, t).reshape(-1)[keep] + slots
    group = (torch.arange(s_count).unsqueeze(1) * (b * r_count) + pos_group.unsqueeze(0)).reshape(-1)
    size = s_count * b * r_count
    grad = record.grad_norm.reshape(s_count, -1)[:, keep].double().reshape(-1)
    act = record.act_norm.reshape(s_count, -1)[:, keep].double().reshape(-1)
    n = torch.bincount(group, minlength=size)
    g_sum = torch.zeros(size, dtype=torch.float64).index_add_(0, group, grad)
    g_sq = torch.zeros(size, dtype=torch.float64).index_add_(0, group, grad * grad)
    a_sum = torch.zeros(size, dtype=torch.float64).index_add_(0, group, act)
    present = torch.nonzero(n).squeeze(1)
    site_i = present // (b * r_count)
    seq_i = (present // r_count) % b
    role_i = present % r_count
    names = np.array(record.site_names)
    return pd.DataFrame({
        "sequence_index": record.sequence_index[seq_i].numpy().astype(np.int64),
        "site": names[site_i.numpy()],
        "layer": np.array(record.site_layers)[site_i.numpy()],
        "point": np.array(record.site_points)[site_i.numpy()],
        "role": np.array(REPORTED_ROLES)[role_i.numpy()],
        "n_positions": n[present].numpy().astype(np.int64),
        "grad_norm_sum": g_sum[present].numpy(),
        "grad_norm_sq_sum": g_sq[present].numpy(),
        "act_norm_sum": a_sum[present].numpy(),
    })


def sublayer_sequence_rows(record: BatchRecord) -> pd.DataFrame:
    """Per (sequence, layer, sublayer, param, role) sums for sublayer_sequences.parquet (pad skipped).

    Sums the recorder's (B, T) per-position magnitudes ``||g_t|| * ||x_t||`` (weights) and ``||g_t||``
    (biases) in float64 (the recorder must run with ``position_magnitudes``; parameters without them,
    e.g. only ``relpos`` rows, are left out). Columns: :data:`gradflow.schema.SUBLAYER_SEQUENCE_COLUMNS`.
    """
    recs = [r for r in record.sublayers if r.position_magnitude is not None]
    if not recs:
        return pd.DataFrame({c: [] for c in SUBLAYER_SEQUENCE_COLUMNS})
    b, t = record.roles.shape
    r_count = len(REPORTED_ROLES)
    keep, slots = reported_slots(record.roles)
    pos_group = (torch.arange(b).unsqueeze(1) * r_count).expand(b, t).reshape(-1)[keep] + slots
    group = (torch.arange(len(recs)).unsqueeze(1) * (b * r_count) + pos_group.unsqueeze(0)).reshape(-1)
    size = len(recs) * b * r_count
    mags = torch.stack([r.position_magnitude.reshape(-1) for r in recs])[:, keep].double().reshape(-1)
    n = torch.bincount(group, minlength=size)
    sums = torch.zeros(size, dtype=torch.float64).index_add_(0, group, mags)
    present = torch.nonzero(n).squeeze(1)
    rec_i = (present // (b * r_count)).numpy()
    seq_i = (present // r_count) % b
    return pd.DataFrame({
        "sequence_index": record.sequence_index[seq_i].numpy().astype(np.int64),
        "layer": np.array([r.depth + 1 for r in recs], dtype=np.int64)[rec_i],
        "sublayer": np.array([r.sublayer for r in recs])[rec_i],
        "param": np.array([r.param for r in recs])[rec_i],
        "role": np.array(REPORTED_ROLES)[(present % r_count).numpy()],
        "n_positions": n[present].numpy().astype(np.int64),
        "magnitude_sum": sums[present].numpy(),
    })


def record_is_finite(record: BatchRecord) -> bool:
    """False when the loss or any recorded norm is NaN or infinite (such batches are not averaged in)."""
    if not math.isfinite(record.loss):
        return False
    if not (torch.isfinite(record.grad_norm).all() and torch.isfinite(record.act_norm).all()):
        return False
    return all(torch.isfinite(r.contribution_norm).all() and torch.isfinite(r.magnitude_sum).all()
               for r in record.sublayers)
