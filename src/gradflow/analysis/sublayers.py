"""Sublayer metrics of one run: each role's share of the weight-gradient signal, coverage, the last-block deficit.

Shares come from ``sublayers.csv``: a role's fraction of the summed per-position magnitudes
``||g_t|| * ||x_t||`` of one parameter's gradient. Rows are in the standard sublayer order of
:mod:`gradflow.schema`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from gradflow.analysis.run_data import Run
from gradflow.roles import LOSS_ROLES, ROLE_ORDER
from gradflow.schema import ANALYSIS_COLUMNS, LOSS, conform, role_rank, sublayer_rank

SHARE_COLUMNS: tuple[str, ...] = ANALYSIS_COLUMNS["sublayer_shares"]
SHARE_KEYS: list[str] = list(SHARE_COLUMNS[:3])
"""(layer, sublayer, param): one weight-gradient split."""
SHARE_SUMS: list[str] = [c for c in SHARE_COLUMNS if c not in (*SHARE_KEYS, "role", "coverage")]
"""Columns summed when roles are pooled (share, position counts, magnitude)."""


def sublayer_shares(run: Run, roles: Sequence[str] | None = None, param: str | None = "weight") -> pd.DataFrame:
    """Per layer, sublayer and role: share of the weight-gradient signal and training coverage.

    ``share``: the role's fraction of the summed per-position magnitudes of the parameter's
    gradient (0 where the role has no row). ``coverage``: fraction of the role's positions whose
    contribution is non-zero. Adds the pooled ``loss`` role (shares summed, coverage pooled by
    positions). ``param=None`` keeps both weight and bias. Columns: ``layer``, ``sublayer``,
    ``param``, ``role``, ``share``, ``coverage``, ``n_positions``, ``n_nonzero``, ``magnitude_sum``.
    """
    table = run.sublayers if param is None else run.sublayers[run.sublayers["param"] == param]
    base = table[[*SHARE_KEYS, "role", *SHARE_SUMS]]
    loss = base[base["role"].isin(LOSS_ROLES)].groupby(SHARE_KEYS, as_index=False)[SHARE_SUMS].sum()
    loss["role"] = LOSS
    out = pd.concat([base, loss], ignore_index=True)
    wanted = list(dict.fromkeys([*(roles if roles is not None else ROLE_ORDER), LOSS]))
    out = _complete_roles(out, SHARE_KEYS, wanted if roles is not None else None)
    with np.errstate(divide="ignore", invalid="ignore"):
        out["coverage"] = np.where(out["n_positions"] > 0, out["n_nonzero"] / out["n_positions"], np.nan)
    out["_s"] = out["sublayer"].map(sublayer_rank)
    out["_r"] = out["role"].map(lambda r: role_rank(r, wanted))
    out = out.sort_values(["layer", "_s", "param", "_r"]).drop(columns=["_s", "_r"])
    return out[list(SHARE_COLUMNS)].reset_index(drop=True)


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

    Columns (``ANALYSIS_COLUMNS["last_block"]`` of :mod:`gradflow.schema`, explained in its
    ``ANALYSIS_NOTES``): ``layer`` (the last block's layer), ``sublayer``, ``param``, ``role``, ``share``,
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
        if not cur.empty:
            rows.append({"layer": last, "sublayer": sub, "param": param, "role": role,
                         **_deficit(cur.iloc[0], group[group["layer"] < last])})
    out = conform(pd.DataFrame(rows), ANALYSIS_COLUMNS["last_block"], "last_block")
    out["_s"] = out["sublayer"].map(sublayer_rank)
    return out.sort_values("_s").drop(columns="_s").reset_index(drop=True)


def _deficit(last: pd.Series, early: pd.DataFrame) -> dict[str, float | bool | int]:
    """The last block's share and coverage against the earlier blocks' (NaN when there are none)."""
    share = float(last["share"])
    some = len(early) > 0
    mean = float(early["share"].mean()) if some else math.nan
    return {"share": share, "earlier_mean": mean, "earlier_min": float(early["share"].min()) if some else math.nan,
            "earlier_max": float(early["share"].max()) if some else math.nan,
            "ratio_to_earlier": share / mean if mean > 0 else math.nan, "coverage": float(last["coverage"]),
            "earlier_coverage_mean": float(early["coverage"].mean()) if some else math.nan,
            "exact_zero": share == 0.0, "n_earlier": len(early)}


__all__ = ["context_share", "last_block_deficit", "sublayer_shares"]
