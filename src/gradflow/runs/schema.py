"""The run-directory contract: file names, columns and their order, dtypes, role and sublayer order.

Writers (:mod:`gradflow.runs`) and readers (:mod:`gradflow.analysis`, :mod:`gradflow.figures`) use
these names and never spell a column list of their own.

Record runs (``gradflow record``):

- ``channels.csv``: one row per (site, role): gradient- and activation-norm statistics;
- ``sublayers.csv``: one row per (layer, sublayer, param, role): the weight-gradient split;
- ``sequences.parquet``: one row per (sequence, site, role): sums for sequence-level bootstraps;
- ``meta.json``: model, masking, seed, counts, versions, the command.

Diagnostics runs (``gradflow diagnose``): ``logit_lens.csv``, ``input_shift.csv``,
``anisotropy.csv``, ``transformation.csv`` and ``meta.json``.
"""

from __future__ import annotations

import pyarrow as pa

CHANNELS_FILE = "channels.csv"
SUBLAYERS_FILE = "sublayers.csv"
SEQUENCES_FILE = "sequences.parquet"
META_FILE = "meta.json"
RUN_FILES: tuple[str, ...] = (CHANNELS_FILE, SUBLAYERS_FILE, SEQUENCES_FILE, META_FILE)

CHANNEL_COLUMNS: tuple[str, ...] = (
    "site", "layer", "point", "role", "n_positions", "grad_norm_mean", "grad_norm_std", "grad_norm_median",
    "grad_norm_q05", "grad_norm_q95", "grad_norm_zero_fraction", "act_norm_mean", "act_norm_std", "act_norm_median",
)
SUBLAYER_COLUMNS: tuple[str, ...] = (
    "layer", "sublayer", "param", "role", "n_positions", "n_nonzero", "coverage", "magnitude_sum", "share",
    "contribution_norm_mean", "contribution_norm_std", "n_batches",
)
SEQUENCE_SCHEMA = pa.schema([
    ("sequence_index", pa.int64()), ("site", pa.string()), ("layer", pa.int64()), ("point", pa.string()),
    ("role", pa.string()), ("n_positions", pa.int64()), ("grad_norm_sum", pa.float64()),
    ("grad_norm_sq_sum", pa.float64()), ("act_norm_sum", pa.float64()),
])
SEQUENCE_COLUMNS: tuple[str, ...] = tuple(SEQUENCE_SCHEMA.names)

DIAGNOSTIC_GROUPS: tuple[str, ...] = ("loss", "context")
"""The two groups of the input-shift probe."""
DIAGNOSTIC_ROLES: tuple[str, ...] = ("masked", "random", "kept", "context", "special", "loss")
"""Roles reported in the per-role diagnostics tables (``loss`` = pooled masked + random + kept)."""
DIAGNOSTIC_COLUMNS: dict[str, tuple[str, ...]] = {
    "logit_lens": ("layer", "site", "role", "n_positions", "top1_original", "mean_log_prob_original"),
    "input_shift": ("layer", "site", "n_loss", "n_context", "n_sample_loss", "n_sample_context", "auroc", "auroc_se",
                    "auroc_ci_low", "auroc_ci_high", "frechet_distance", "mean_shift_sq"),
    "anisotropy": ("layer", "site", "role", "n_positions", "mean_pairwise_cosine"),
    "transformation": ("layer", "role", "n_positions", "rel_change_mean", "rel_change_std", "last_block"),
}
"""Column order of each diagnostics CSV table."""
