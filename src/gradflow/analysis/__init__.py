"""Analysis: pure functions over run tables (profiles, ratios, shares, CIs, tests, comparisons).

- :mod:`.run_data`: :class:`Run` and :func:`load_run` (reading and validation against the schema);
- :mod:`.stats`: sequence bootstrap, percentile intervals, Holm, Mann-Whitney, rank-biserial;
- :mod:`.profiles`: gradient-norm profiles and ratios per layer and role, rank tests, quantiles;
- :mod:`.sublayers`: weight-gradient shares and coverage per sublayer, the last-block deficit;
- :mod:`.compare`: several runs of one tokenizer side by side.
- :mod:`.mask_ratio`: masked diffusion: the context / loss ratio per layer and masking ratio t, with CIs;
- :mod:`.pressure`: the counterfactual context pressure per sublayer (all-positions runs), with CIs;
- :mod:`.probes`: layer-wise linear probes, control tasks, online code length, sentence bootstrap CIs.
- :mod:`.structural_check` (with :mod:`.check_flops`): ``gradflow check``, the structural-zero lint on one
  recorded batch (not imported here: it loads models).

Column lists, role and sublayer order live in :mod:`gradflow.schema` (re-exported here).
"""

from gradflow.analysis.compare import Comparison, check_same_tokenizer, compare_runs
from gradflow.analysis.mask_ratio import mask_ratio_bins, ratio_by_mask_ratio
from gradflow.analysis.pressure import context_pressure
from gradflow.analysis.probes import (
    CodeLength,
    ProbeResult,
    control_labels,
    fit_probe,
    last_layer_drop,
    last_layer_drop_ci,
    online_code_length,
    paired_difference_ci,
    selectivity,
    sentence_bootstrap_ci,
)
from gradflow.analysis.profiles import (
    channel_quantiles,
    context_ratio,
    layer_tests,
    role_profile,
    role_ratios,
    sequence_means,
)
from gradflow.analysis.run_data import Run, load_run, read_sublayer_sequences
from gradflow.analysis.stats import (
    bootstrap_ratio,
    bootstrap_sums,
    holm,
    mann_whitney,
    percentile_interval,
    rank_biserial,
    resample_weights,
)
from gradflow.analysis.sublayers import context_share, last_block_deficit, sublayer_shares
from gradflow.errors import RunError
from gradflow.schema import CHANNEL_COLUMNS, LOSS, SEQUENCE_COLUMNS, SUBLAYER_COLUMNS, SUBLAYER_ORDER
from gradflow.schema import REPORTED_ROLES as DEFAULT_ROLES

__all__ = [
    "CHANNEL_COLUMNS", "DEFAULT_ROLES", "LOSS", "SEQUENCE_COLUMNS", "SUBLAYER_COLUMNS", "SUBLAYER_ORDER", "CodeLength",
    "Comparison", "ProbeResult", "Run", "RunError", "bootstrap_ratio", "bootstrap_sums", "channel_quantiles",
    "check_same_tokenizer", "compare_runs", "context_pressure", "context_ratio", "context_share", "control_labels",
    "fit_probe", "holm", "last_block_deficit", "last_layer_drop", "last_layer_drop_ci", "layer_tests", "load_run",
    "mann_whitney", "mask_ratio_bins", "online_code_length", "paired_difference_ci", "percentile_interval",
    "rank_biserial", "ratio_by_mask_ratio", "read_sublayer_sequences", "resample_weights", "role_profile",
    "role_ratios", "selectivity", "sentence_bootstrap_ci", "sequence_means", "sublayer_shares",
]
