"""The gradient flow by masking ratio (masked diffusion): the context / loss gradient-norm ratio per layer and t.

Under masked diffusion (LLaDA, MDLM) each sequence has its own masking ratio t (``mask_ratios.parquet``,
:attr:`gradflow.analysis.Run.mask_ratios`): a fraction t of its tokens is masked and is the loss, the rest
is context. :func:`ratio_by_mask_ratio` groups the sequences by t and gives, at every block output (and
the embeddings output, layer 0), the ratio of the pooled context gradient-norm mean to the pooled loss
one, as :func:`gradflow.analysis.role_ratios` does for a whole run.

Bins of t (``bins=None``): each distinct t is its own bin when the run has at most
:data:`MAX_GRID_VALUES` of them (a fixed ratio, or the grid of ``--mask-ratios``); otherwise
:data:`DEFAULT_BINS` equal-width bins of [0, 1]: [0, 0.2), [0.2, 0.4), ..., [0.8, 1]. Under t ~ U(eps, 1)
each holds about a fifth of the sequences, and fixed edges keep runs comparable. ``bins`` may also be a
number of equal-width bins of [0, 1], or the edges themselves ([e_k, e_k+1), the last bin closed;
sequences outside every bin are left out).

Pooling and intervals are those of :mod:`.profiles`: within a bin, ``(sum of context norms / context
positions) / (sum of loss norms / loss positions)`` over its sequences, and a seeded percentile bootstrap
that resamples the bin's sequences. A sequence's loss weight 1/t scales its context and loss gradients
alike, so it cancels in one sequence's ratio; a bin of mixed t pools sequences whose scales differ by up
to ``t_high / t_low``. The last block's output gets exactly zero gradient at context positions (the head
is position-wise): ``exact_zero`` marks a bin whose context norms sum to exactly 0, and its ratio is 0.0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pandas as pd

from gradflow.analysis.profiles import bootstrap_profile, ratio_replicates
from gradflow.analysis.run_data import Run
from gradflow.analysis.stats import percentile_interval
from gradflow.errors import RunError
from gradflow.schema import ANALYSIS_COLUMNS, LOSS, MASK_RATIOS_FILE, conform

MAX_GRID_VALUES = 12
"""A run with at most this many distinct masking ratios is binned by its values (one bin per t)."""
DEFAULT_BINS = 5
"""Equal-width bins of [0, 1] for a run whose t were drawn (more than :data:`MAX_GRID_VALUES` values)."""
POINT = "out"
"""The recording point of the table: block outputs (and the embeddings output, layer 0)."""

Bins = int | Sequence[float] | None


def mask_ratio_bins(ratios: np.ndarray, bins: Bins = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bin index of each ratio, -1 outside every bin; each bin's low edge; its high edge) for ``bins`` as
    :func:`ratio_by_mask_ratio` takes it. A grid's bins are its values (low = high = t)."""
    ratios = np.asarray(ratios, dtype=np.float64)
    values = np.unique(ratios)
    if bins is None and values.size <= MAX_GRID_VALUES:
        return np.searchsorted(values, ratios), values, values
    if bins is None or isinstance(bins, (int, np.integer)):
        count = DEFAULT_BINS if bins is None else int(bins)
        if count < 1 or isinstance(bins, bool):
            raise ValueError(f"bins must be a positive number of bins or a sequence of edges, got {bins!r}")
        edges = np.linspace(0.0, 1.0, count + 1)
    else:
        edges = np.asarray(bins, dtype=np.float64)
        if edges.ndim != 1 or edges.size < 2 or not np.all(np.diff(edges) > 0) or not np.isfinite(edges).all():
            raise ValueError(f"bin edges must be at least two increasing finite numbers, got {list(bins)!r}")
    index = np.searchsorted(edges, ratios, side="right") - 1
    index[ratios == edges[-1]] = edges.size - 2  # the last bin is closed
    index[(ratios < edges[0]) | (ratios > edges[-1])] = -1
    return index, edges[:-1], edges[1:]


def ratio_by_mask_ratio(run: Run, bins: Bins = None, n_resamples: int = 2000, confidence: float = 0.95,
                        seed: int | None = 0) -> pd.DataFrame:
    """Per (layer, bin of t): the context / loss gradient-norm ratio at the block outputs, with its CI.

    Columns: ``ANALYSIS_COLUMNS["mask_ratio_profile"]`` of :mod:`gradflow.schema`: ``layer``, ``site``,
    ``t_low``, ``t_high``, ``t_mid`` (the bin), ``n_sequences`` (the bin's sequences), ``ratio`` (pooled
    context mean / pooled loss mean), ``ci_low``, ``ci_high`` (``confidence`` percentile bootstrap over the
    bin's sequences, ``n_resamples`` resamples, ``seed``), ``context_mean``, ``loss_mean``, ``n_context``,
    ``n_loss`` (positions) and ``exact_zero`` (the bin's context norms sum to exactly 0). Rows by layer,
    then t; a bin without context or loss positions at a layer has no row. Bins: see the module.

    Raises :class:`RunError` when the run has no ``mask_ratios.parquet`` (not recorded under
    ``--objective diffusion``).
    """
    if run.mask_ratios is None:
        raise RunError(f"Run directory {str(run.path)!r} has no {MASK_RATIOS_FILE}: the gradient flow by masking "
                       "ratio needs a masked-diffusion run. Record one with `gradflow record --objective diffusion` "
                       "(t drawn per sequence, or a grid: --mask-ratios 0.1,0.5,0.9).")
    ratios = run.mask_ratios
    index, lows, highs = mask_ratio_bins(ratios["mask_ratio"].to_numpy(), bins)
    sequences = run.sequences[run.sequences["point"].astype(str) == POINT]
    rows = []
    for k, (low, high) in enumerate(zip(lows, highs)):
        members = ratios["sequence_index"].to_numpy()[index == k]
        part = sequences[sequences["sequence_index"].isin(members)]
        if part.empty:
            continue
        rows += _bin_rows(replace(run, sequences=part), float(low), float(high), n_resamples, confidence, seed)
    out = pd.DataFrame(rows)
    if not out.empty:
        out = out.sort_values(["layer", "t_low"], kind="stable").reset_index(drop=True)
    return conform(out, ANALYSIS_COLUMNS["mask_ratio_profile"], "mask_ratio_profile")


def _bin_rows(part: Run, low: float, high: float, n_resamples: int, confidence: float,
              seed: int | None) -> list[dict]:
    """The rows of one bin: ``part`` holds only its sequences."""
    prof = bootstrap_profile(part, POINT, n_resamples, seed)
    if "context" not in prof.roles:
        return []
    _, point, reps = ratio_replicates(prof, ("context",))
    ci_low, ci_high = percentile_interval(reps, confidence)
    ctx, loss = prof.roles.index("context"), prof.roles.index(LOSS)
    context_sums = prof.cube.sums[..., prof.cube.roles.index("context")].sum(axis=0)
    present = (prof.cube.counts.sum(axis=-1) > 0).sum(axis=0)  # sequences with positions at each layer
    rows = []
    for li, layer in enumerate(prof.cube.layers):
        n_context, n_loss = int(prof.n_positions[li, ctx]), int(prof.n_positions[li, loss])
        if n_context == 0 or n_loss == 0:
            continue
        rows.append({"layer": int(layer), "site": prof.cube.sites[li], "t_low": low, "t_high": high,
                     "t_mid": (low + high) / 2, "n_sequences": int(present[li]), "ratio": point[li, 0],
                     "ci_low": ci_low[li, 0], "ci_high": ci_high[li, 0], "context_mean": prof.means[li, ctx],
                     "loss_mean": prof.means[li, loss], "n_context": n_context, "n_loss": n_loss,
                     "exact_zero": bool(context_sums[li] == 0.0)})
    return rows


__all__ = ["DEFAULT_BINS", "MAX_GRID_VALUES", "mask_ratio_bins", "ratio_by_mask_ratio"]
