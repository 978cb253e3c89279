"""A recorded run directory, read and validated against :mod:`gradflow.schema`.

A run directory holds ``channels.csv`` (per site and role), ``sublayers.csv`` (per layer,
sublayer, parameter and role), ``sequences.parquet`` (per sequence, site and role) and
``meta.json``. :func:`load_run` reads and validates them into a :class:`Run`; every error is a
:class:`gradflow.errors.RunError` that says what to do. The optional (and possibly large)
``sublayer_sequences.parquet`` is read on demand by :func:`read_sublayer_sequences`; the optional (small)
``mask_ratios.parquet`` of a masked-diffusion run is read and validated by :func:`load_run` into
:attr:`Run.mask_ratios` (None without it).

Conventions of the analysis modules (:mod:`.profiles`, :mod:`.sublayers`, :mod:`.compare`):

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
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from gradflow.errors import RunError
from gradflow.roles import ROLE_ORDER
from gradflow.schema import (
    CHANNELS_FILE,
    MASK_RATIO_DTYPES,
    MASK_RATIOS_FILE,
    META_FILE,
    POINTS,
    REQUIRED_META_KEYS,
    RUN_FILES,
    SEQUENCES_FILE,
    SUBLAYER_SEQUENCE_DTYPES,
    SUBLAYER_SEQUENCES_FILE,
    SUBLAYERS_FILE,
    TABLE_DTYPES,
)


@dataclass(frozen=True)
class Run:
    """The validated tables of one run directory."""

    path: Path
    channels: pd.DataFrame
    sublayers: pd.DataFrame
    sequences: pd.DataFrame
    meta: dict[str, Any] = field(default_factory=dict)
    mask_ratios: pd.DataFrame | None = None
    """``mask_ratios.parquet`` (``sequence_index``, ``mask_ratio``: each sequence's masking ratio t, one row per
    sequence) of a masked-diffusion run; None for any other run."""

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


def load_run(path: str | Path) -> Run:
    """Read and validate a run directory; raise :class:`RunError` with an actionable message."""
    root = Path(path)
    _check_directory(root)
    meta = _read_meta(root / META_FILE)
    tables = {name: _read_table(root / name, TABLE_DTYPES[name]) for name in TABLE_DTYPES}
    for name, frame in tables.items():
        _check_roles(root / name, frame)
    for name in (CHANNELS_FILE, SEQUENCES_FILE):
        _check_points(root / name, tables[name])
    ratios = _read_mask_ratios(root / MASK_RATIOS_FILE, tables[SEQUENCES_FILE])
    run = Run(path=root, channels=tables[CHANNELS_FILE], sublayers=tables[SUBLAYERS_FILE],
              sequences=tables[SEQUENCES_FILE], meta=meta, mask_ratios=ratios)
    _warn_if_inconsistent(run)
    return run


def read_sublayer_sequences(run: Run, param: str | None = "weight") -> pd.DataFrame:
    """The run's optional ``sublayer_sequences.parquet`` (rows of ``param`` only; None: all), validated.

    Raises :class:`RunError` when the run has no such table (recorded with ``--norms-only`` or by
    an older gradflow) or it is malformed.
    """
    path = run.path / SUBLAYER_SEQUENCES_FILE
    if not path.is_file():
        raise RunError(
            f"Run directory {str(run.path)!r} has no {SUBLAYER_SEQUENCES_FILE} (per-sequence sublayer sums): it was "
            "recorded with --norms-only or by an older gradflow. Record it again with this version, e.g. "
            f"`gradflow record --model {run.meta.get('model')} --loss all-positions --out DIR`.")
    frame = _read_table(path, SUBLAYER_SEQUENCE_DTYPES, filters=None if param is None else [("param", "==", param)],
                        allow_empty=True)
    _check_roles(path, frame)
    return frame


def _read_mask_ratios(path: Path, sequences: pd.DataFrame) -> pd.DataFrame | None:
    """``mask_ratios.parquet`` validated (None when absent): the schema's columns, one finite ratio in (0, 1] per
    sequence, and a ratio for every sequence of ``sequences.parquet``; a :class:`RunError` says what is wrong."""
    if not path.is_file():
        return None
    frame = _read_table(path, MASK_RATIO_DTYPES, allow_empty=True)[list(MASK_RATIO_DTYPES)]
    redo = ("It is written by `gradflow record --objective diffusion` with the run's other tables; the file is "
            "damaged or was edited: record the run again.")
    try:
        ratio = pd.to_numeric(frame["mask_ratio"], errors="raise").astype("float64")
    except (TypeError, ValueError):
        raise RunError(f"{str(path)!r}: column 'mask_ratio' is not float64. {redo}") from None
    bad = ~(np.isfinite(ratio) & (ratio > 0) & (ratio <= 1))
    if bad.any():
        n = int(bad.sum())
        raise RunError(f"{str(path)!r}: {n} masking ratio{'s are' if n > 1 else ' is'} not in (0, 1] (first: "
                       f"{float(ratio[bad].iloc[0])!r} at sequence {int(frame.loc[bad, 'sequence_index'].iloc[0])}). "
                       f"{redo}")
    twice = frame["sequence_index"][frame["sequence_index"].duplicated()]
    if len(twice):
        raise RunError(f"{str(path)!r}: sequence {int(twice.iloc[0])} has more than one masking ratio "
                       f"({len(twice)} repeated rows). {redo}")
    lacking = np.setdiff1d(sequences["sequence_index"].unique(), frame["sequence_index"].to_numpy())
    if lacking.size:
        raise RunError(f"{str(path)!r} has no masking ratio for {lacking.size} sequences of {SEQUENCES_FILE} "
                       f"(first: {int(lacking[0])}). {redo}")
    return frame.assign(mask_ratio=ratio).sort_values("sequence_index", kind="stable").reset_index(drop=True)


def _check_directory(root: Path) -> None:
    """Raise unless ``root`` is a directory holding every run file."""
    files = ", ".join(RUN_FILES)
    if not root.exists():
        raise RunError(
            f"Run directory {str(root)!r} does not exist. Pass the output directory of a gradflow "
            f"measurement run (it holds {files}); check the path for typos.")
    if not root.is_dir():
        raise RunError(f"{str(root)!r} is a file, not a run directory. Pass the directory that holds {files}.")
    missing = [name for name in RUN_FILES if not (root / name).is_file()]
    if missing:
        raise RunError(
            f"Run directory {str(root)!r} lacks {', '.join(missing)}. A run directory needs all of "
            f"{files}; these are written together by the measurement run, so a "
            "missing file usually means the run was interrupted before its first checkpoint or the path "
            "points at the wrong directory. Rerun the measurement (or resume it) and point at its output.")


def _read_meta(path: Path) -> dict[str, Any]:
    """Parse meta.json and check the keys the analysis relies on."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise RunError(f"{str(path)!r} is not valid JSON ({err}). It is written by the measurement run; "
                       "rerun it, or restore the file from the run's output.") from None
    if not isinstance(meta, dict):
        raise RunError(f"{str(path)!r} must hold a JSON object, found {type(meta).__name__}.")
    missing = [k for k in REQUIRED_META_KEYS if k not in meta]
    if missing:
        raise RunError(f"{str(path)!r} lacks the keys {', '.join(missing)}. The report needs the provenance "
                       "written by the measurement run; rerun it with a current gradflow version.")
    if not isinstance(meta["tokenizer"], dict) or "hash" not in meta["tokenizer"]:
        raise RunError(f"{str(path)!r}: 'tokenizer' must be an object with 'name_or_path', 'vocab_size' and "
                       "'hash'; rerun the measurement with a current gradflow version.")
    return meta


def _read_table(path: Path, dtypes: Mapping[str, str], filters: list | None = None,
                allow_empty: bool = False) -> pd.DataFrame:
    """Read a CSV or parquet table (parquet rows matching ``filters``): it must have every column of
    ``dtypes`` and, unless ``allow_empty``, at least one row."""
    try:
        frame = pd.read_parquet(path, filters=filters) if path.suffix == ".parquet" else pd.read_csv(path)
    except Exception as err:  # noqa: BLE001 - any reader failure becomes one actionable message
        raise RunError(f"Could not read {str(path)!r} ({type(err).__name__}: {err}). The file is damaged or "
                       "was still being written; rerun or resume the measurement.") from None
    missing = [c for c in dtypes if c not in frame.columns]
    if missing:
        raise RunError(f"{str(path)!r} lacks the columns {', '.join(missing)} (found: "
                       f"{', '.join(map(str, frame.columns))}). It was written by an incompatible gradflow "
                       "version; rerun the measurement with this version.")
    if frame.empty and not allow_empty:
        raise RunError(f"{str(path)!r} has no rows: the run recorded no batches. Check that the corpus "
                       "is not empty and rerun the measurement.")
    return _coerce(path, frame.copy(), dtypes)


def _coerce(path: Path, frame: pd.DataFrame, dtypes: Mapping[str, str]) -> pd.DataFrame:
    """Cast the ``str`` and ``int64`` columns of ``dtypes`` (floats are kept as read)."""
    for column, dtype in dtypes.items():
        if dtype not in ("str", "int64"):
            continue
        try:
            frame[column] = frame[column].astype(str if dtype == "str" else "int64")
        except (TypeError, ValueError):
            raise RunError(f"{str(path)!r}: column {column!r} is not {dtype}. The file was not written by "
                           "gradflow's recorder, or was edited; rerun the measurement.") from None
    return frame


def _check_roles(path: Path, frame: pd.DataFrame) -> None:
    """Raise when a table names a role gradflow does not know."""
    unknown = sorted(set(frame["role"]) - set(ROLE_ORDER))
    if unknown:
        raise RunError(f"{str(path)!r} has unknown roles {', '.join(unknown)}; roles are "
                       f"{', '.join(ROLE_ORDER)}. The file was not written by gradflow's recorder.")


def _check_points(path: Path, frame: pd.DataFrame) -> None:
    """Raise when a site table has points other than ``out`` and ``mid``."""
    bad = sorted(set(frame["point"]) - set(POINTS))
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


__all__ = ["Run", "load_run", "read_sublayer_sequences"]
