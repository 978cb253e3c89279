"""The atlas table: per-model metrics of ``gradflow atlas`` directories on one normalised depth axis.

One row per (model, metric, depth), columns :data:`gradflow.schema.ATLAS_COLUMNS`, metric kinds
:data:`gradflow.schema.ATLAS_METRICS`. ``depth_fraction`` = layer / n_layers: 0 is the
embeddings output, ``i / L`` block i's output (sublayer metrics of block i sit at ``i / L`` too), 1 the
last block; the check's whole-model numbers describe the last block and sit at 1.

- ``context_loss_ratio``: :func:`gradflow.analysis.profiles.context_ratio` of the MLM record run
  (point ``out``), sequence-bootstrap CI;
- ``context_share:<sublayer>``: :func:`gradflow.analysis.sublayers.context_share` (weight; no CI);
- ``logit_lens_top1_context``: the diagnostics' ``logit_lens.csv`` at context positions (no CI);
- ``probe_accuracy:<task>``: ``probes.csv`` (unmasked regime, block outputs), sentence-bootstrap CI;
- ``pressure:<sublayer>``: :func:`gradflow.analysis.pressure.context_pressure` of the all-positions
  run (weight), where one was recorded;
- ``shared_context_share:<sublayer>`` (models whose last block's module is also applied at earlier
  depths, ALBERT's shared layer; meta.json's ``weight_sharing``): :func:`shared_context_shares`, the
  shared weight's context share over all its applications, at 1 next to the last application's exact 0;
- ``skippable_flop_share`` and ``theory_disagreements``: from ``check.json``.

The bootstraps are seeded, so the same directories always give the same table.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from gradflow.analysis.pressure import context_pressure
from gradflow.analysis.profiles import context_ratio
from gradflow.analysis.run_data import load_run
from gradflow.analysis.sublayers import context_share
from gradflow.errors import UsageError
from gradflow.schema import (
    ATLAS_COLUMNS,
    ATLAS_DONE_FILE,
    ATLAS_DTYPES,
    ATLAS_METRICS,
    ATLAS_STEP_DIRS,
    CHECK_FILE,
    PROBES_FILE,
    WEIGHT_SHARING_META_KEY,
    sublayer_rank,
)
from gradflow.site_names import point_of

CONTEXT = "context"


def find_model_dirs(atlas_dirs: Sequence[str | Path]) -> tuple[list[tuple[Path, dict]], list[Path]]:
    """(finished model directories with their ``atlas_done.json``, unfinished ones) under ``atlas_dirs``.

    Finished models are ordered by their place in the atlas's model list, then by name; a model found
    finished in two different directories raises :class:`UsageError`.
    """
    done: dict[str, tuple[Path, dict]] = {}
    unfinished: list[Path] = []
    seen: set[Path] = set()
    for root in atlas_dirs:
        root = Path(root)
        if not root.is_dir():
            raise UsageError(f"{root} is not a directory; --merge takes the --out directories of gradflow atlas runs")
        if root.resolve() in seen:
            continue
        seen.add(root.resolve())
        for sub in sorted(p for p in root.iterdir() if p.is_dir()):
            marker = sub / ATLAS_DONE_FILE
            if marker.is_file():
                info = json.loads(marker.read_text(encoding="utf-8"))
                if info["model"] in done:
                    raise UsageError(f"model {info['model']!r} is finished in both {done[info['model']][0]} and "
                                     f"{sub}; merge each model once")
                done[info["model"]] = (sub, info)
            elif any(sub.glob("atlas_*.json")):
                unfinished.append(sub)
    ordered = sorted(done.values(), key=lambda d: (int(d[1].get("index", 0)), str(d[1]["model"])))
    return ordered, unfinished


def model_rows(path: str | Path, info: dict | None = None, n_resamples: int = 2000, seed: int = 0) -> pd.DataFrame:
    """The atlas rows of one finished model directory (``info``: its ``atlas_done.json``)."""
    path = Path(path)
    info = info if info is not None else json.loads((path / ATLAS_DONE_FILE).read_text(encoding="utf-8"))
    n = int(info["n_layers"])
    rows: list[dict] = []

    def add(metric: str, layers, values, low=None, high=None) -> None:
        values = np.asarray(values, dtype=np.float64)
        for k, (layer, value) in enumerate(zip(layers, values)):
            rows.append({"depth_fraction": int(layer) / n, "metric": metric, "value": value,
                         "ci_low": np.nan if low is None else float(low[k]),
                         "ci_high": np.nan if high is None else float(high[k])})

    run = load_run(path / ATLAS_STEP_DIRS["record"])
    ratio = context_ratio(run, n_resamples=n_resamples, seed=seed)
    add("context_loss_ratio", ratio["layer"], ratio["ratio"], ratio["ci_low"].to_numpy(), ratio["ci_high"].to_numpy())
    shares = context_share(run)
    for sub, group in shares.groupby("sublayer", sort=False):
        add(f"context_share:{sub}", group["layer"], group["share"])
    for row in shared_context_shares(run.sublayers, last_block_sharing(run.meta, n)).itertuples():
        add(f"shared_context_share:{row.sublayer}", [n], [row.total_context_share])
    lens_file = path / ATLAS_STEP_DIRS["diagnostics"] / "logit_lens.csv"
    if lens_file.is_file():
        lens = pd.read_csv(lens_file)
        lens = lens[lens["role"] == CONTEXT]
        add("logit_lens_top1_context", lens["layer"], lens["top1_original"])
    probes_file = path / ATLAS_STEP_DIRS["probes"] / PROBES_FILE
    if probes_file.is_file():
        probes = pd.read_csv(probes_file)
        probes = probes[(probes["regime"] == "unmasked") & probes["site"].map(lambda s: point_of(s) == "out")]
        for task, group in probes.groupby("task", sort=True):
            add(f"probe_accuracy:{task}", group["layer"], group["accuracy"], group["ci_low"].to_numpy(),
                group["ci_high"].to_numpy())
    if (path / ATLAS_STEP_DIRS["pressure"]).is_dir():
        pressure = context_pressure(load_run(path / ATLAS_STEP_DIRS["pressure"]), n_resamples=n_resamples, seed=seed)
        for sub, group in pressure.groupby("sublayer", sort=False):
            add(f"pressure:{sub}", group["layer"], group["pressure"], group["ci_low"].to_numpy(),
                group["ci_high"].to_numpy())
    check = json.loads((path / ATLAS_STEP_DIRS["check"] / CHECK_FILE).read_text(encoding="utf-8"))
    add("skippable_flop_share", [n], [check["skippable_share"]])
    add("theory_disagreements", [n], [len(check["theory"]["disagreements"])])
    frame = pd.DataFrame(rows)
    frame.insert(0, "n_layers", n)
    frame.insert(0, "family", str(info["family"]))
    frame.insert(0, "model", str(info["model"]))
    return _ordered(frame)


def last_block_sharing(meta: Mapping, num_layers: int) -> list[int]:
    """The layers (1..L) applying the last block's module when it is applied at several depths (a record run's
    meta.json ``weight_sharing``, ALBERT's shared layer), else []."""
    for group in (meta.get(WEIGHT_SHARING_META_KEY) or {}).get("shared_layers", []):
        if num_layers in group:
            return [int(layer) for layer in group]
    return []


def shared_context_shares(sublayers: pd.DataFrame, layers: Sequence[int], param: str | None = "weight") -> pd.DataFrame:
    """Per (sublayer, param) of a block module applied at ``layers``: the shared weight's context share.

    ``sublayers``: rows per (layer, sublayer, param, role) with ``magnitude_sum`` (``sublayers.csv``, or the
    recorder's ``sublayer_frame``). ``total_context_share`` = context's summed per-position magnitudes over
    every application, over all roles' (the measure of ``sublayers.csv``'s ``share``, pooled over the
    layers). ``last_share``: the same at the last of ``layers`` alone (exactly 0 where the last block cuts
    context off). Empty (same columns) when ``layers`` is empty.
    """
    rows = sublayers[sublayers["layer"].isin(list(layers))]
    if param is not None:
        rows = rows[rows["param"] == param]
    keys = ["sublayer", "param"]
    frame = pd.DataFrame({"total": rows.groupby(keys, sort=False)["magnitude_sum"].sum()})
    if frame.empty:
        return pd.DataFrame(columns=[*keys, "total_context_share", "last_share"])

    def context_over(part: pd.DataFrame) -> pd.Series:
        context = part[part["role"] == CONTEXT].groupby(keys, sort=False)["magnitude_sum"].sum()
        total = part.groupby(keys, sort=False)["magnitude_sum"].sum()
        share = (context.reindex(total.index, fill_value=0.0) / total.where(total > 0)).fillna(0.0)
        return share.reindex(frame.index, fill_value=0.0)

    frame["total_context_share"] = context_over(rows)
    frame["last_share"] = context_over(rows[rows["layer"] == max(layers)])
    frame = frame.drop(columns="total").reset_index()
    order = frame["sublayer"].map(sublayer_rank)
    return frame.assign(_k=order).sort_values(["_k", "param"], kind="stable").drop(columns="_k").reset_index(drop=True)


def _metric_key(metric: str) -> tuple[int, int, str]:
    kind, _, detail = metric.partition(":")
    kinds = list(ATLAS_METRICS)
    return (kinds.index(kind) if kind in kinds else len(kinds), sublayer_rank(detail) if detail else -1, detail)


def _ordered(frame: pd.DataFrame) -> pd.DataFrame:
    keys = frame["metric"].map(_metric_key)
    frame = frame.assign(_k=keys).sort_values(["_k", "depth_fraction"], kind="stable").drop(columns="_k")
    return frame[list(ATLAS_COLUMNS)].astype({c: t for c, t in ATLAS_DTYPES.items() if t != "str"})\
        .reset_index(drop=True)


def atlas_table(atlas_dirs: Sequence[str | Path], n_resamples: int = 2000, seed: int = 0) -> pd.DataFrame:
    """``atlas.csv`` of every finished model under ``atlas_dirs`` (models in their list order)."""
    done, _ = find_model_dirs(atlas_dirs)
    if not done:
        raise UsageError(f"no finished model (no {ATLAS_DONE_FILE}) under {', '.join(map(str, atlas_dirs))}; run "
                         "gradflow atlas MODEL... --out DIR first")
    frames = [model_rows(path, info, n_resamples, seed) for path, info in done]
    return pd.concat(frames, ignore_index=True)[list(ATLAS_COLUMNS)]


__all__ = ["atlas_table", "find_model_dirs", "last_block_sharing", "model_rows", "shared_context_shares"]
