"""The gradient flow by masking ratio (masked diffusion): the context / loss gradient-norm ratio per layer and t.

Under masked diffusion (LLaDA, MDLM) each sequence has its own masking ratio t (``mask_ratios.parquet``,
:attr:`gradflow.analysis.Run.mask_ratios`): a fraction t of its tokens is masked and is the loss, the rest
is context. :func:`ratio_by_mask_ratio` groups the sequences by t and gives, at every block output (and
the embeddings output, layer 0), the ratio of the pooled context gradient-norm mean to the pooled loss
one, as :func:`gradflow.analysis.role_ratios` does for a whole run.

Bins of t (``bins=None``), decided by meta.json (:func:`mask_ratio_drawn`): a run whose t came from a
grid (``--mask-ratios``) or was fixed has one bin per value; a run whose t was drawn per sequence has
:data:`DEFAULT_BINS` equal-width bins of [0, 1]: [0, 0.2), [0.2, 0.4), ..., [0.8, 1], however few its
sequences. Under t ~ U(eps, 1) each holds about a fifth of the sequences, and fixed edges keep runs
comparable. An older run whose meta.json does not say is binned by its values when it has at most
:data:`MAX_GRID_VALUES` of them, else in the equal-width bins. ``bins`` may also be a
number of equal-width bins of [0, 1], or the edges themselves ([e_k, e_k+1), the last bin closed;
sequences outside every bin are left out).

Pooling and intervals are those of :mod:`.profiles`: within a bin, ``(sum of context norms / context
positions) / (sum of loss norms / loss positions)`` over its sequences, and a seeded percentile bootstrap
that resamples the bin's sequences. A sequence's loss weight 1/t scales its context and loss gradients
alike, so it cancels in one sequence's ratio; a bin of mixed t pools sequences whose scales differ by up
to ``t_high / t_low``. The last block's output gets exactly zero gradient at context positions (the head
is position-wise): ``exact_zero`` marks a bin whose context norms sum to exactly 0, and its ratio is 0.0.

Read the ratio with its numerator and denominator beside it (the table has both, with their intervals, and
the report's figure draws all three with the share). Under LLaDA's loss, ``sum over masked positions of
CE / t``, divided by the sequence's tokens, a loss position's own gradient scales like 1/(t N): a fixed loss
spread over the t N masked positions of a sequence of N tokens. A clean position gets its gradient through
attention from all of them: on the embedded mini-en its mean norm stays about flat in t. The ratio rises with t
where its *denominator* falls faster than its numerator, not because clean positions get more signal; and the
clean positions' share of the gradient (``context_share``: their summed norms over those of context and loss
positions) falls with t, because fewer positions are clean.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from gradflow.analysis.profiles import RoleProfile, bootstrap_profile, ratio_replicates
from gradflow.analysis.run_data import Run
from gradflow.analysis.stats import bootstrap_sums, percentile_interval
from gradflow.errors import RunError
from gradflow.roles import LOSS_ROLES
from gradflow.schema import ANALYSIS_COLUMNS, LOSS, MASK_RATIOS_FILE, conform

MAX_GRID_VALUES = 12
"""A run whose meta.json does not say where t came from is binned by its values (one bin per t) when it has at most
this many distinct masking ratios."""
DEFAULT_BINS = 5
"""Equal-width bins of [0, 1] for a run whose t was drawn per sequence."""
LEFT_OUT_REASONS: dict[str, str] = {
    "outside": "t outside every bin",
    "no_loss": "no loss position",
    "no_context": "no context position in its bin",
}
"""Why :func:`ratio_by_mask_ratio` leaves a sequence out, in the order they are checked: its t is in no bin (given
edges); it has no loss position (no token masked: a small t on a short sequence or response; its gradient is all
zeros, which would pull its bin's context mean down); no sequence of its bin has a context position (every token
masked, as at t = 1: the bin has no ratio, so no row). A sequence without context in a bin that has some stays in:
its loss positions are loss positions at its t, and its gradient is part of the share."""
POINT = "out"
"""The recording point of the table: block outputs (and the embeddings output, layer 0)."""

Bins = int | Sequence[float] | None


def mask_ratio_bins(ratios: np.ndarray, bins: Bins = None,
                    drawn: bool | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bin index of each ratio, -1 outside every bin; each bin's low edge; its high edge) for ``bins`` as
    :func:`ratio_by_mask_ratio` takes it. With ``bins=None``: ``drawn`` False (t from a grid, or fixed) gives a bin
    per value (low = high = t), True (t drawn per sequence) :data:`DEFAULT_BINS` equal-width bins, None (not known)
    a bin per value when there are at most :data:`MAX_GRID_VALUES` of them."""
    ratios = np.asarray(ratios, dtype=np.float64)
    values = np.unique(ratios)
    if bins is None and (not drawn if drawn is not None else values.size <= MAX_GRID_VALUES):
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


def mask_ratio_drawn(meta: Mapping[str, Any]) -> bool | None:
    """Whether meta.json says the run's t was drawn per sequence (True), came from a grid or was fixed (False), or
    does not say (None: an older run, or not a masked-diffusion run). Reads ``meta["masking"]``: ``t``
    (``uniform``, ``grid``, ``fixed``), else ``ratios`` (the grid; empty or null when drawn) and ``ratio``."""
    masking = meta.get("masking")
    if not isinstance(masking, Mapping) or masking.get("policy") != "diffusion":
        return None
    if masking.get("t") in ("uniform", "grid", "fixed"):
        return masking["t"] == "uniform"
    if "ratios" not in masking:
        return None
    return not masking.get("ratios") and masking.get("ratio") is None


@dataclass(frozen=True)
class MaskRatioSelection:
    """How :func:`ratio_by_mask_ratio` bins a run's sequences by t, and which it leaves out and why."""

    lows: tuple[float, ...]
    highs: tuple[float, ...]
    """Each bin's edges (a grid's bin: low = high = t)."""
    scheme: str
    """``values`` (a bin per value of t), ``equal`` (equal-width bins of [0, 1]) or ``edges`` (edges given)."""
    drawn: bool | None
    """:func:`mask_ratio_drawn` of the run's meta.json."""
    members: tuple[tuple[int, ...], ...]
    """Each bin's sequences (``sequence_index``), those left out excepted."""
    n_sequences: int
    """The run's sequences (each has its t in ``mask_ratios.parquet``)."""
    left_out: tuple[tuple[str, int], ...]
    """(reason of :data:`LEFT_OUT_REASONS`, sequences), in that order, for every reason that left one out."""

    @property
    def n_left_out(self) -> int:
        """Sequences left out of the table, for any reason."""
        return sum(n for _, n in self.left_out)


def mask_ratio_selection(run: Run, bins: Bins = None) -> MaskRatioSelection:
    """The bins of t of :func:`ratio_by_mask_ratio` and each bin's sequences: every sequence with a loss position at the
    block outputs whose t falls in a bin that has a context position; the others are counted by reason
    (:data:`LEFT_OUT_REASONS`).

    Raises :class:`RunError` when the run has no ``mask_ratios.parquet``."""
    if run.mask_ratios is None:
        raise RunError(f"Run directory {str(run.path)!r} has no {MASK_RATIOS_FILE}: the gradient flow by masking "
                       "ratio needs a masked-diffusion run. Record one with `gradflow record --objective diffusion` "
                       "(t drawn per sequence, or a grid: --mask-ratios 0.1,0.5,0.9).")
    drawn = mask_ratio_drawn(run.meta)
    ids = run.mask_ratios["sequence_index"].to_numpy()
    index, lows, highs = mask_ratio_bins(run.mask_ratios["mask_ratio"].to_numpy(), bins, drawn)
    at = run.sequences[(run.sequences["point"].astype(str) == POINT) & (run.sequences["n_positions"] > 0)]
    roles = at["role"].astype(str)
    with_context = np.isin(ids, at.loc[roles == "context", "sequence_index"].unique())
    no_loss = ~np.isin(ids, at.loc[roles.isin(LOSS_ROLES), "sequence_index"].unique())
    bins_with_context = np.unique(index[with_context & ~no_loss & (index >= 0)])
    reasons = {"outside": index < 0, "no_loss": no_loss, "no_context": ~np.isin(index, bins_with_context)}
    left_out, dropped = [], np.zeros(ids.size, dtype=bool)
    for reason in LEFT_OUT_REASONS:
        new = reasons[reason] & ~dropped
        if new.any():
            left_out.append((reason, int(new.sum())))
        dropped |= new
    scheme = ("values" if bins is None and np.array_equal(lows, highs) else
              "equal" if bins is None or isinstance(bins, (int, np.integer)) else "edges")
    return MaskRatioSelection(tuple(float(x) for x in lows), tuple(float(x) for x in highs), scheme, drawn,
                              tuple(tuple(int(i) for i in ids[(index == k) & ~dropped]) for k in range(len(lows))),
                              int(ids.size), tuple(left_out))


def ratio_by_mask_ratio(run: Run, bins: Bins = None, n_resamples: int = 2000, confidence: float = 0.95,
                        seed: int | None = 0, selection: MaskRatioSelection | None = None) -> pd.DataFrame:
    """Per (layer, bin of t): the context / loss gradient-norm ratio at the block outputs, with its CI.

    Columns: ``ANALYSIS_COLUMNS["mask_ratio_profile"]`` of :mod:`gradflow.schema`: ``layer``, ``site``,
    ``t_low``, ``t_high``, ``t_mid`` (the bin), ``n_sequences`` (the bin's sequences), ``ratio`` (pooled
    context mean / pooled loss mean), ``ci_low``, ``ci_high`` (``confidence`` percentile bootstrap over the
    bin's sequences, ``n_resamples`` resamples, ``seed``), ``context_mean`` (the numerator: mean gradient norm
    of a context position) with ``context_ci_low``, ``context_ci_high``, ``loss_mean`` (the denominator) with
    ``loss_ci_low``, ``loss_ci_high``, ``context_share`` (summed context norms over summed context and loss
    norms) with ``share_ci_low``, ``share_ci_high`` (every interval from the same resamples), ``n_context``,
    ``n_loss`` (positions) and ``exact_zero`` (the bin's context norms sum to exactly 0). Rows by layer,
    then t; a bin without context or loss positions at a layer has no row. Bins: see the module.

    Sequences without a loss position, outside every bin, or in a bin without a context position are left out
    (:func:`mask_ratio_selection` says which and why; a caller that has it passes it as ``selection``, which then
    fixes the bins). Raises :class:`RunError` when the run has no ``mask_ratios.parquet`` (not recorded under
    ``--objective diffusion``).
    """
    selection = mask_ratio_selection(run, bins) if selection is None else selection
    sequences = run.sequences[run.sequences["point"].astype(str) == POINT]
    rows = []
    for low, high, members in zip(selection.lows, selection.highs, selection.members):
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
    """The rows of one bin: ``part`` holds only its sequences.

    Every interval comes from the same resamples of the bin's sequences (one seed, one sequence count): the
    ratio's, the numerator's (``context_mean``), the denominator's (``loss_mean``) and the share's."""
    prof = bootstrap_profile(part, POINT, n_resamples, seed)
    if "context" not in prof.roles:
        return []
    _, point, reps = ratio_replicates(prof, ("context",))
    ci_low, ci_high = percentile_interval(reps, confidence)
    ctx, loss = prof.roles.index("context"), prof.roles.index(LOSS)
    mean_low, mean_high = percentile_interval(prof.replicates[..., [ctx, loss]], confidence)
    share, share_low, share_high = _context_share(prof, n_resamples, confidence, seed)
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
                     "context_ci_low": mean_low[li, 0], "context_ci_high": mean_high[li, 0],
                     "loss_mean": prof.means[li, loss], "loss_ci_low": mean_low[li, 1],
                     "loss_ci_high": mean_high[li, 1], "context_share": share[li], "share_ci_low": share_low[li],
                     "share_ci_high": share_high[li], "n_context": n_context, "n_loss": n_loss,
                     "exact_zero": bool(context_sums[li] == 0.0)})
    return rows


def _context_share(prof: RoleProfile, n_resamples: int, confidence: float,
                   seed: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(share, low, high), each (L,): the context positions' summed gradient norms over those of context and loss
    positions, pooled over the bin's sequences, with the percentile interval of the same resamples as the ratio's."""
    roles = prof.cube.roles
    sums = np.stack([prof.cube.sums[..., roles.index("context")],
                     prof.cube.sums[..., [i for i, r in enumerate(roles) if r in LOSS_ROLES]].sum(axis=-1)], axis=-1)
    reps = bootstrap_sums(sums, n_resamples, seed)  # (B, L, 2): the resample weights depend on (S, B, seed) only
    with np.errstate(divide="ignore", invalid="ignore"):
        share = sums[:, :, 0].sum(axis=0) / sums.sum(axis=(0, 2))
        rep_share = reps[..., 0] / reps.sum(axis=-1)
    low, high = percentile_interval(rep_share, confidence)
    return share, low, high


__all__ = ["DEFAULT_BINS", "LEFT_OUT_REASONS", "MAX_GRID_VALUES", "MaskRatioSelection", "mask_ratio_bins",
           "mask_ratio_drawn", "mask_ratio_selection", "ratio_by_mask_ratio"]
