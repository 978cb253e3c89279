"""Comparison of runs of one tokenizer (checkpoints, losses, masking schemes): metrics side by side, differences.

Differences are ``run - baseline``; ratio differences get a bootstrap CI, paired (same seed) when
both runs measured the same sequences.

Runs of different depth are compared at the **same relative depth** (layer / blocks), never by raw
layer index: a 6-block run's layer k is matched with a 12-block run's layer 2k
(:func:`matched_layers`), so the row after both last blocks compares two exact zeros under the MLM
loss. Depths that share no finer grid (5 and 7 blocks) are matched only at the embeddings (0) and
after the last block (1); every difference row names both layers and their relative depth.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from math import gcd

import numpy as np
import pandas as pd

from gradflow.analysis.profiles import (
    RoleProfile,
    bootstrap_profile,
    layer_tests,
    profile_frame,
    ratio_frame,
    ratio_replicates,
)
from gradflow.analysis.run_data import Run
from gradflow.analysis.stats import percentile_interval
from gradflow.analysis.sublayers import SHARE_KEYS, context_share, last_block_deficit
from gradflow.errors import RunError
from gradflow.schema import ANALYSIS_COLUMNS, COMPARISON_TABLES, REPORTED_ROLES, conform

DIFFERENCE_COLUMNS: list[str] = [c for c in ANALYSIS_COLUMNS["ratio_differences"]
                                  if c not in ("label", "baseline", "paired")]
"""Columns of one run's ratio differences (layer, role, difference, CI)."""


@dataclass(frozen=True)
class Comparison:
    """Metrics of several runs side by side; differences are ``run - baseline``.

    Each table has the columns of ``COMPARISON_TABLES`` in :mod:`gradflow.schema` (``tests``: its
    ``layer_tests``), which ``gradflow compare`` writes as ``tables/<name>.csv``:

    - ``profiles``: :func:`role_profile` columns plus ``label``, ``relative_depth``.
    - ``ratios``: :func:`role_ratios` columns plus ``label``, ``relative_depth``.
    - ``ratio_differences``: ``label``, ``baseline``, ``layer`` (the run's), ``baseline_layer``
      (the baseline's layer at the same relative depth), ``relative_depth``, ``role``,
      ``difference``, ``ci_low``, ``ci_high`` (bootstrap CI of the difference), ``paired`` (True
      when both runs measured the same sequences and were resampled together). Only layers with a
      baseline layer at the same relative depth have a row (:func:`matched_layers`).
    - ``shares``: :func:`context_share` columns plus ``label``, ``baseline_layer`` (the baseline's
      block at the same relative depth; NaN where none), ``share_difference``,
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
        models = " ".join(str(run.meta.get("model") or label) for label, run in zip(labels, runs))
        raise RunError(
            f"The runs use different tokenizers ({listed}). Paired per-token comparisons need every run to split "
            "the text into the same tokens, so compare takes runs of one tokenizer (checkpoints, losses or masking "
            "schemes of one model family). To put models with different tokenizers side by side, unpaired, on "
            f"normalised depth (layer / blocks), run: gradflow atlas {models} --out atlas --no-probes "
            "(it records each model and draws every measure of the atlas per model); or report each run "
            "separately with gradflow report.")


def compare_runs(runs: Sequence[Run], labels: Sequence[str] | None = None, baseline: int = 0,
                 roles: Sequence[str] = REPORTED_ROLES, point: str = "out", n_resamples: int = 2000,
                 confidence: float = 0.95, seed: int | None = 0, param: str = "weight") -> Comparison:
    """Compare runs (checkpoints, losses, masking schemes) of one tokenizer; see :class:`Comparison`."""
    labels = _check_labels(runs, labels)
    if not -len(runs) <= baseline < len(runs):
        raise RunError(f"baseline index {baseline} is out of range for {len(runs)} runs.")
    baseline = baseline % len(runs)
    check_same_tokenizer(runs, labels)
    base_label = labels[baseline]
    seqsets = [frozenset(r.sequences["sequence_index"].unique()) for r in runs]
    paired = [seqs == seqsets[baseline] for seqs in seqsets]
    profs = [bootstrap_profile(run, point, n_resamples, seed if paired[i] else _offset_seed(seed, i))
             for i, run in enumerate(runs)]
    frames = _run_frames(runs, labels, profs, roles, point, confidence, param)
    depths = [max(run.num_layers, 1) for run in runs]
    diffs = pd.concat([_ratio_difference(profs[i], profs[baseline], roles, confidence,
                                         dict(matched_layers(depths[i], depths[baseline])), depths[i]).assign(
        label=labels[i], baseline=base_label, paired=paired[i])
        for i in range(len(runs)) if i != baseline] or [pd.DataFrame()], ignore_index=True)
    shares = _with_difference(pd.concat(frames["shares"], ignore_index=True), SHARE_KEYS,
                              base_label, ("share", "coverage"),
                              {lab: dict(matched_layers(depths[i], depths[baseline])) for i, lab in enumerate(labels)})
    last = _with_difference(pd.concat(frames["last_block"], ignore_index=True), ["sublayer", "param"],
                            base_label, ("share",))
    return Comparison(labels=labels, baseline=base_label,
                      profiles=_table(_label_first(frames["profiles"]), "profiles"),
                      ratios=_table(_label_first(frames["ratios"]), "ratios"),
                      ratio_differences=_table(diffs, "ratio_differences").reset_index(drop=True),
                      shares=_table(shares, "shares"), last_block=_table(last, "last_block"),
                      tests=_table(_label_first(frames["tests"]), "layer_tests"))


def _run_frames(runs: Sequence[Run], labels: list[str], profs: list[RoleProfile], roles: Sequence[str], point: str,
                confidence: float, param: str) -> dict[str, list[pd.DataFrame]]:
    """Each run's profile, ratio, context-share, last-block and test tables, labelled (by table name)."""
    frames: dict[str, list[pd.DataFrame]] = {"profiles": [], "ratios": [], "shares": [], "last_block": [], "tests": []}
    for run, label, prof in zip(runs, labels, profs):
        depth = max(run.num_layers, 1)
        prof_frame = profile_frame(prof, run, point, confidence)
        frames["profiles"].append(prof_frame.assign(label=label, relative_depth=prof_frame["layer"] / depth))
        rat = ratio_frame(prof, roles, confidence)
        frames["ratios"].append(rat.assign(label=label, relative_depth=rat["layer"] / depth))
        frames["shares"].append(context_share(run, param).assign(label=label))
        frames["last_block"].append(last_block_deficit(run, param=param).assign(label=label))
        frames["tests"].append(layer_tests(run, point=point).assign(label=label))
    return frames


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


def shared_depth_fractions(depths: Mapping[str, int] | Iterable[int]) -> list[Fraction]:
    """The relative depths (layer / blocks) at which every model has a layer: ``k / g`` for k = 0..g, ``g`` the
    gcd of the block counts (``depths``: block counts, or label -> block count); 6 and 12 blocks share sixths."""
    common = 0
    for n in depths.values() if isinstance(depths, Mapping) else depths:
        common = gcd(common, int(n))
    return [Fraction(k, common) for k in range(common + 1)] if common else []


def matched_layers(depth: int, baseline_depth: int) -> list[tuple[int, int]]:
    """(layer, baseline layer) pairs at the same relative depth, ``layer / depth == baseline_layer /
    baseline_depth``, from 0 (embeddings) to the last blocks: 6 vs 12 blocks gives ``(k, 2k)`` for k = 0..6;
    5 vs 7 only ``(0, 0)`` and ``(5, 7)``; equal depths every layer with itself. Depths are block counts (>= 1)."""
    if depth < 1 or baseline_depth < 1:
        raise RunError(f"Depths must be at least one block, got {depth} and {baseline_depth}.")
    return [(int(f * depth), int(f * baseline_depth)) for f in shared_depth_fractions((depth, baseline_depth))]


def _ratio_difference(prof: RoleProfile, base: RoleProfile, roles: Sequence[str], confidence: float,
                      matched: dict[int, int], depth: int) -> pd.DataFrame:
    """Per matched layer and role: ratio(run) - ratio(baseline at the same relative depth), with a bootstrap CI
    of the difference. ``matched``: the run's layer -> the baseline's (:func:`matched_layers`)."""
    present, point, reps = ratio_replicates(prof, roles)
    bpresent, bpoint, breps = ratio_replicates(base, roles)
    rows = []
    for role in (r for r in present if r in bpresent):
        ri, bi = present.index(role), bpresent.index(role)
        for li, layer in enumerate(prof.cube.layers):
            bl = np.flatnonzero(base.cube.layers == matched.get(int(layer), -1))
            if bl.size == 0:
                continue
            diff = point[li, ri] - bpoint[bl[0], bi]
            low, high = percentile_interval(reps[:, li, ri] - breps[:, bl[0], bi], confidence)
            rows.append({"layer": int(layer), "baseline_layer": int(base.cube.layers[bl[0]]),
                         "relative_depth": int(layer) / depth, "role": role, "difference": diff,
                         "ci_low": float(low), "ci_high": float(high)})
    return pd.DataFrame(rows, columns=DIFFERENCE_COLUMNS)


def _with_difference(frame: pd.DataFrame, keys: list[str], baseline: str, values: Sequence[str],
                     matched: dict[str, dict[int, int]] | None = None) -> pd.DataFrame:
    """Add ``<value>_difference`` = value - baseline's value at the same keys; with ``matched`` (label -> the
    run's layer -> the baseline's layer at the same relative depth) also ``baseline_layer``, and ``layer`` is
    matched through it (NaN where the baseline has no layer at that depth)."""
    if frame.empty:
        return frame
    base = frame[frame["label"] == baseline].set_index(keys)[list(values)]
    base.columns = [f"{v}_baseline" for v in values]
    if matched is None:
        out = frame.join(base, on=keys)
    else:
        layers = [matched.get(lab, {}).get(int(layer)) for lab, layer in zip(frame["label"], frame["layer"])]
        out = frame.assign(baseline_layer=pd.array(layers, dtype="Int64"))
        base.index = base.index.set_names(["baseline_layer" if k == "layer" else k for k in keys])
        out = out.join(base, on=["baseline_layer" if k == "layer" else k for k in keys])
    for v in values:
        out[f"{v}_difference"] = out[v] - out[f"{v}_baseline"]
    return _label_first([out.drop(columns=[f"{v}_baseline" for v in values])])


def _label_first(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Concatenate and move ``label`` to the first column."""
    out = pd.concat(frames, ignore_index=True)
    if "label" in out.columns:
        out = out[["label", *[c for c in out.columns if c != "label"]]]
    return out


def _table(frame: pd.DataFrame, name: str) -> pd.DataFrame:
    """``frame`` with the columns of the comparison table ``name`` (an empty one gets them)."""
    return conform(frame, COMPARISON_TABLES[name], name)


__all__ = ["Comparison", "check_same_tokenizer", "compare_runs", "matched_layers", "shared_depth_fractions"]
