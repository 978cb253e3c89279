"""Channel metrics of one run: gradient-norm profiles by layer and role, ratios to the loss positions, tests.

Means and ratios are pooled over positions from ``sequences.parquet`` with seeded sequence
bootstraps (see :mod:`gradflow.analysis.stats`); ``loss`` is the pooled masked + random + kept
pseudo-role (:data:`gradflow.schema.LOSS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from gradflow.analysis.run_data import Run
from gradflow.analysis.stats import bootstrap_sums, holm, mann_whitney, percentile_interval, rank_biserial
from gradflow.errors import RunError
from gradflow.roles import LOSS_ROLES, ROLE_ORDER
from gradflow.schema import ANALYSIS_COLUMNS, LOSS, REPORTED_ROLES, conform


@dataclass(frozen=True)
class _Cube:
    """Per-sequence sums and counts at one point: arrays (sequences, layers, roles)."""

    sequence_index: np.ndarray
    layers: np.ndarray
    sites: list[str]
    roles: list[str]
    sums: np.ndarray
    counts: np.ndarray


def _sequence_cube(sequences: pd.DataFrame, point: str = "out", value: str = "grad_norm_sum") -> _Cube:
    """Pivot the long per-sequence table into (sequences, layers, roles) sums and counts."""
    frame = sequences[sequences["point"].astype(str) == point]
    if frame.empty:
        raise RunError(f"sequences.parquet has no rows at point {point!r}.")
    seqs = np.sort(frame["sequence_index"].unique())
    layers = np.sort(frame["layer"].unique())
    roles = [r for r in ROLE_ORDER if r in set(frame["role"])]
    shape = (len(seqs), len(layers), len(roles))
    at = (np.searchsorted(seqs, frame["sequence_index"].to_numpy()), np.searchsorted(layers, frame["layer"].to_numpy()),
          frame["role"].map({r: i for i, r in enumerate(roles)}).to_numpy(np.int64))
    sums, counts = np.zeros(shape), np.zeros(shape)
    np.add.at(sums, at, frame[value].to_numpy(np.float64))
    np.add.at(counts, at, frame["n_positions"].to_numpy(np.float64))
    site_of = frame.drop_duplicates("layer").set_index("layer")["site"]
    return _Cube(seqs, layers, [str(site_of[layer]) for layer in layers], roles, sums, counts)


def _with_loss(cube: _Cube) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Roles plus the pooled "loss" pseudo-role appended as the last role."""
    li = [i for i, r in enumerate(cube.roles) if r in LOSS_ROLES]
    sums = np.concatenate([cube.sums, cube.sums[..., li].sum(-1, keepdims=True)], axis=-1)
    counts = np.concatenate([cube.counts, cube.counts[..., li].sum(-1, keepdims=True)], axis=-1)
    return [*cube.roles, LOSS], sums, counts


def _means(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Pooled means over axis 0 (or of already-summed arrays); NaN where there are no positions."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = sums / counts
    return np.where(counts > 0, out, np.nan)


@dataclass(frozen=True)
class RoleProfile:
    """Point estimates and bootstrap replicates of per-(layer, role) pooled mean gradient norms."""

    cube: _Cube
    roles: list[str]
    n_positions: np.ndarray   # (L, R)
    n_sequences: np.ndarray   # (L, R)
    means: np.ndarray         # (L, R)
    replicates: np.ndarray    # (B, L, R)


def bootstrap_profile(run: Run, point: str, n_resamples: int, seed: int | None) -> RoleProfile:
    """Pooled mean gradient norm per (layer, role incl. loss) with sequence-bootstrap replicates."""
    cube = _sequence_cube(run.sequences, point)
    roles, sums, counts = _with_loss(cube)
    stacked = np.stack([sums, counts], axis=-1)  # (S, L, R, 2)
    reps = bootstrap_sums(stacked, n_resamples, seed)
    return RoleProfile(cube=cube, roles=roles, n_positions=counts.sum(0), n_sequences=(counts > 0).sum(0),
                    means=_means(sums.sum(0), counts.sum(0)), replicates=_means(reps[..., 0], reps[..., 1]))


def role_profile(run: Run, point: str = "out", n_resamples: int = 2000, confidence: float = 0.95,
                 seed: int | None = 0) -> pd.DataFrame:
    """Mean gradient norm per layer and role (plus pooled ``loss``), with bootstrap CIs.

    Columns: ``ANALYSIS_COLUMNS["role_profile"]`` of :mod:`gradflow.schema`: ``layer``, ``site``, ``role``,
    ``n_positions``, ``n_sequences`` (sequences with at least one position of the role), ``grad_norm_mean``
    (pooled over positions), ``ci_low``, ``ci_high``, ``zero_fraction`` (fraction of the role's positions
    with exactly zero gradient, from channels.csv; NaN for ``loss``).
    """
    return profile_frame(bootstrap_profile(run, point, n_resamples, seed), run, point, confidence)


def profile_frame(prof: RoleProfile, run: Run, point: str, confidence: float) -> pd.DataFrame:
    """Tidy :func:`role_profile` table from an already bootstrapped profile."""
    low, high = percentile_interval(prof.replicates, confidence)
    rows = [{"layer": int(layer), "site": prof.cube.sites[li], "role": role,
             "n_positions": int(prof.n_positions[li, ri]), "n_sequences": int(prof.n_sequences[li, ri]),
             "grad_norm_mean": prof.means[li, ri], "ci_low": low[li, ri], "ci_high": high[li, ri]}
            for li, layer in enumerate(prof.cube.layers) for ri, role in enumerate(prof.roles)
            if prof.n_positions[li, ri] > 0]
    out = pd.DataFrame(rows)
    if not out.empty:
        zf = run.channels[run.channels["point"] == point].set_index(["layer", "role"])["grad_norm_zero_fraction"]
        out["zero_fraction"] = [zf.get((layer, role), np.nan) for layer, role in zip(out["layer"], out["role"])]
    return conform(out, ANALYSIS_COLUMNS["role_profile"], "role_profile")


def ratio_replicates(prof: RoleProfile, roles: Sequence[str]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(roles present, point ratios (L, R), replicate ratios (B, L, R)) of each role vs loss."""
    present = [r for r in roles if r in prof.roles]
    idx = [prof.roles.index(r) for r in present]
    loss = prof.roles.index(LOSS)
    with np.errstate(divide="ignore", invalid="ignore"):
        point = prof.means[:, idx] / prof.means[:, [loss]]
        reps = prof.replicates[..., idx] / prof.replicates[..., [loss]]
    return present, np.where(np.isfinite(point), point, np.nan), np.where(np.isfinite(reps), reps, np.nan)


def role_ratios(run: Run, roles: Sequence[str] = REPORTED_ROLES, point: str = "out", n_resamples: int = 2000,
                confidence: float = 0.95, seed: int | None = 0) -> pd.DataFrame:
    """Per layer, each role's mean gradient norm over the pooled loss-position mean, with CIs.

    Columns: ``layer``, ``site``, ``role``, ``reference`` (always ``"loss"``), ``ratio``,
    ``ci_low``, ``ci_high``, ``role_mean``, ``loss_mean``, ``n_positions``, ``n_sequences``.
    Roles absent from the run are left out; ``ratio`` is NaN where the loss mean is zero.
    """
    prof = bootstrap_profile(run, point, n_resamples, seed)
    return ratio_frame(prof, roles, confidence)


def ratio_frame(prof: RoleProfile, roles: Sequence[str], confidence: float) -> pd.DataFrame:
    """Tidy ratio table from a profile (see :func:`role_ratios`)."""
    present, point, reps = ratio_replicates(prof, roles)
    low, high = percentile_interval(reps, confidence)
    loss = prof.roles.index(LOSS)
    rows = []
    for li, layer in enumerate(prof.cube.layers):
        for ri, role in enumerate(present):
            r = prof.roles.index(role)
            if prof.n_positions[li, r] == 0:
                continue
            rows.append({"layer": int(layer), "site": prof.cube.sites[li], "role": role, "reference": LOSS,
                         "ratio": point[li, ri], "ci_low": low[li, ri], "ci_high": high[li, ri],
                         "role_mean": prof.means[li, r], "loss_mean": prof.means[li, loss],
                         "n_positions": int(prof.n_positions[li, r]), "n_sequences": int(prof.n_sequences[li, r])})
    return pd.DataFrame(rows, columns=list(ANALYSIS_COLUMNS["role_ratios"]))


def context_ratio(run: Run, point: str = "out", n_resamples: int = 2000, confidence: float = 0.95,
                  seed: int | None = 0) -> pd.DataFrame:
    """Context / loss-position gradient-norm ratio per layer (the :func:`role_ratios` columns)."""
    return role_ratios(run, ("context",), point, n_resamples, confidence, seed)


def sequence_means(run: Run, roles: Sequence[str] = REPORTED_ROLES, point: str = "out") -> pd.DataFrame:
    """Per-sequence mean gradient norm of each role (the unit of the rank tests).

    Columns: ``sequence_index``, ``layer``, ``site``, ``role``, ``n_positions``, ``grad_norm_mean``.
    Sequences without positions of a role have no row for it.
    """
    frame = run.sequences[(run.sequences["point"].astype(str) == point) & run.sequences["role"].isin(list(roles))]
    grouped = frame.groupby(["sequence_index", "layer", "site", "role"], as_index=False, observed=True)[
        ["grad_norm_sum", "n_positions"]].sum()
    grouped = grouped[grouped["n_positions"] > 0].copy()
    grouped["grad_norm_mean"] = grouped["grad_norm_sum"] / grouped["n_positions"]
    return grouped.drop(columns="grad_norm_sum").reset_index(drop=True)


def layer_tests(run: Run, role: str = "context", against: str = "masked", point: str = "out",
                alpha: float = 0.05) -> pd.DataFrame:
    """Per layer: Mann-Whitney U test of per-sequence mean gradient norms, ``role`` vs ``against``.

    The sequence is the unit (one mean per sequence and role). Note that a role with few positions
    per sequence (masked: ~15% of tokens) has noisier per-sequence means than context, so the
    test is sensitive to spread as well as location. Two-sided; p-values are
    Holm-corrected across layers. Columns: ``layer``, ``site``, ``role``, ``against``, ``n_role``,
    ``n_against`` (sequences), ``median_role``, ``median_against``, ``u_statistic`` (U of
    ``role``), ``p_value``, ``p_holm``, ``rank_biserial`` (> 0: ``role`` tends larger),
    ``significant`` (``p_holm < alpha``).
    """
    means = sequence_means(run, (role, against), point)
    rows = []
    for (layer, site), group in means.groupby(["layer", "site"], sort=True):
        x = group.loc[group["role"] == role, "grad_norm_mean"].to_numpy()
        y = group.loc[group["role"] == against, "grad_norm_mean"].to_numpy()
        u, p = mann_whitney(x, y)
        rows.append({"layer": int(layer), "site": site, "role": role, "against": against, "n_role": x.size,
                     "n_against": y.size, "median_role": np.median(x) if x.size else np.nan,
                     "median_against": np.median(y) if y.size else np.nan, "u_statistic": u, "p_value": p,
                     "rank_biserial": rank_biserial(u, x.size, y.size)})
    out = pd.DataFrame(rows)
    if not out.empty:
        out["p_holm"] = holm(out["p_value"].to_numpy())
        out["significant"] = out["p_holm"] < alpha
    return conform(out, ANALYSIS_COLUMNS["layer_tests"], "layer_tests").sort_values("layer").reset_index(drop=True)


def channel_quantiles(run: Run, roles: Sequence[str] = REPORTED_ROLES, point: str = "out") -> pd.DataFrame:
    """Per layer and role, the gradient-norm distribution summary from channels.csv.

    Columns: ``layer``, ``site``, ``role``, ``n_positions``, ``mean``, ``median``, ``q05``,
    ``q95``, ``zero_fraction``.
    """
    ch = run.channels[(run.channels["point"].astype(str) == point) & run.channels["role"].isin(list(roles))]
    out = ch.rename(columns={"grad_norm_mean": "mean", "grad_norm_median": "median", "grad_norm_q05": "q05",
                             "grad_norm_q95": "q95", "grad_norm_zero_fraction": "zero_fraction"})
    out = out[list(ANALYSIS_COLUMNS["channel_quantiles"])]
    out = out.assign(_r=out["role"].map(list(roles).index)).sort_values(["layer", "_r"]).drop(columns="_r")
    return out.reset_index(drop=True)


__all__ = ["channel_quantiles", "context_ratio", "layer_tests", "role_profile", "role_ratios", "sequence_means"]
