"""The gradient flow by masking ratio (masked diffusion) in words: its ``summary.md`` section and its LaTeX table.

Both read the table of :func:`gradflow.analysis.ratio_by_mask_ratio` (the report's
``tables/mask_ratio_profile.csv``) and, when given, its :class:`~gradflow.analysis.mask_ratio.MaskRatioSelection`
(how t was binned, which sequences were left out and why); the figure is :mod:`gradflow.figures.mask_ratio`.
The LaTeX table carries every ratio with its interval, its bins of t split into panels that fit the layout
(:func:`gradflow.figures.tables.fit_columns`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from gradflow.analysis.mask_ratio import LEFT_OUT_REASONS, MaskRatioSelection
from gradflow.figures.mask_ratio import MASK_RATIO_TABLE
from gradflow.figures.report_tables import mask_ratio_table, t_label
from gradflow.figures.tables import TextTable, fit_columns, latex_label, markdown_table
from gradflow.formatting import format_estimate, format_number
from gradflow.schema import MASK_RATIOS_FILE


LEFT_OUT_TEXT: dict[str, str] = {
    "outside": "a masking ratio outside every bin",
    "no_loss": ("no loss position (no token masked: a small t on a short sequence or response; its gradient is all "
                "zeros)"),
    "no_context": "no context position in their bin (every token masked, as at t = 1: no ratio)",
}
"""Each reason of :data:`gradflow.analysis.mask_ratio.LEFT_OUT_REASONS` in a summary's words."""


def mask_ratio_section(tables: dict[str, pd.DataFrame], n_resamples: int, seed: int | None,
                       selection: MaskRatioSelection | None = None) -> list[str]:
    """Lines of the ``summary.md`` section on the gradient flow by masking ratio (none without the table); with the
    table's ``selection``, how t was binned and how many sequences were left out, and why."""
    table = tables.get(MASK_RATIO_TABLE)
    if table is None:
        return []
    lines = ["## Gradient flow by masking ratio t (masked diffusion)", ""]
    left = [left_out_sentence(selection, LEFT_OUT_TEXT), ""] if selection is not None else []
    if table.empty:
        return lines + [f"No bin of t has both context and loss positions ({MASK_RATIOS_FILE}): nothing to show.",
                        "", *left]
    bins, per_bin = bins_text(table, selection)
    empty = " (a bin without sequences has no column)" if 0 in per_bin else ""
    lines += [("Per block output, the context / loss-position gradient-norm ratio over the sequences of each "
               f"masking ratio t ({bins}; sequences per bin: {', '.join(map(str, per_bin))}{empty}): the mean "
               "gradient norm of context positions (unmasked) over that of the loss positions (masked), each pooled "
               f"over positions; 95% percentile bootstrap CIs over the bin's sequences ({n_resamples} resamples, "
               f"seed {seed}); 0 is exactly zero."), "", *left]
    lines += _headline(table) + [""]
    return lines + markdown_table(mask_ratio_table(table)) + [""]


def mask_ratio_latex(tables: dict[str, pd.DataFrame], model: str, layout: str, n_resamples: int,
                     seed: int | None, selection: MaskRatioSelection | None = None, tag: str = "") -> list[TextTable]:
    """The LaTeX table of the gradient flow by t (none without it): the ratio per layer and bin with its CI, the
    bins split into panels that fit ``layout`` (:func:`gradflow.figures.tables.fit_columns`); the caption names the
    bins and, given the ``selection``, the sequences left out. Label: ``mask-ratio``, ``model`` and ``tag``."""
    table = tables.get(MASK_RATIO_TABLE)
    if table is None or table.empty:
        return []
    bins, _ = bins_text(table, selection)
    left = ""
    if selection is not None and selection.n_left_out:
        left = "; " + left_out_sentence(selection, LEFT_OUT_REASONS).removesuffix(".")
    caption = (f"{model}: context / loss-position gradient-norm ratio per layer (rows; 0: the embeddings) and "
               f"masking ratio t (columns), masked diffusion, {bins} (95% sequence-bootstrap CIs, {n_resamples} "
               f"resamples, seed {seed}; 0: exactly zero{left}).")
    text = mask_ratio_table(table)
    if layout == "column":  # bare bins (0.2–0.4, 0.5): a header of one column stacks at 8 characters
        text = replace(text, header=(text.header[0], *(h.removeprefix("t = ").removeprefix("t ")
                                                       for h in text.header[1:])))
    return [replace(fit_columns(text, layout), name="mask_ratio", caption=caption,
                    label=latex_label("mask-ratio", model, tag))]


def bins_text(table: pd.DataFrame, selection: MaskRatioSelection | None) -> tuple[str, list[int]]:
    """(how t was binned, in words; the sequences of each bin): from the ``selection`` when given (meta.json says
    whether t came from a grid), else guessed from the table's bins (sequences: the most at any layer)."""
    if selection is None:
        per_bin = table.groupby(["t_low", "t_high"])["n_sequences"].max()
        grid = bool((table["t_low"] == table["t_high"]).all())
        return ("each masking ratio of the run's grid is a bin" if grid else
                f"t in {len(per_bin)} equal-width bins of [0, 1]" if _equal_width(per_bin.index) else
                f"t in {len(per_bin)} bins"), [int(n) for n in per_bin]
    per_bin = [len(m) for m in selection.members]
    n = len(per_bin)
    if selection.scheme == "values":
        text = ("t fixed for every sequence" if n == 1 and selection.drawn is False else
                "t from the run's grid, each value a bin" if selection.drawn is False else
                "each distinct t a bin")
    elif selection.scheme == "equal":
        text = f"{'t drawn per sequence, in' if selection.drawn else 't in'} {n} equal-width bins of [0, 1]"
    else:
        edges = [*selection.lows, selection.highs[-1]]
        text = f"t in {n} bins, edges {', '.join(format_number(e) for e in edges)}"
    return text, per_bin


def left_out_sentence(selection: MaskRatioSelection, reasons: dict[str, str]) -> str:
    """``1 of 200 sequences left out: 1 with no loss position (...).`` (each reason in ``reasons``' words), or that
    none was."""
    if not selection.n_left_out:
        return f"No sequence left out: each of the {selection.n_sequences} has loss and context positions."
    return (f"{selection.n_left_out} of {selection.n_sequences} sequences left out: "
            + "; ".join(f"{n} with {reasons[reason]}" for reason, n in selection.left_out) + ".")


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


__all__ = ["LEFT_OUT_TEXT", "bins_text", "left_out_sentence", "mask_ratio_latex", "mask_ratio_section"]
