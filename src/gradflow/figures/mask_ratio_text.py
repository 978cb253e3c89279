"""The gradient flow by masking ratio (masked diffusion) in words: its ``summary.md`` section and its LaTeX table.

Both read the table of :func:`gradflow.analysis.ratio_by_mask_ratio` (the report's
``tables/mask_ratio_profile.csv``); the figure is :mod:`gradflow.figures.mask_ratio`.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from gradflow.figures.mask_ratio import MASK_RATIO_TABLE
from gradflow.figures.report_tables import mask_ratio_table, t_label
from gradflow.figures.tables import TextTable, latex_label, markdown_table
from gradflow.formatting import format_estimate
from gradflow.schema import MASK_RATIOS_FILE


def mask_ratio_section(tables: dict[str, pd.DataFrame], n_resamples: int, seed: int | None) -> list[str]:
    """Lines of the ``summary.md`` section on the gradient flow by masking ratio (none without the table)."""
    table = tables.get(MASK_RATIO_TABLE)
    if table is None:
        return []
    lines = ["## Gradient flow by masking ratio t (masked diffusion)", ""]
    if table.empty:
        return lines + [f"No bin of t has both context and loss positions ({MASK_RATIOS_FILE}): nothing to show.", ""]
    grid = bool((table["t_low"] == table["t_high"]).all())
    per_bin = table.groupby(["t_low", "t_high"])["n_sequences"].max()
    bins = ("each masking ratio of the run's grid is a bin" if grid else
            f"t in {len(per_bin)} equal-width bins of [0, 1]" if _equal_width(per_bin.index) else
            f"t in {len(per_bin)} bins")
    lines += [("Per block output, the context / loss-position gradient-norm ratio over the sequences of each "
               f"masking ratio t ({bins}; sequences per bin: {', '.join(str(int(n)) for n in per_bin)}): the mean "
               "gradient norm of context positions (unmasked) over that of the loss positions (masked), each pooled "
               f"over positions; 95% percentile bootstrap CIs over the bin's sequences ({n_resamples} resamples, "
               f"seed {seed}); 0 is exactly zero."), ""]
    lines += _headline(table) + [""]
    return lines + markdown_table(mask_ratio_table(table)) + [""]


LATEX_INTERVAL_BINS: dict[str, int] = {"page": 4, "wide": 4, "column": 3}
"""Most bins of t whose LaTeX table still carries the intervals in each layout (more: the estimates alone)."""


def mask_ratio_latex(tables: dict[str, pd.DataFrame], model: str, layout: str, n_resamples: int,
                     seed: int | None) -> list[TextTable]:
    """The LaTeX table of the gradient flow by t (none without it): ratios per layer and bin, with their CIs when
    there are at most :data:`LATEX_INTERVAL_BINS` bins for ``layout`` (so that it fits), else the estimates."""
    table = tables.get(MASK_RATIO_TABLE)
    if table is None or table.empty:
        return []
    n_bins = table[["t_low", "t_high"]].drop_duplicates().shape[0]
    intervals = n_bins <= LATEX_INTERVAL_BINS.get(layout, 4)
    ci = (f"95% sequence-bootstrap CIs ({n_resamples} resamples, seed {seed})" if intervals else
          f"95% sequence-bootstrap CIs in tables/{MASK_RATIO_TABLE}.csv")
    caption = (f"{model}: context / loss-position gradient-norm ratio per layer (0: the embeddings) and masking "
               f"ratio t, masked diffusion ({ci}; 0: exactly zero).")
    return [replace(mask_ratio_table(table, intervals), name="mask_ratio", caption=caption,
                    label=latex_label("mask-ratio", model))]


def _equal_width(bins: pd.Index) -> bool:
    """Whether the (t_low, t_high) bins are equal-width bins of [0, 1] (the default bins of drawn t)."""
    edges = np.array([[low, high] for low, high in bins], dtype=float)
    return bool(edges[0, 0] == 0 and edges[-1, 1] == 1 and np.allclose(np.diff(edges, axis=1), 1 / len(edges)))


def _headline(table: pd.DataFrame) -> list[str]:
    """Bullets: the layers whose context gradient is exactly 0 at every t, and the deepest other layer's range."""
    out = []
    n_bins = table[["t_low", "t_high"]].drop_duplicates().shape[0]
    zero = [int(k) for k, d in table.groupby("layer") if d["exact_zero"].all() and len(d) == n_bins]
    if zero:
        out.append(f"- Layer{'s' if len(zero) > 1 else ''} {', '.join(map(str, zero))}: the context gradient is "
                   f"exactly 0 at every t ({n_bins} bins; at the last block's output the head is position-wise, so "
                   "a context position gets no gradient there).")
    rest = table[~table["layer"].isin(zero)]
    if len(rest):
        deepest = rest[rest["layer"] == rest["layer"].max()].sort_values("t_mid")
        first, last = (_at(row) for row in (deepest.iloc[0], deepest.iloc[-1]))
        out.append(f"- Layer {int(deepest['layer'].iloc[0])} ({deepest['site'].iloc[0]}), the deepest with context "
                   f"gradient: {first}, {last}.")
    return out


def _at(row: pd.Series) -> str:
    """``0.105 [0.0951, 0.115] at t = 0.1``: a row's ratio and its bin."""
    return f"{format_estimate(*row[['ratio', 'ci_low', 'ci_high']])} at {t_label(row['t_low'], row['t_high'])}"


__all__ = ["LATEX_INTERVAL_BINS", "mask_ratio_latex", "mask_ratio_section"]
