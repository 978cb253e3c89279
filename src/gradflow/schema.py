"""The file contract: names, columns (dtypes, order, meaning) of every table gradflow writes; role/sublayer order.

A leaf (it imports only :mod:`gradflow.roles` and the sublayer names of :mod:`gradflow.adapters.base`), so
every layer may import it. Writers (:mod:`gradflow.runs`, :mod:`gradflow.interventions`, :mod:`gradflow.analysis`)
and readers use these names and sort keys and never spell a column list or an order of their own.

Record runs (``gradflow record``):

- ``channels.csv``: one row per (site, role): gradient- and activation-norm statistics;
- ``sublayers.csv``: one row per (layer, sublayer, param, role): the weight-gradient split;
- ``sequences.parquet`` / ``sublayer_sequences.parquet`` (optional): per (sequence, site or sublayer, role) sums
  for sequence-level bootstraps; ``meta.json``: model, masking, seed, counts, versions, the command.

Diagnostics (``gradflow diagnose``): ``logit_lens.csv``, ``input_shift.csv``, ``anisotropy.csv``,
``transformation.csv``. Reports (``report``/``compare``): ``tables/<name>.csv`` (:data:`REPORT_TABLES`,
:data:`COMPARISON_TABLES`). Training logs: ``gradflow_callback.csv``, ``new_rows.csv``, ``eval.csv``, ``mlm_log.csv``.
Probe and atlas directories: see their sections. Dtypes are ``"str"``, ``"int64"``, ``"float64"`` or ``"bool"``;
readers coerce the ``str`` and ``int64`` columns (the keys and counts), float columns are read as written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from gradflow.adapters.base import SUBLAYER_NAMES
from gradflow.roles import LOSS_ROLES, ROLE_ORDER, TOKEN_ROLES

if TYPE_CHECKING:
    import pyarrow as pa

# ----------------------------------------------------------------------------------------------
# Files; orders: roles, sublayers, params, points
# ----------------------------------------------------------------------------------------------

CHANNELS_FILE = "channels.csv"
SUBLAYERS_FILE = "sublayers.csv"
SEQUENCES_FILE = "sequences.parquet"
META_FILE = "meta.json"
RUN_FILES: tuple[str, ...] = (CHANNELS_FILE, SUBLAYERS_FILE, SEQUENCES_FILE, META_FILE)

REPORTED_ROLES: tuple[str, ...] = tuple(r for r in TOKEN_ROLES if r != "pad")
"""Roles of the run tables, compared and drawn by default, in display order (``pad`` depends on batching)."""
LOSS = "loss"
"""The pooled loss-position pseudo-role of analysis tables (masked + random + kept, pooled by positions)."""
SUBLAYER_ORDER: tuple[str, ...] = SUBLAYER_NAMES
"""Standard sublayer order (attention before FFN)."""
PARAMS: tuple[str, ...] = ("weight", "bias")
"""Parameters of a sublayer, in table order."""
POINTS: tuple[str, ...] = ("out", "mid")
"""Recording points of a site: a block's output and its FFN input (after attention)."""


def sublayer_rank(name: str) -> int:
    """Sort key of a sublayer name: its place in :data:`SUBLAYER_ORDER`, unknown names last."""
    return SUBLAYER_ORDER.index(name) if name in SUBLAYER_ORDER else len(SUBLAYER_ORDER)


def role_rank(name: str, order: Sequence[str] = ROLE_ORDER) -> int:
    """Sort key of a role name: its place in ``order`` (default: the display order), unknown names last."""
    return list(order).index(name) if name in order else len(order)


def sublayer_key(layer: int, sublayer: str, param: str, role: str | None = None) -> tuple[int, ...]:
    """Sort key of a sublayer-table row: layer, standard sublayer order, param order, then role order."""
    key = (int(layer), sublayer_rank(sublayer), PARAMS.index(param))
    return key if role is None else (*key, role_rank(role))


def sorted_sublayers(names: Sequence[str]) -> list[str]:
    """Distinct sublayer names in standard order (unknown names last)."""
    return sorted(dict.fromkeys(names), key=sublayer_rank)


# ----------------------------------------------------------------------------------------------
# Record-run tables
# ----------------------------------------------------------------------------------------------

CHANNEL_DTYPES: dict[str, str] = {
    "site": "str", "layer": "int64", "point": "str", "role": "str", "n_positions": "int64",
    "grad_norm_mean": "float64", "grad_norm_std": "float64", "grad_norm_median": "float64",
    "grad_norm_q05": "float64", "grad_norm_q95": "float64", "grad_norm_zero_fraction": "float64",
    "act_norm_mean": "float64", "act_norm_std": "float64", "act_norm_median": "float64",
}
SUBLAYER_DTYPES: dict[str, str] = {
    "layer": "int64", "sublayer": "str", "param": "str", "role": "str", "n_positions": "int64",
    "n_nonzero": "int64", "coverage": "float64", "magnitude_sum": "float64", "share": "float64",
    "contribution_norm_mean": "float64", "contribution_norm_std": "float64", "n_batches": "int64",
}
SEQUENCE_DTYPES: dict[str, str] = {
    "sequence_index": "int64", "site": "str", "layer": "int64", "point": "str", "role": "str",
    "n_positions": "int64", "grad_norm_sum": "float64", "grad_norm_sq_sum": "float64", "act_norm_sum": "float64",
}
CHANNEL_COLUMNS: tuple[str, ...] = tuple(CHANNEL_DTYPES)
SUBLAYER_COLUMNS: tuple[str, ...] = tuple(SUBLAYER_DTYPES)
SEQUENCE_COLUMNS: tuple[str, ...] = tuple(SEQUENCE_DTYPES)
TABLE_DTYPES: dict[str, dict[str, str]] = {
    CHANNELS_FILE: CHANNEL_DTYPES, SUBLAYERS_FILE: SUBLAYER_DTYPES, SEQUENCES_FILE: SEQUENCE_DTYPES,
}
"""Dtypes of each table of a record run, by file name."""

REQUIRED_META_KEYS: tuple[str, ...] = ("model", "family", "num_layers", "tokenizer", "masking", "loss", "seed",
                                       "complete", "versions", "command", "counts")
"""meta.json keys every reader of a record run relies on (the report's provenance table lists them first)."""
PROVENANCE_KEYS: tuple[str, ...] = ("complete", "error", "model", "model_path", "family", "model_type",
                                    "config_hash", "num_layers", "texts", "inputs_sha256", "masking", "seed",
                                    "versions", "command", "wall_s")
"""meta.json keys written by every corpus job (:func:`gradflow.runs.meta.provenance`); ``inputs_sha256``: the
content hash of each input on disk outside the package and cache (``model``, ``texts``; in a repository too)."""


def arrow_schema(dtypes: Mapping[str, str]) -> pa.Schema:
    """The pyarrow schema of a table's ``dtypes`` (column order kept)."""
    import pyarrow as pa

    types = {"str": pa.string(), "int64": pa.int64(), "float64": pa.float64(), "bool": pa.bool_()}
    return pa.schema([(name, types[dtype]) for name, dtype in dtypes.items()])


# ----------------------------------------------------------------------------------------------
# Analysis tables (written by reports as tables/<name>.csv)
# ----------------------------------------------------------------------------------------------

ANALYSIS_COLUMNS: dict[str, tuple[str, ...]] = {
    "role_profile": ("layer", "site", "role", "n_positions", "n_sequences", "grad_norm_mean", "ci_low", "ci_high",
                     "zero_fraction"),
    "role_ratios": ("layer", "site", "role", "reference", "ratio", "ci_low", "ci_high", "role_mean", "loss_mean",
                    "n_positions", "n_sequences"),
    "layer_tests": ("layer", "site", "role", "against", "n_role", "n_against", "median_role", "median_against",
                    "u_statistic", "p_value", "p_holm", "rank_biserial", "significant"),
    "sublayer_shares": ("layer", "sublayer", "param", "role", "share", "coverage", "n_positions", "n_nonzero",
                        "magnitude_sum"),
    "last_block": ("layer", "sublayer", "param", "role", "share", "earlier_mean", "earlier_min", "earlier_max",
                   "ratio_to_earlier", "coverage", "earlier_coverage_mean", "exact_zero", "n_earlier"),
    "channel_quantiles": ("layer", "site", "role", "n_positions", "mean", "median", "q05", "q95", "zero_fraction"),
    "ratio_differences": ("label", "baseline", "layer", "baseline_layer", "relative_depth", "role", "difference",
                          "ci_low", "ci_high", "paired"),
    "mask_ratio_profile": ("layer", "site", "t_low", "t_high", "t_mid", "n_sequences", "ratio", "ci_low", "ci_high",
                           "context_mean", "context_ci_low", "context_ci_high", "loss_mean", "loss_ci_low",
                           "loss_ci_high", "context_share", "share_ci_low", "share_ci_high", "n_context", "n_loss",
                           "exact_zero"),
}
"""Column order of each table :mod:`gradflow.analysis` builds, by name: :func:`~gradflow.analysis.role_profile`,
``role_ratios``, ``layer_tests``, ``sublayer_shares``, ``last_block`` (``last_block_deficit``), ``channel_quantiles``,
``ratio_differences`` (``compare_runs``), ``mask_ratio_profile`` (``ratio_by_mask_ratio``), ``context_pressure``."""
ANALYSIS_NOTES: dict[str, str] = {
    "role": "a position role, or ``loss``: masked + random + kept pooled by positions",
    "n_sequences": "sequences with at least one position of the role",
    "grad_norm_mean": "gradient norm at the site averaged over all the role's positions (pooled, not per sequence)",
    "ci_low": "lower end of the 95% percentile bootstrap interval over sequences (NaN from one sequence)",
    "ci_high": "upper end of that interval",
    "zero_fraction": "fraction of the role's positions with exactly zero gradient (channels.csv; NaN for ``loss``)",
    "reference": "the denominator's role: always ``loss``",
    "ratio": "``role_mean / loss_mean`` (NaN where ``loss_mean`` is 0)",
    "role_mean": "``grad_norm_mean`` of the role (``loss_mean``: of ``loss``, the ratio's denominator)",
    "against": "the role ``role`` is tested against (``masked``)",
    "n_role": "sequences with positions of ``role`` (per-sequence means are the test's sample; also ``n_against``)",
    "median_role": "median over sequences of the per-sequence mean gradient norm of ``role`` (``median_against``: "
                   "of ``against``)",
    "u_statistic": "Mann-Whitney U of ``role`` against ``against`` (two-sided test)",
    "p_holm": "``p_value`` Holm-corrected across the layers",
    "rank_biserial": "effect size in [-1, 1]: > 0 when ``role`` tends larger",
    "significant": "``p_holm < 0.05`` (the test's ``alpha``)",
    "share": "the role's fraction of the summed per-position magnitudes ``||g_t|| ||x_t||`` of the parameter gradient",
    "coverage": "fraction of the role's positions whose contribution to the parameter's gradient is non-zero",
    "earlier_mean": "the same sublayer's mean share over the earlier blocks 1..L-1 (``earlier_min``/``_max``: range)",
    "ratio_to_earlier": "``share / earlier_mean``: 0 when the last block's sublayer gets nothing from the role",
    "earlier_coverage_mean": "mean of the same sublayer's coverage over the earlier blocks 1..L-1",
    "exact_zero": "``share`` is exactly 0 (a structural zero, not a small number)",
    "n_earlier": "number of earlier blocks behind the ``earlier_*`` columns (0: one-block model, they are NaN)",
    "mean": "channels.csv's ``grad_norm_mean`` under a short name (``median``, ``q05``, ``q95`` likewise)",
    "label": "the run's label in a comparison (``baseline``: the label of the run differences are taken to)",
    "difference": "the run's ``ratio`` minus the baseline's, same role and relative depth; the CI is of the difference",
    "paired": "both runs measured the same sequences and were resampled together",
    "relative_depth": "``layer`` / the run's number of blocks",
    "share_difference": "``share`` minus the baseline's at ``baseline_layer`` (NaN: none); ``coverage_difference`` too",
}
"""What the analysis columns whose name does not say it all mean (a name means the same in every table)."""

# ----------------------------------------------------------------------------------------------
# Diagnostics-run tables and the channel view
# ----------------------------------------------------------------------------------------------

DIAGNOSTIC_GROUPS: tuple[str, ...] = (LOSS, "context")
"""The two groups of the input-shift probe."""
DIAGNOSTIC_ROLES: tuple[str, ...] = (*REPORTED_ROLES, LOSS)
"""Roles reported in the per-role diagnostics tables (``loss`` = pooled masked + random + kept)."""
DIAGNOSTIC_COLUMNS: dict[str, tuple[str, ...]] = {
    "logit_lens": ("layer", "site", "role", "n_positions", "top1_original", "mean_log_prob_original"),
    "input_shift": ("layer", "site", "n_loss", "n_context", "n_sample_loss", "n_sample_context", "auroc", "auroc_se",
                    "auroc_ci_low", "auroc_ci_high", "frechet_distance", "mean_shift_sq"),
    "anisotropy": ("layer", "site", "role", "n_positions", "mean_pairwise_cosine"),
    "transformation": ("layer", "role", "n_positions", "rel_change_mean", "rel_change_std", "last_block"),
}
"""Column order of each diagnostics CSV table."""

EXPLORE_SUBLAYER_COLUMNS: tuple[str, ...] = ("sublayer", "param", "role", "share", "magnitude_sum", "n_positions",
                                             "n_nonzero")
"""Fields of each last-block sublayer row the explorer page receives (from ``BatchRecord.sublayer_frame``)."""

CHANNEL_VIEW_COLUMNS: tuple[str, ...] = ("position", "token", "input_token", "role", "site", "layer", "point",
                                         "grad_norm", "act_norm", "attribution_sum", "attribution_norm", "ig_sum",
                                         "ig_norm")
"""Column order of ``channel_view.csv`` (one row per site and position of one sentence)."""

# ----------------------------------------------------------------------------------------------
# Per-sequence sublayer sums and the counterfactual context pressure (issue 14, part 2)
# ----------------------------------------------------------------------------------------------

SUBLAYER_SEQUENCES_FILE = "sublayer_sequences.parquet"
"""Per (sequence, layer, sublayer, param, role) sums of the per-position weight-gradient magnitudes.

Written by ``gradflow record`` whenever sublayers are recorded (not with ``--norms-only``); summed over sequences it
gives ``sublayers.csv``'s ``n_positions`` and (to float32 rounding) ``magnitude_sum`` of every token role but ``pad``.
Optional: not in :data:`RUN_FILES`, older runs lack it, :func:`gradflow.analysis.load_run` does not read it (large)."""
MASK_RATIOS_FILE = "mask_ratios.parquet"  # masked diffusion only: each sequence's ratio t (optional, joins on index)
MASK_RATIO_DTYPES: dict[str, str] = {"sequence_index": "int64", "mask_ratio": "float64"}
EXPERTS_FILE = "experts.csv"  # mixtures of experts only: the rows of each role routed to each expert (optional)
EXPERT_DTYPES = {"layer": "int64", "experts": "str", "expert": "int64", "role": "str", "n_rows": "int64"}
ROUTER_AUX_FILE = "router_aux.csv"  # --router-aux-loss only: router and experts weights' gradient norms, loss vs aux
ROUTER_AUX_DTYPES = {"layer": "int64", "sublayer": "str", "param": "str", "norm_loss": "float64", "norm_aux": "float64"}
OPTIONAL_RUN_FILES: tuple[str, ...] = (SUBLAYER_SEQUENCES_FILE, MASK_RATIOS_FILE, EXPERTS_FILE, ROUTER_AUX_FILE)
"""Run files a record run may lack; ``--overwrite`` removes them with :data:`RUN_FILES`."""
SUBLAYER_SEQUENCE_DTYPES: dict[str, str] = {"sequence_index": "int64", "layer": "int64", "sublayer": "str",
                                            "param": "str", "role": "str", "n_positions": "int64",
                                            "magnitude_sum": "float64"}
SUBLAYER_SEQUENCE_COLUMNS: tuple[str, ...] = tuple(SUBLAYER_SEQUENCE_DTYPES)
PRESSURE_COLUMNS: tuple[str, ...] = (
    "layer", "sublayer", "param", "loss", "last_block", "pressure", "ci_low", "ci_high", "context_per_position",
    "loss_per_position", "n_context", "n_loss", "n_sequences", "earlier_mean", "vs_earlier", "vs_earlier_ci_low",
    "vs_earlier_ci_high")
"""Columns of :func:`gradflow.analysis.context_pressure` (one row per layer and sublayer)."""
ANALYSIS_COLUMNS["context_pressure"] = PRESSURE_COLUMNS

REPORT_TABLES: dict[str, tuple[str, ...]] = {
    **{name: ANALYSIS_COLUMNS[name] for name in ("role_profile", "role_ratios", "layer_tests", "sublayer_shares",
                                                  "last_block", "channel_quantiles")},
    "context_pressure": ("label", *PRESSURE_COLUMNS), "mask_ratio_profile": ANALYSIS_COLUMNS["mask_ratio_profile"],
    "expert_roles": ("layer", "experts", "role", "n_rows", "row_share", "magnitude_sum", "share", "exact_zero"),
    "expert_rows": (*EXPERT_DTYPES, "expert_share"), "router_aux_ratio": (*ROUTER_AUX_DTYPES, "aux_ratio"),
}
"""``gradflow report``'s ``tables/<name>.csv`` -> columns (``context_pressure`` only for a run recorded under a loss
other than ``mlm`` with ``sublayer_sequences.parquet``; ``mask_ratio_profile`` only with ``mask_ratios.parquet``;
``expert_roles`` and ``expert_rows`` only with ``experts.csv``, ``router_aux_ratio`` only with ``router_aux.csv``)."""
COMPARISON_TABLES: dict[str, tuple[str, ...]] = {
    "profiles": ("label", *ANALYSIS_COLUMNS["role_profile"], "relative_depth"),
    "ratios": ("label", *ANALYSIS_COLUMNS["role_ratios"], "relative_depth"),
    "ratio_differences": ANALYSIS_COLUMNS["ratio_differences"],
    "shares": ("label", *ANALYSIS_COLUMNS["sublayer_shares"], "baseline_layer", "share_difference",
               "coverage_difference"),
    "last_block": ("label", *ANALYSIS_COLUMNS["last_block"], "share_difference"),
    "layer_tests": ("label", *ANALYSIS_COLUMNS["layer_tests"]),
    "context_pressure": REPORT_TABLES["context_pressure"],
}
"""``gradflow compare``'s ``tables/<name>.csv`` -> columns: every run's rows under its ``label`` (the
:class:`gradflow.analysis.Comparison` field of the same name; ``layer_tests`` is ``tests``), differences to the
baseline run; ``shares`` holds the context role only."""


def conform(frame, columns: Sequence[str], table: str):
    """``frame`` (a DataFrame) with exactly ``columns`` in that order; an empty frame gets them. A non-empty frame
    with other columns raises ``ValueError`` naming ``table``: its builder is out of step with this contract."""
    if len(frame) == 0:
        return frame.reindex(columns=list(columns))
    if set(frame.columns) != set(columns):
        odd = sorted(set(frame.columns).symmetric_difference(columns))
        raise ValueError(f"{table}: columns {odd} differ from gradflow.schema's ({', '.join(columns)})")
    return frame[list(columns)]


# ----------------------------------------------------------------------------------------------
# Probe runs (``gradflow probe``)
# ----------------------------------------------------------------------------------------------

PROBES_FILE = "probes.csv"
PROBE_DROPS_FILE = "probe_drops.csv"
PROBE_DTYPES: dict[str, str] = {
    "model": "str", "task": "str", "regime": "str", "site": "str", "layer": "int64", "depth_fraction": "float64",
    "split": "str", "accuracy": "float64", "ci_low": "float64", "ci_high": "float64",
    "control_accuracy": "float64", "selectivity": "float64", "code_length_bits": "float64",
    "uniform_code_bits": "float64", "compression": "float64", "majority_accuracy": "float64",
    "best_c": "float64", "n_tokens": "int64", "n_sentences": "int64",
}
"""One row per (regime, site) of a probe run: test accuracy with its sentence-bootstrap CI, the
control task's accuracy, selectivity, and the online code length (bits) of the test labels."""
PROBE_DROP_DTYPES: dict[str, str] = {
    "model": "str", "task": "str", "regime": "str", "metric": "str", "last_layer_drop": "float64",
    "ci_low": "float64", "ci_high": "float64", "last_score": "float64", "best_earlier_score": "float64",
    "best_earlier_layer": "int64",
}
"""One row per (regime, metric) of a probe run: ``score(L) - max_{l<L} score(l)`` with its paired CI."""
PROBE_REGIMES: tuple[str, ...] = ("unmasked", "masked")
"""Probe input regimes: every word visible (fine-tuning's regime) or the probed word masked (pretraining's)."""
PROBE_WORDS_FILE = "probe_words.parquet"
PROBE_WORD_COLUMNS: tuple[str, ...] = ("regime", "layer", "sentence", "word", "correct")
"""One row per (regime, block output, test word): was the probe right? For paired model comparisons."""
PROBE_DIFFERENCES_FILE = "probe_drop_differences.csv"
PROBE_DIFFERENCE_COLUMNS: tuple[str, ...] = ("task", "regime", "metric", "label", "baseline", "difference", "ci_low",
                                             "ci_high", "n_words", "n_sentences")
"""``gradflow compare`` of probe directories: last-layer drop of ``label`` minus the baseline's, paired CI."""
PROBE_COLUMNS: tuple[str, ...] = tuple(PROBE_DTYPES)
PROBE_DROP_COLUMNS: tuple[str, ...] = tuple(PROBE_DROP_DTYPES)

# ----------------------------------------------------------------------------------------------
# The atlas across checkpoints (``gradflow atlas``)
# ----------------------------------------------------------------------------------------------

ATLAS_FILE = "atlas.csv"
ATLAS_DONE_FILE = "atlas_done.json"
"""Completion marker of one model's atlas directory, written last (a directory without it is redone)."""
ATLAS_STARTED_FILE = "atlas_started.json"
"""Written first into a model's atlas directory: marks it as the atlas's own (safe to replace when unfinished)."""
ATLAS_DTYPES: dict[str, str] = {"model": "str", "family": "str", "n_layers": "int64", "depth_fraction": "float64",
                                "metric": "str", "value": "float64", "ci_low": "float64", "ci_high": "float64"}
"""One row per (model, metric, depth) of ``atlas.csv``: ``depth_fraction`` = layer / n_layers (0 = embeddings
output, 1 = the last block); ``ci_low``/``ci_high`` NaN where the metric has no interval."""
ATLAS_COLUMNS: tuple[str, ...] = tuple(ATLAS_DTYPES)
ATLAS_METRICS: dict[str, str] = {
    "context_loss_ratio": "context / loss-position mean gradient norm at each block output (95% sequence-bootstrap CI)",
    "context_share": "context share of a sublayer's weight-gradient signal, per block (``context_share:<sublayer>``)",
    "shared_context_share": "a weight-shared last block's context share summed over all its applications (at 1)",
    "logit_lens_top1_context": "logit-lens top-1 recovery of the original token at context positions, per layer",
    "probe_accuracy": "linear-probe test accuracy of unmasked word features per layer (``probe_accuracy:<task>``, "
                      "95% sentence-bootstrap CI)",
    "pressure": "counterfactual context pressure of a sublayer under the all-positions loss, per block "
                "(``pressure:<sublayer>``, 95% sequence-bootstrap CI)",
    "skippable_flop_share": "share of one batch's forward+backward matmul FLOPs the last block spends where it gets "
                            "exactly zero gradient (gradflow check)",
    "theory_disagreements": "(block, sublayer) pairs where gradflow check's measured zeros disagree with the theory",
}
"""Metric kinds of ``atlas.csv`` in row order (a ``kind:detail`` metric is listed under its kind)."""
ATLAS_STEP_DIRS: dict[str, str] = {"record": "record", "pressure": "pressure", "check": "check",
                                   "diagnostics": "diagnostics", "probes": "probes"}
"""Step -> its output directory inside a model's atlas directory (each step's own files and meta.json)."""
CHECK_FILE = "check.json"
"""``gradflow check --json``'s object, as the atlas's check step writes it."""
WEIGHT_SHARING_META_KEY = "weight_sharing"  # meta.json, shared blocks only: {"shared_layers": [[layers of a module]]}

# ----------------------------------------------------------------------------------------------
# Training logs (:mod:`gradflow.interventions`): the callback, new vocabulary rows, fine-tuning, continued MLM
# ----------------------------------------------------------------------------------------------

CALLBACK_FILE = "gradflow_callback.csv"
CALLBACK_FIELDS: dict[str, str] = {
    "step": "optimizer step s (global_step s-1 -> s): gradients at the weights after step s-1, drift after step s",
    "group": "parameter group: ``embeddings``, a block (``blocks.3``; ALBERT's shared one ``blocks.0-11``), ``other``",
    "role": "position role of a per-role row (from the batch's labels), ``all`` for a whole group",
    "quantity": "one of :data:`CALLBACK_QUANTITIES`",
    "value": "the quantity's value (a float, counts included)",
}
"""``GradFlowCallback``'s log (fine-tuning, continued MLM, repair): one row per (step, group, role, quantity)."""
CALLBACK_QUANTITIES: dict[str, str] = {
    "grad_norm": "role ``all``: L2 norm of the group's gradient before clipping (summed over accumulation "
                 "micro-batches); per role: ``sqrt(sum over the block's sublayers of ||G_r||^2)``, role r's part",
    "drift": "role ``all``: ``||W - W0|| / ||W0||`` over the group's parameters after the step, W0 the weights at "
             "train start: distance moved relative to the initial norm, comparable across groups of any size",
    "hidden_grad_mean": "per role: mean norm of the loss gradient w.r.t. the group's output (embeddings or block "
                        "output) over the role's positions, in the step's first micro-batch",
    "n_positions": "per role: the role's positions in that micro-batch",
}
"""The quantities of the callback's log (per-role rows only for MLM batches)."""
CALLBACK_COLUMNS: tuple[str, ...] = tuple(CALLBACK_FIELDS)
CALLBACK_SUMMARY_SCALARS: dict[str, str] = {
    "gradflow/grad_norm": "the whole model's gradient norm before clipping (every group's ``grad_norm``, role all)",
    "gradflow/last_block/grad_norm": "``grad_norm`` (role all) of the last block's group (ALBERT: the shared one)",
    "gradflow/last_block/drift": "``drift`` of the last block's group (with ``drift=True``)",
    "gradflow/last_block/context_share": "context's share of the sum of n_positions * hidden_grad_mean: 0 under MLM",
    "gradflow/last_block/context_weight_share": "context's share of the squared per-role ``grad_norm`` (K, V: > 0)",
    "gradflow/last_block/context_loss_ratio": "hidden_grad_mean at context / at the loss positions: 0 under MLM",
    "gradflow/block_before_last/context_loss_ratio": "the same one block earlier (where context gets gradient)",
}
"""``GradFlowCallback(log="summary")``'s scalars per logged step (from its rows; one without rows is left out)."""
NEW_ROWS_FILE = "new_rows.csv"
NEW_ROWS_FIELDS: dict[str, str] = {
    "step": "optimizer step (numbered as in the callback's log); rows come from the step's first micro-batch",
    "side": "``input``: dL/de at the positions that read a new token; ``output``: the decoder rows' gradient "
            "``sum_t dL/dz[t, v] h[t]`` from every loss position",
    "role": "role of the reading (input) or loss (output) position; ``all``: the side's whole gradient",
    "grad_norm": "``sqrt(sum over the new rows v of ||g_v||^2)``",
    "n_positions": "positions that contributed",
}
"""``NewRowsCallback``'s log (continued MLM with new words): where new vocabulary rows get their gradient."""
NEW_ROWS_COLUMNS: tuple[str, ...] = tuple(NEW_ROWS_FIELDS)
EVAL_FILE = "eval.csv"
EVAL_FIELDS: dict[str, str] = {
    "step": "optimizer step of the evaluation",
    "split": "``train`` (its loss since the previous evaluation) or the evaluated split",
    "metric": "``loss``, the task's metrics, ``dropped_words`` (words truncation cut off)",
    "value": "the metric's value",
}
"""A fine-tuning run's evaluation history, rewritten after every evaluation (``gradflow finetune``)."""
EVAL_COLUMNS: tuple[str, ...] = tuple(EVAL_FIELDS)
FINETUNE_RESULT_FILE = "result.json"
"""A fine-tuning run's config, surgery, parameter counts and final metrics (paths portable)."""
MLM_LOG_FILE = "mlm_log.csv"
MLM_LOG_FIELDS: dict[str, str] = {"step": "optimizer step", "loss": "training MLM loss of one micro-batch",
                                  "learning_rate": "the rate it used"}
"""Continued MLM's loss log: one row per training micro-batch."""
MLM_LOG_COLUMNS: tuple[str, ...] = tuple(MLM_LOG_FIELDS)
CONTINUED_META_FILE = "continued.json"
"""Continued MLM's arguments, counts, timings and final loss."""

__all__ = [
    "ANALYSIS_COLUMNS", "ANALYSIS_NOTES", "ATLAS_COLUMNS", "ATLAS_DONE_FILE", "ATLAS_DTYPES", "ATLAS_FILE",
    "ATLAS_METRICS", "ATLAS_STARTED_FILE", "ATLAS_STEP_DIRS", "CALLBACK_COLUMNS", "CALLBACK_FIELDS", "CALLBACK_FILE",
    "CALLBACK_QUANTITIES", "CALLBACK_SUMMARY_SCALARS", "CHANNELS_FILE", "CHANNEL_COLUMNS", "CHANNEL_DTYPES",
    "CHANNEL_VIEW_COLUMNS", "CHECK_FILE", "COMPARISON_TABLES", "CONTINUED_META_FILE", "DIAGNOSTIC_COLUMNS",
    "DIAGNOSTIC_GROUPS", "DIAGNOSTIC_ROLES", "EVAL_COLUMNS", "EVAL_FIELDS", "EVAL_FILE", "EXPERTS_FILE",
    "EXPERT_DTYPES", "EXPLORE_SUBLAYER_COLUMNS", "FINETUNE_RESULT_FILE", "LOSS", "LOSS_ROLES", "MASK_RATIOS_FILE",
    "MASK_RATIO_DTYPES", "META_FILE", "MLM_LOG_COLUMNS", "MLM_LOG_FIELDS", "MLM_LOG_FILE", "NEW_ROWS_COLUMNS",
    "NEW_ROWS_FIELDS", "NEW_ROWS_FILE", "OPTIONAL_RUN_FILES", "PARAMS", "POINTS", "PRESSURE_COLUMNS", "PROBES_FILE",
    "PROBE_COLUMNS", "PROBE_DIFFERENCES_FILE", "PROBE_DIFFERENCE_COLUMNS", "PROBE_DROPS_FILE", "PROBE_DROP_COLUMNS",
    "PROBE_DROP_DTYPES", "PROBE_DTYPES", "PROBE_REGIMES", "PROBE_WORDS_FILE", "PROBE_WORD_COLUMNS", "PROVENANCE_KEYS",
    "REPORTED_ROLES", "REPORT_TABLES", "REQUIRED_META_KEYS", "ROUTER_AUX_DTYPES", "ROUTER_AUX_FILE", "RUN_FILES",
    "SEQUENCES_FILE", "SEQUENCE_COLUMNS", "SEQUENCE_DTYPES", "SUBLAYERS_FILE", "SUBLAYER_COLUMNS", "SUBLAYER_DTYPES",
    "SUBLAYER_ORDER", "SUBLAYER_SEQUENCES_FILE", "SUBLAYER_SEQUENCE_COLUMNS", "SUBLAYER_SEQUENCE_DTYPES",
    "TABLE_DTYPES", "WEIGHT_SHARING_META_KEY", "arrow_schema", "conform", "role_rank", "sorted_sublayers",
    "sublayer_key", "sublayer_rank",
]
