"""Analysis of a recorded run: pure functions from the run tables to tidy DataFrames.

A run directory holds ``channels.csv`` (per site and role), ``sublayers.csv`` (per layer,
sublayer, parameter and role), ``sequences.parquet`` (per sequence, site and role) and
``meta.json``. :func:`load_run` reads and validates them into a :class:`Run`.

Conventions used by every function here:

- ``layer`` 0 is the embeddings output, layer ``i + 1`` is the output of block ``i``; channel
  metrics use ``point == "out"`` unless told otherwise.
- "loss" is the pooled loss-position pseudo-role ``masked + random + kept``, pooled by position
  count (a position-weighted mean, not a mean of role means).
- Gradient-norm means, ratios and their confidence intervals come from ``sequences.parquet``:
  the ratio of pooled means ``(sum of norms / number of positions)`` over the sequences, and a
  seeded percentile bootstrap that resamples *sequences* with replacement (the sequence is the
  unit: positions inside one sequence are not independent).
- Sublayer shares come from ``sublayers.csv``: a role's share of the summed per-position
  magnitudes ``||g_t|| * ||x_t||`` of one parameter's weight gradient.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from gradflow.errors import RunError
from gradflow.roles import ALL_ROLES, LOSS_ROLES

LOSS = "loss"
"""Name of the pooled loss-position pseudo-role (masked + random + kept)."""

DEFAULT_ROLES: tuple[str, ...] = ("masked", "random", "kept", "context", "special")
"""Roles compared against the loss positions by default (``pad`` left out: it carries no signal)."""

SUBLAYER_ORDER: tuple[str, ...] = (
    "attn.q", "attn.k", "attn.v", "attn.out", "attn.norm", "ffn.in", "ffn.gate", "ffn.out", "ffn.norm",
)

CHANNEL_COLUMNS: tuple[str, ...] = (
    "site", "layer", "point", "role", "n_positions", "grad_norm_mean", "grad_norm_std", "grad_norm_median",
    "grad_norm_q05", "grad_norm_q95", "grad_norm_zero_fraction", "act_norm_mean", "act_norm_std",
    "act_norm_median",
)
SUBLAYER_COLUMNS: tuple[str, ...] = (
    "layer", "sublayer", "param", "role", "n_positions", "n_nonzero", "coverage", "magnitude_sum", "share",
    "contribution_norm_mean", "contribution_norm_std", "n_batches",
)
SEQUENCE_COLUMNS: tuple[str, ...] = (
    "sequence_index", "site", "layer", "point", "role", "n_positions", "grad_norm_sum", "grad_norm_sq_sum",
    "act_norm_sum",
)
META_KEYS: tuple[str, ...] = (
    "model", "family", "num_layers", "tokenizer", "masking", "loss", "seed", "complete", "versions", "command",
    "counts",
)
RUN_FILES: dict[str, str] = {
    "channels": "channels.csv", "sublayers": "sublayers.csv", "sequences": "sequences.parquet",
    "meta": "meta.json",
}



@dataclass(frozen=True)
class Run:
    """The validated tables of one run directory."""

    path: Path
    channels: pd.DataFrame
    sublayers: pd.DataFrame
    sequences: pd.DataFrame
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Whether the run finished (``meta["complete"]``)."""
        return bool(self.meta.get("complete", False))

    @property
    def num_layers(self) -> int:
        """Number of blocks (``meta["num_layers"]``, else the deepest layer in the tables)."""
        n = self.meta.get("num_layers")
        return int(n) if n is not None else int(self.channels["layer"].max())

    @property
    def label(self) -> str:
        """A short name: ``meta["label"]`` if set, else the directory name."""
        return str(self.meta.get("label") or self.path.name)

    @property
    def tokenizer_hash(self) -> str | None:
        """``meta["tokenizer"]["hash"]`` or None."""
        tok = self.meta.get("tokenizer")
        return str(tok["hash"]) if isinstance(tok, dict) and tok.get("hash") is not None else None


# ----------------------------------------------------------------------------------------------
# Loading and validation
# ----------------------------------------------------------------------------------------------

def load_run(path: str | Path) -> Run:
    """Read and validate a run directory; raise :class:`RunError` with an actionable message."""
    root = Path(path)
    if not root.exists():
        raise RunError(
            f"Run directory {str(root)!r} does not exist. Pass the output directory of a gradflow "
            f"measurement run (it holds {', '.join(RUN_FILES.values())}); check the path for typos.")
    if not root.is_dir():
        raise RunError(f"{str(root)!r} is a file, not a run directory. Pass the directory that holds "
                       f"{', '.join(RUN_FILES.values())}.")
    missing = [name for name in RUN_FILES.values() if not (root / name).is_file()]
    if missing:
        raise RunError(
            f"Run directory {str(root)!r} lacks {', '.join(missing)}. A run directory needs all of "
            f"{', '.join(RUN_FILES.values())}; these are written together by the measurement run, so a "
            "missing file usually means the run was interrupted before its first checkpoint or the path "
            "points at the wrong directory. Rerun the measurement (or resume it) and point at its output.")
    meta = _read_meta(root / RUN_FILES["meta"])
    channels = _read_table(root / RUN_FILES["channels"], CHANNEL_COLUMNS)
    sublayers = _read_table(root / RUN_FILES["sublayers"], SUBLAYER_COLUMNS)
    sequences = _read_table(root / RUN_FILES["sequences"], SEQUENCE_COLUMNS)
    for name, frame in (("channels.csv", channels), ("sublayers.csv", sublayers), ("sequences.parquet", sequences)):
        _check_roles(root / name, frame)
    for name, frame in (("channels.csv", channels), ("sequences.parquet", sequences)):
        _check_points(root / name, frame)
    run = Run(path=root, channels=channels, sublayers=sublayers, sequences=sequences, meta=meta)
    _warn_if_inconsistent(run)
    return run


def _read_meta(path: Path) -> dict[str, Any]:
    """Parse meta.json and check the keys the analysis relies on."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise RunError(f"{str(path)!r} is not valid JSON ({err}). It is written by the measurement run; "
                       "rerun it, or restore the file from the run's output.") from None
    if not isinstance(meta, dict):
        raise RunError(f"{str(path)!r} must hold a JSON object, found {type(meta).__name__}.")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise RunError(f"{str(path)!r} lacks the keys {', '.join(missing)}. The report needs the provenance "
                       "written by the measurement run; rerun it with a current gradflow version.")
    if not isinstance(meta["tokenizer"], dict) or "hash" not in meta["tokenizer"]:
        raise RunError(f"{str(path)!r}: 'tokenizer' must be an object with 'name_or_path', 'vocab_size' and "
                       "'hash'; rerun the measurement with a current gradflow version.")
    return meta


def _read_table(path: Path, columns: Sequence[str]) -> pd.DataFrame:
    """Read a CSV or parquet table and check that it has ``columns`` and at least one row."""
    try:
        frame = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    except Exception as err:  # noqa: BLE001 - any reader failure becomes one actionable message
        raise RunError(f"Could not read {str(path)!r} ({type(err).__name__}: {err}). The file is damaged or "
                       "was still being written; rerun or resume the measurement.") from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise RunError(f"{str(path)!r} lacks the columns {', '.join(missing)} (found: "
                       f"{', '.join(map(str, frame.columns))}). It was written by an incompatible gradflow "
                       "version; rerun the measurement with this version.")
    if frame.empty:
        raise RunError(f"{str(path)!r} has no rows: the run recorded no batches. Check that the corpus "
                       "is not empty and rerun the measurement.")
    frame = frame.copy()
    frame["role"] = frame["role"].astype(str)
    frame["layer"] = frame["layer"].astype(int)
    return frame


def _check_roles(path: Path, frame: pd.DataFrame) -> None:
    """Raise when a table names a role gradflow does not know."""
    unknown = sorted(set(frame["role"]) - set(ALL_ROLES))
    if unknown:
        raise RunError(f"{str(path)!r} has unknown roles {', '.join(unknown)}; roles are "
                       f"{', '.join(ALL_ROLES)}. The file was not written by gradflow's recorder.")


def _check_points(path: Path, frame: pd.DataFrame) -> None:
    """Raise when a site table has points other than ``out`` and ``mid``."""
    bad = sorted(set(frame["point"].astype(str)) - {"out", "mid"})
    if bad:
        raise RunError(f"{str(path)!r} has unknown points {', '.join(bad)}; points are 'out' and 'mid'.")


def _warn_if_inconsistent(run: Run) -> None:
    """Warn when channels.csv means disagree with the pooled means of sequences.parquet."""
    seq = run.sequences.groupby(["site", "role"], as_index=False)[["grad_norm_sum", "n_positions"]].sum()
    ch = run.channels[["site", "role", "grad_norm_mean"]]
    joined = ch.merge(seq.rename(columns={"n_positions": "n_positions_seq"}), on=["site", "role"], how="inner")
    joined = joined[joined["n_positions_seq"] > 0]
    if joined.empty:
        return
    pooled = joined["grad_norm_sum"] / joined["n_positions_seq"]
    if not np.allclose(pooled, joined["grad_norm_mean"], rtol=1e-3, atol=1e-12):
        warnings.warn(f"{run.path}: grad_norm_mean in channels.csv disagrees with the pooled means of "
                      "sequences.parquet; ratios and CIs use sequences.parquet.", RuntimeWarning, stacklevel=3)


# ----------------------------------------------------------------------------------------------
# Bootstrap and tests: the statistical building blocks
# ----------------------------------------------------------------------------------------------

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
    """Bootstrap replicates of column sums of ``values`` (sequences, ...) -> (n_resamples, ...)."""
    values = np.asarray(values, dtype=np.float64)
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


# ----------------------------------------------------------------------------------------------
# Channel metrics
# ----------------------------------------------------------------------------------------------

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
    roles = [r for r in ALL_ROLES if r in set(frame["role"])]
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
class _Profile:
    """Point estimates and bootstrap replicates of per-(layer, role) pooled mean gradient norms."""

    cube: _Cube
    roles: list[str]
    n_positions: np.ndarray   # (L, R)
    n_sequences: np.ndarray   # (L, R)
    means: np.ndarray         # (L, R)
    replicates: np.ndarray    # (B, L, R)


def _profile(run: Run, point: str, n_resamples: int, seed: int | None) -> _Profile:
    """Pooled mean gradient norm per (layer, role incl. loss) with sequence-bootstrap replicates."""
    cube = _sequence_cube(run.sequences, point)
    roles, sums, counts = _with_loss(cube)
    stacked = np.stack([sums, counts], axis=-1)  # (S, L, R, 2)
    reps = bootstrap_sums(stacked, n_resamples, seed)
    return _Profile(cube=cube, roles=roles, n_positions=counts.sum(0), n_sequences=(counts > 0).sum(0),
                    means=_means(sums.sum(0), counts.sum(0)), replicates=_means(reps[..., 0], reps[..., 1]))


def role_profile(run: Run, point: str = "out", n_resamples: int = 2000, confidence: float = 0.95,
                 seed: int | None = 0) -> pd.DataFrame:
    """Mean gradient norm per layer and role (plus pooled ``loss``), with bootstrap CIs.

    Columns: ``layer``, ``site``, ``role``, ``n_positions``, ``n_sequences`` (sequences with at
    least one position of the role), ``grad_norm_mean`` (pooled over positions), ``ci_low``,
    ``ci_high``, ``zero_fraction`` (fraction of the role's positions with exactly zero gradient,
    from channels.csv; NaN for ``loss``).
    """
    return _profile_frame(_profile(run, point, n_resamples, seed), run, point, confidence)


def _ratio_replicates(prof: _Profile, roles: Sequence[str]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(roles present, point ratios (L, R), replicate ratios (B, L, R)) of each role vs loss."""
    present = [r for r in roles if r in prof.roles]
    idx = [prof.roles.index(r) for r in present]
    loss = prof.roles.index(LOSS)
    with np.errstate(divide="ignore", invalid="ignore"):
        point = prof.means[:, idx] / prof.means[:, [loss]]
        reps = prof.replicates[..., idx] / prof.replicates[..., [loss]]
    return present, np.where(np.isfinite(point), point, np.nan), np.where(np.isfinite(reps), reps, np.nan)


def role_ratios(run: Run, roles: Sequence[str] = DEFAULT_ROLES, point: str = "out", n_resamples: int = 2000,
                confidence: float = 0.95, seed: int | None = 0) -> pd.DataFrame:
    """Per layer, each role's mean gradient norm over the pooled loss-position mean, with CIs.

    Columns: ``layer``, ``site``, ``role``, ``reference`` (always ``"loss"``), ``ratio``,
    ``ci_low``, ``ci_high``, ``role_mean``, ``loss_mean``, ``n_positions``, ``n_sequences``.
    Roles absent from the run are left out; ``ratio`` is NaN where the loss mean is zero.
    """
    prof = _profile(run, point, n_resamples, seed)
    return _ratio_frame(prof, roles, confidence)


def _ratio_frame(prof: _Profile, roles: Sequence[str], confidence: float) -> pd.DataFrame:
    """Tidy ratio table from a profile (see :func:`role_ratios`)."""
    present, point, reps = _ratio_replicates(prof, roles)
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
    return pd.DataFrame(rows, columns=["layer", "site", "role", "reference", "ratio", "ci_low", "ci_high",
                                       "role_mean", "loss_mean", "n_positions", "n_sequences"])


def context_ratio(run: Run, point: str = "out", n_resamples: int = 2000, confidence: float = 0.95,
                  seed: int | None = 0) -> pd.DataFrame:
    """Context / loss-position gradient-norm ratio per layer (the :func:`role_ratios` columns)."""
    return role_ratios(run, ("context",), point, n_resamples, confidence, seed)


def sequence_means(run: Run, roles: Sequence[str] = DEFAULT_ROLES, point: str = "out") -> pd.DataFrame:
    """Per-sequence mean gradient norm of each role (the unit of the rank tests).

    Columns: ``sequence_index``, ``layer``, ``site``, ``role``, ``n_positions``, ``grad_norm_mean``.
    Sequences without positions of a role have no row for it.
    """
    frame = run.sequences[(run.sequences["point"].astype(str) == point) & run.sequences["role"].isin(list(roles))]
    grouped = frame.groupby(["sequence_index", "layer", "site", "role"], as_index=False, observed=True)[
        ["n_positions", "grad_norm_sum"]].sum()
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
    if out.empty:
        return out
    out["p_holm"] = holm(out["p_value"].to_numpy())
    out["significant"] = out["p_holm"] < alpha
    cols = ["layer", "site", "role", "against", "n_role", "n_against", "median_role", "median_against",
            "u_statistic", "p_value", "p_holm", "rank_biserial", "significant"]
    return out[cols].sort_values("layer").reset_index(drop=True)


def mann_whitney(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Two-sided Mann-Whitney U: (U of ``x``, p). NaN for an empty sample; p = 1 when all values tie."""
    if x.size == 0 or y.size == 0:
        return math.nan, math.nan
    if np.ptp(np.concatenate([x, y])) == 0:
        return x.size * y.size / 2.0, 1.0
    res = stats.mannwhitneyu(x, y, alternative="two-sided")
    return float(res.statistic), float(res.pvalue)


# ----------------------------------------------------------------------------------------------
# Sublayer metrics
# ----------------------------------------------------------------------------------------------

def _sublayer_key(name: str) -> int:
    """Sort key of a sublayer name (standard order, unknown names last)."""
    return SUBLAYER_ORDER.index(name) if name in SUBLAYER_ORDER else len(SUBLAYER_ORDER)


def sublayer_shares(run: Run, roles: Sequence[str] | None = None, param: str | None = "weight") -> pd.DataFrame:
    """Per layer, sublayer and role: share of the weight-gradient signal and training coverage.

    ``share``: the role's fraction of the summed per-position magnitudes of the parameter's
    gradient (0 where the role has no row). ``coverage``: fraction of the role's positions whose
    contribution is non-zero. Adds the pooled ``loss`` role (shares summed, coverage pooled by
    positions). ``param=None`` keeps both weight and bias. Columns: ``layer``, ``sublayer``,
    ``param``, ``role``, ``share``, ``coverage``, ``n_positions``, ``n_nonzero``, ``magnitude_sum``.
    """
    table = run.sublayers if param is None else run.sublayers[run.sublayers["param"] == param]
    keys = ["layer", "sublayer", "param"]
    base = table[keys + ["role", "share", "n_positions", "n_nonzero", "magnitude_sum"]]
    loss = base[base["role"].isin(LOSS_ROLES)].groupby(keys, as_index=False)[
        ["share", "n_positions", "n_nonzero", "magnitude_sum"]].sum()
    loss["role"] = LOSS
    out = pd.concat([base, loss], ignore_index=True)
    wanted = list(dict.fromkeys([*(roles if roles is not None else ALL_ROLES), LOSS]))
    out = _complete_roles(out, keys, wanted if roles is not None else None)
    with np.errstate(divide="ignore", invalid="ignore"):
        out["coverage"] = np.where(out["n_positions"] > 0, out["n_nonzero"] / out["n_positions"], np.nan)
    out["_s"] = out["sublayer"].map(_sublayer_key)
    out["_r"] = out["role"].map(lambda r: wanted.index(r) if r in wanted else len(wanted))
    out = out.sort_values(["layer", "_s", "param", "_r"]).drop(columns=["_s", "_r"])
    return out[keys[:2] + ["param", "role", "share", "coverage", "n_positions", "n_nonzero", "magnitude_sum"]
               ].reset_index(drop=True)


def _complete_roles(frame: pd.DataFrame, keys: list[str], roles: list[str] | None) -> pd.DataFrame:
    """Keep ``roles`` (all if None) and add zero rows for roles missing in a (layer, sublayer, param)."""
    if roles is None:
        return frame
    groups = frame[keys].drop_duplicates()
    full = groups.merge(pd.DataFrame({"role": roles}), how="cross")
    out = full.merge(frame, on=[*keys, "role"], how="left")
    return out.fillna({"share": 0.0, "n_positions": 0, "n_nonzero": 0, "magnitude_sum": 0.0})


def context_share(run: Run, param: str | None = "weight") -> pd.DataFrame:
    """Context share and coverage per layer and sublayer (the :func:`sublayer_shares` columns)."""
    return sublayer_shares(run, ("context",), param).query("role == 'context'").reset_index(drop=True)


def last_block_deficit(run: Run, role: str = "context", param: str = "weight") -> pd.DataFrame:
    """For each sublayer of the last block: the role's share vs the mean over the earlier blocks.

    Columns: ``layer`` (the last block's layer), ``sublayer``, ``param``, ``role``, ``share``,
    ``earlier_mean``, ``earlier_min``, ``earlier_max`` (over blocks 1..L-1), ``ratio_to_earlier``
    (``share / earlier_mean``; 0 means the sublayer gets nothing from the role in the last block),
    ``coverage``, ``earlier_coverage_mean``, ``exact_zero`` (share exactly 0), ``n_earlier``.
    """
    shares = sublayer_shares(run, (role,), param)
    shares = shares[shares["role"] == role]
    last = int(shares["layer"].max())
    rows = []
    for sub, group in shares.groupby("sublayer", sort=False):
        cur = group[group["layer"] == last]
        if cur.empty:
            continue
        early = group[group["layer"] < last]
        share = float(cur["share"].iloc[0])
        mean = float(early["share"].mean()) if len(early) else math.nan
        rows.append({"layer": last, "sublayer": sub, "param": param, "role": role, "share": share,
                     "earlier_mean": mean, "earlier_min": float(early["share"].min()) if len(early) else math.nan,
                     "earlier_max": float(early["share"].max()) if len(early) else math.nan,
                     "ratio_to_earlier": share / mean if mean > 0 else math.nan,
                     "coverage": float(cur["coverage"].iloc[0]),
                     "earlier_coverage_mean": float(early["coverage"].mean()) if len(early) else math.nan,
                     "exact_zero": share == 0.0, "n_earlier": len(early)})
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    out["_s"] = out["sublayer"].map(_sublayer_key)
    return out.sort_values("_s").drop(columns="_s").reset_index(drop=True)


def channel_quantiles(run: Run, roles: Sequence[str] = DEFAULT_ROLES, point: str = "out") -> pd.DataFrame:
    """Per layer and role, the gradient-norm distribution summary from channels.csv.

    Columns: ``layer``, ``site``, ``role``, ``n_positions``, ``mean``, ``median``, ``q05``,
    ``q95``, ``zero_fraction``.
    """
    ch = run.channels[(run.channels["point"].astype(str) == point) & run.channels["role"].isin(list(roles))]
    out = ch.rename(columns={"grad_norm_mean": "mean", "grad_norm_median": "median", "grad_norm_q05": "q05",
                             "grad_norm_q95": "q95", "grad_norm_zero_fraction": "zero_fraction"})
    out = out[["layer", "site", "role", "n_positions", "mean", "median", "q05", "q95", "zero_fraction"]]
    out = out.assign(_r=out["role"].map(list(roles).index)).sort_values(["layer", "_r"]).drop(columns="_r")
    return out.reset_index(drop=True)


# ----------------------------------------------------------------------------------------------
# Comparison across runs
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Comparison:
    """Metrics of several runs side by side; differences are ``run - baseline``.

    - ``profiles``: :func:`role_profile` columns plus ``label``, ``relative_depth``.
    - ``ratios``: :func:`role_ratios` columns plus ``label``, ``relative_depth``.
    - ``ratio_differences``: ``label``, ``baseline``, ``layer``, ``role``, ``difference``,
      ``ci_low``, ``ci_high`` (bootstrap CI of the difference), ``paired`` (True when both runs
      measured the same sequences and were resampled together).
    - ``shares``: :func:`context_share` columns plus ``label``, ``share_difference``,
      ``coverage_difference`` (no CI: sublayer tables have no per-sequence rows).
    - ``last_block``: :func:`last_block_deficit` columns plus ``label``, ``share_difference``.
    - ``tests``: :func:`layer_tests` columns plus ``label``.
    """

    labels: list[str]
    baseline: str
    profiles: pd.DataFrame
    ratios: pd.DataFrame
    ratio_differences: pd.DataFrame
    shares: pd.DataFrame
    last_block: pd.DataFrame
    tests: pd.DataFrame


def check_same_tokenizer(runs: Sequence[Run], labels: Sequence[str] | None = None) -> None:
    """Raise :class:`RunError` unless all runs share one tokenizer hash."""
    labels = list(labels) if labels is not None else [r.label for r in runs]
    hashes = {label: run.tokenizer_hash for label, run in zip(labels, runs)}
    if None in hashes.values() or len(set(hashes.values())) > 1:
        listed = "; ".join(f"{k}: {v}" for k, v in hashes.items())
        raise RunError(
            f"The runs use different tokenizers ({listed}). Per-token gradient statistics are only comparable "
            "when every run splits the text into the same tokens; compare runs of one tokenizer (e.g. "
            "checkpoints, losses or masking schemes of the same model family), or report them separately.")


def compare_runs(runs: Sequence[Run], labels: Sequence[str] | None = None, baseline: int = 0,
                 roles: Sequence[str] = DEFAULT_ROLES, point: str = "out", n_resamples: int = 2000,
                 confidence: float = 0.95, seed: int | None = 0, param: str = "weight") -> Comparison:
    """Compare runs (checkpoints, losses, masking schemes) of one tokenizer; see :class:`Comparison`."""
    labels = _check_labels(runs, labels)
    if not -len(runs) <= baseline < len(runs):
        raise RunError(f"baseline index {baseline} is out of range for {len(runs)} runs.")
    baseline = baseline % len(runs)
    check_same_tokenizer(runs, labels)
    base_label = labels[baseline]
    seqsets = [frozenset(r.sequences["sequence_index"].unique()) for r in runs]
    profs = []
    for i, run in enumerate(runs):
        paired = seqsets[i] == seqsets[baseline]
        profs.append(_profile(run, point, n_resamples, seed if paired else _offset_seed(seed, i)))
    frames = {"profiles": [], "ratios": [], "shares": [], "last_block": [], "tests": []}
    for run, label, prof in zip(runs, labels, profs):
        depth = max(run.num_layers, 1)
        prof_frame = _profile_frame(prof, run, point, confidence)
        frames["profiles"].append(prof_frame.assign(label=label, relative_depth=prof_frame["layer"] / depth))
        rat = _ratio_frame(prof, roles, confidence)
        frames["ratios"].append(rat.assign(label=label, relative_depth=rat["layer"] / depth))
        frames["shares"].append(context_share(run, param).assign(label=label))
        frames["last_block"].append(last_block_deficit(run, param=param).assign(label=label))
        frames["tests"].append(layer_tests(run, point=point).assign(label=label))
    diffs = pd.concat([_ratio_difference(profs[i], profs[baseline], roles, confidence).assign(
        label=labels[i], baseline=base_label, paired=seqsets[i] == seqsets[baseline])
        for i in range(len(runs)) if i != baseline] or [pd.DataFrame()], ignore_index=True)
    shares = _with_difference(pd.concat(frames["shares"], ignore_index=True), ["layer", "sublayer", "param"],
                              base_label, ("share", "coverage"))
    last = _with_difference(pd.concat(frames["last_block"], ignore_index=True), ["sublayer", "param"],
                            base_label, ("share",))
    return Comparison(labels=labels, baseline=base_label, profiles=_label_first(frames["profiles"]),
                      ratios=_label_first(frames["ratios"]), ratio_differences=_diff_columns(diffs),
                      shares=shares, last_block=last, tests=_label_first(frames["tests"]))


def _check_labels(runs: Sequence[Run], labels: Sequence[str] | None) -> list[str]:
    """Default labels to run labels; require one unique label per run and at least one run."""
    if not runs:
        raise RunError("No runs to compare: pass at least one run directory.")
    labels = [r.label for r in runs] if labels is None else [str(x) for x in labels]
    if len(labels) != len(runs):
        raise RunError(f"Got {len(runs)} runs but {len(labels)} labels; pass one label per run.")
    if len(set(labels)) != len(labels):
        raise RunError(f"Labels must be unique, got {', '.join(labels)}; pass distinct labels.")
    return labels


def _offset_seed(seed: int | None, i: int) -> int | None:
    """An independent seed for run i (None stays None)."""
    return None if seed is None else int(seed) + 7919 * (i + 1)


def _profile_frame(prof: _Profile, run: Run, point: str, confidence: float) -> pd.DataFrame:
    """Tidy :func:`role_profile` table from an already bootstrapped profile."""
    low, high = percentile_interval(prof.replicates, confidence)
    rows = [{"layer": int(layer), "site": prof.cube.sites[li], "role": role,
             "n_positions": int(prof.n_positions[li, ri]), "n_sequences": int(prof.n_sequences[li, ri]),
             "grad_norm_mean": prof.means[li, ri], "ci_low": low[li, ri], "ci_high": high[li, ri]}
            for li, layer in enumerate(prof.cube.layers) for ri, role in enumerate(prof.roles)
            if prof.n_positions[li, ri] > 0]
    out = pd.DataFrame(rows)
    zf = run.channels[run.channels["point"] == point].set_index(["layer", "role"])["grad_norm_zero_fraction"]
    out["zero_fraction"] = [zf.get((layer, role), np.nan) for layer, role in zip(out["layer"], out["role"])]
    return out


def _ratio_difference(prof: _Profile, base: _Profile, roles: Sequence[str], confidence: float) -> pd.DataFrame:
    """Per layer and role: ratio(run) - ratio(baseline) with a bootstrap CI of the difference."""
    present, point, reps = _ratio_replicates(prof, roles)
    bpresent, bpoint, breps = _ratio_replicates(base, roles)
    rows = []
    for role in (r for r in present if r in bpresent):
        ri, bi = present.index(role), bpresent.index(role)
        for li, layer in enumerate(prof.cube.layers):
            bl = np.flatnonzero(base.cube.layers == layer)
            if bl.size == 0:
                continue
            diff = point[li, ri] - bpoint[bl[0], bi]
            low, high = percentile_interval(reps[:, li, ri] - breps[:, bl[0], bi], confidence)
            rows.append({"layer": int(layer), "role": role, "difference": diff, "ci_low": float(low),
                         "ci_high": float(high)})
    return pd.DataFrame(rows, columns=["layer", "role", "difference", "ci_low", "ci_high"])


def _with_difference(frame: pd.DataFrame, keys: list[str], baseline: str, values: Sequence[str]) -> pd.DataFrame:
    """Add ``<value>_difference`` = value - baseline's value at the same keys."""
    if frame.empty:
        return frame
    base = frame[frame["label"] == baseline].set_index(keys)[list(values)]
    base.columns = [f"{v}_baseline" for v in values]
    out = frame.join(base, on=keys)
    for v in values:
        out[f"{v}_difference"] = out[v] - out[f"{v}_baseline"]
    return _label_first([out.drop(columns=[f"{v}_baseline" for v in values])])


def _label_first(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Concatenate and move ``label`` to the first column."""
    out = pd.concat(frames, ignore_index=True)
    if "label" in out.columns:
        out = out[["label", *[c for c in out.columns if c != "label"]]]
    return out


def _diff_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """Order the ratio-difference columns."""
    cols = ["label", "baseline", "layer", "role", "difference", "ci_low", "ci_high", "paired"]
    if frame.empty:
        return pd.DataFrame(columns=cols)
    return frame[cols].reset_index(drop=True)
