"""Reports: every figure of a run (or a comparison of runs) plus a Markdown summary with provenance.

:func:`write_report` and :func:`write_comparison` raise :class:`gradflow.analysis.RunError` for a
missing or malformed run directory and for runs that cannot be compared (different tokenizers).
Runs with ``complete = false`` get a warning banner on every figure and at the top of
``summary.md``. The metric tables behind the figures are written as CSV next to them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.artist import Artist

from gradflow.analysis import (
    Comparison,
    Run,
    RunError,
    channel_quantiles,
    compare_runs,
    last_block_deficit,
    layer_tests,
    load_run,
    role_profile,
    role_ratios,
    sublayer_shares,
)
from gradflow.analysis.atlas import last_block_sharing, shared_context_shares
from gradflow.analysis.by_t import TSelection, t_scope
from gradflow.analysis.mask_ratio import mask_ratio_selection
from gradflow.figures import canvas
from gradflow.figures.comparison import comparison_last_block, comparison_profiles, comparison_ratios
from gradflow.figures.comparison_scope import ScopedRuns, runs_table, scope_notes, scope_runs
from gradflow.figures.mask_ratio import MASK_RATIO_FIGURE, MASK_RATIO_TABLE, mask_ratio_panels, mask_ratio_tables
from gradflow.figures.mask_ratio_text import mask_ratio_latex, mask_ratio_section
from gradflow.figures.pressure import PRESSURE_FIGURE, pressure_bars, pressure_csv, pressure_section, pressure_tables
from gradflow.figures.profiles import depth_profile, distribution_ranges, ratio_heatmap
from gradflow.figures.report_moe import moe_section, moe_tables
from gradflow.figures.report_tables import (
    check_layout,
    comparison_last_table,
    comparison_ratio_table,
    deficit_table,
    layer_table,
    only_loss_role,
    provenance_table,
    run_tag,
    runs_tag,
    write_latex,
)
from gradflow.figures.style import DEFAULT_WIDTH, gradflow_style
from gradflow.figures.sublayers import last_block_bars, sublayer_heatmap
from gradflow.figures.tables import TextTable, latex_label, markdown_table
from gradflow.formatting import format_estimate, format_number, masking_label, objective_label
from gradflow.provenance import display_name
from gradflow.schema import COMPARISON_TABLES, REPORT_TABLES, conform

INCOMPLETE_NOTE = ("**Warning: incomplete run.** `meta.json` has `complete: false`: the run stopped before "
                   "the end of its corpus, so these numbers come from partial data and may change. Finish or "
                   "resume the run before citing them.")


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], caption: str = "", label: str = "") -> TextTable:
    return TextTable(tuple(header), tuple(tuple(row) for row in rows), caption, label)


# ----------------------------------------------------------------------------------------------
# Figures
# ----------------------------------------------------------------------------------------------

def _render(draw: Callable[[], list[Artist]], stem: Path, formats: Sequence[str], banner: str | None,
            width: str | float) -> list[Path]:
    """Draw one figure, add the banner if any, save it in every format and close it."""
    with gradflow_style(width):
        artists = draw()
        fig = _figure_of(artists)
        try:
            if banner:
                canvas.add_banner(fig, banner)
            return canvas.save_figure(fig, stem, formats)
        finally:
            plt.close(fig)


def _figure_of(artists: list[Artist]) -> plt.Figure:
    """The (root) figure the artists were drawn on."""
    for artist in artists:
        fig = getattr(artist, "figure", None)
        if fig is not None:
            return getattr(fig, "figure", None) or fig  # a SubFigure's .figure is its root figure
    raise RuntimeError("a plot function drew nothing")


def _incomplete_banner(labels: Sequence[str]) -> str:
    """Banner text naming the incomplete runs."""
    return f"INCOMPLETE RUN ({', '.join(labels)}): partial data, not for publication"


# ----------------------------------------------------------------------------------------------
# Single run
# ----------------------------------------------------------------------------------------------

def write_report(run_dir: str | Path, out_dir: str | Path, formats: Sequence[str] = ("pdf", "png"),
                 width: str | float = DEFAULT_WIDTH, n_resamples: int = 2000, seed: int = 0,
                 latex_layout: str = "page") -> list[Path]:
    """Write every single-run figure, the metric tables (CSV, and LaTeX: ``tables.tex`` with every table, and one
    ``latex/<name>.tex`` per table) and ``summary.md``; return the paths.

    ``latex_layout``: one of :data:`gradflow.figures.tables.LATEX_LAYOUTS` (``column`` for one column of a
    two-column paper). Raises :class:`RunError` when ``run_dir`` is missing or malformed.
    """
    check_layout(latex_layout)
    run = load_run(run_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    profile = role_profile(run, n_resamples=n_resamples, seed=seed)
    ratios = role_ratios(run, n_resamples=n_resamples, seed=seed)
    tests = layer_tests(run)
    shares = sublayer_shares(run)
    deficit = last_block_deficit(run)
    quantiles = channel_quantiles(run)
    pressure = pressure_tables([run], [run.label], n_resamples, seed)  # only under a loss other than mlm
    selection = mask_ratio_selection(run) if run.mask_ratios is not None else None  # the bins, the left out
    by_t = mask_ratio_tables(run, n_resamples, seed, selection)  # only with mask_ratios.parquet (masked diffusion)
    moe = moe_tables(run)  # only with experts.csv, router_aux.csv (mixtures of experts)
    banner = None if run.complete else canvas.INCOMPLETE_BANNER
    written: list[Path] = []
    figures: dict[str, Callable[[], list[Artist]]] = {
        "depth_profile": lambda: depth_profile(profile, width=width),
        "ratio_heatmap": lambda: ratio_heatmap(ratios, width=width),
        "last_block": lambda: last_block_bars(deficit, width=width),
        "distributions": lambda: distribution_ranges(quantiles, width=width),
        "context_coverage": lambda: sublayer_heatmap(shares, "coverage", width=width),
        "context_share": lambda: sublayer_heatmap(shares, "share", width=width),
        **({PRESSURE_FIGURE: lambda: pressure_bars(pressure, width=width)} if pressure else {}),
        **({MASK_RATIO_FIGURE: lambda: mask_ratio_panels(by_t[MASK_RATIO_TABLE], width=width)}
           if by_t and not by_t[MASK_RATIO_TABLE].empty else {}),
    }
    for name, draw in figures.items():
        if name == "last_block" and deficit.empty:
            continue
        written += _render(draw, out / name, formats, banner, width)
    tables = {"role_profile": profile, "role_ratios": ratios, "layer_tests": tests, "sublayer_shares": shares,
              "last_block": deficit, "channel_quantiles": quantiles, **pressure_csv(pressure), **by_t, **moe}
    written += _write_tables(out / "tables", tables, REPORT_TABLES)
    summary = out / "summary.md"
    summary.write_text(_summary(run, ratios, tests, deficit, list(figures), formats, n_resamples, seed, out,
                                [*pressure_section(pressure, n_resamples, seed),
                                 *mask_ratio_section(by_t, n_resamples, seed, selection),
                                 *moe_section(run, moe)]), encoding="utf-8")
    name, tag = display_name(run.meta.get("model") or run.path.name), run_tag(run.meta)
    ci = f"95% sequence-bootstrap CIs ({n_resamples} resamples, seed {seed})"
    sites = latex_layout != "column"
    masked = (" All loss positions are masked (no random or kept token), so masked / loss, identically 1, has no "
              "column." if only_loss_role(ratios) == "masked" else "")
    latex = [replace(layer_table(ratios, tests, sites=sites), name="ratios", label=latex_label("ratios", name, tag),
                     caption=f"{name}: context / loss-position gradient-norm ratio per layer "
                             f"({'' if sites else 'layer 0: the embeddings, layer k: block k; '}{ci}; 0: exactly "
                             f"zero); Mann-Whitney U test, Holm-corrected.{masked}")]
    if not deficit.empty:
        latex.append(replace(deficit_table(deficit, short=not sites), name="last_block",
                             label=latex_label("last-block", name, tag),
                             caption=f"{name}: context share of the last block's weight gradient per sublayer, "
                                     "against earlier blocks (0: exactly zero)."))
    latex += mask_ratio_latex(by_t, name, latex_layout, n_resamples, seed, selection, tag)
    return [summary, *write_latex(out, latex, "gradflow report", latex_layout), *written]


def _write_tables(folder: Path, tables: dict[str, pd.DataFrame], contract: Mapping[str, Sequence[str]]) -> list[Path]:
    """Write each table as CSV with the columns ``contract`` (the schema) gives it; return the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, frame in tables.items():
        path = folder / f"{name}.csv"
        conform(frame, contract[name], name).to_csv(path, index=False)
        paths.append(path)
    return paths


def _summary(run: Run, ratios: pd.DataFrame, tests: pd.DataFrame, deficit: pd.DataFrame, figures: list[str],
             formats: Sequence[str], n_resamples: int, seed: int, out: Path, extra: Sequence[str] = ()) -> str:
    """The Markdown summary of one run (written to ``out``)."""
    lines = [f"# gradflow report: {display_name(run.meta.get('model') or run.path.name)}", ""]
    if not run.complete:
        lines += [f"> {INCOMPLETE_NOTE}", ""]
    lines += _headline(run, ratios, deficit) + [""]
    lines += ["## Context vs loss positions, per layer", "",
              "Mean gradient norm of a role over the pooled loss-position mean (masked + random + kept, "
              "weighted by position count), at each block output; 95% percentile bootstrap CIs over "
              f"sequences ({n_resamples} resamples, seed {seed}). Rank test: Mann-Whitney U on per-sequence "
              "mean norms, context vs masked, "
              "Holm-corrected across layers; effect size = rank-biserial correlation (< 0: context smaller)."
              + (" All loss positions are masked (no random or kept token), so masked / loss is identically 1 and "
                 "has no column." if only_loss_role(ratios) == "masked" else ""), ""]
    lines += markdown_table(layer_table(ratios, tests)) + [""]
    if not deficit.empty:
        layer = int(deficit["layer"].iloc[0])
        lines += [f"## Last block (layer {layer}): context share of the weight-gradient signal", "",
                  "Share of the summed per-position gradient magnitude of each sublayer's weight that comes "
                  "from context channels, and coverage (fraction of context positions sending non-zero signal), "
                  "against the mean of the earlier blocks." + (" Weight-shared block: the shares of its last "
                  "application (headline: the shared weights')." if last_block_sharing(run.meta, layer) else ""), ""]
        lines += markdown_table(deficit_table(deficit)) + [""]
    lines += [*extra, *_figure_list(figures, formats), ""]
    lines += ["## Provenance", ""] + provenance_table(run, out) + [""]
    return "\n".join(lines)


def _headline(run: Run, ratios: pd.DataFrame, deficit: pd.DataFrame) -> list[str]:
    """Bullet points of the headline numbers."""
    ctx = ratios[ratios["role"] == "context"].sort_values("layer")
    scope = t_scope(run)  # a diffusion run's headline ratio pools its t
    lines = ["## Headline", ""]
    if len(ctx):
        first, last = ctx.iloc[0], ctx.iloc[-1]
        lines.append(f"- Context / loss gradient-norm ratio: {format_estimate(*first[['ratio', 'ci_low', 'ci_high']])} "
                     f"at layer {int(first['layer'])} ({first['site']}), "
                     f"{format_estimate(*last[['ratio', 'ci_low', 'ci_high']])} at layer {int(last['layer'])} "
                     f"({last['site']})" + (f"; {scope}, so not comparable with a fixed selection rate (by t: "
                                            "Gradient flow by masking ratio t, below)" if scope else "") + ".")
    if not deficit.empty:
        zero = deficit.loc[deficit["exact_zero"], "sublayer"].tolist()
        lines.append(f"- Last block: {len(zero)} of {len(deficit)} sublayers get exactly zero context signal"
                     + (f" ({', '.join(zero)})." if zero else "."))
        lines += _sharing_caveat(run, zero)
        rest = deficit[~deficit["exact_zero"]]
        if len(rest):
            lines.append("- Last-block sublayers that still learn from context: " + ", ".join(
                f"{s} {format_number(r)}× the earlier mean"
                for s, r in zip(rest["sublayer"], rest["ratio_to_earlier"])) + ".")
    n_sequences = run.sequences["sequence_index"].nunique()
    lines.append(f"- Objective: {objective_label(run.meta)} ({masking_label(run.meta.get('masking'))}; loss "
                 f"`{run.meta.get('loss')}`); {run.num_layers} blocks; {n_sequences} sequences."
                 + _sample_warning(n_sequences))
    return lines


def _sharing_caveat(run: Run, zero: list[str]) -> list[str]:
    """For a last block whose module is applied at earlier depths too (meta.json ``weight_sharing``): its zeros
    are per application; the shared weights' context share over all applications (sublayers.csv, weight)."""
    layers = last_block_sharing(run.meta, run.num_layers)
    if not zero or not layers:
        return []
    n = len(layers)
    consecutive = layers == list(range(layers[0], layers[-1] + 1))
    span = f"{layers[0]}-{layers[-1]}" if consecutive else ", ".join(map(str, layers))
    totals = shared_context_shares(run.sublayers, layers).set_index("sublayer")["total_context_share"]
    shares = ", ".join(f"{s} {format_number(100 * totals[s])}%" for s in zero if s in totals.index)
    return [f"- Weight sharing: layer {layers[-1]}'s block is one module applied at layers {span} ({n} applications), "
            f"so these zeros are per application: exactly 0 at the last depth; the shared weights: {shares} of their "
            f"gradient comes from context over all {n} applications (summed per-position magnitudes)."]


SMALL_SAMPLE = 30
"""Below this many sequences a percentile bootstrap's interval is rough (too narrow, unstable in its ends)."""


def _sample_warning(n_sequences: int) -> str:
    """The caveat a headline over ``n_sequences`` needs ('' from :data:`SMALL_SAMPLE` sequences on)."""
    if n_sequences < 2:
        return " One sequence gives no bootstrap interval (shown as –): record at least two."
    if n_sequences < SMALL_SAMPLE:
        return (f" **Small sample**: a bootstrap over {n_sequences} sequences gives rough intervals (too narrow, "
                f"unstable ends); record at least {SMALL_SAMPLE} (raise --limit) before quoting them.")
    return ""


def _figure_list(figures: list[str], formats: Sequence[str]) -> list[str]:
    """Links to the figures (PNG inline when written)."""
    lines = ["## Figures", ""]
    for name in figures:
        if "png" in formats:
            lines += [f"![{name}]({name}.png)", ""]
        else:
            lines.append(f"- [{name}]({name}.{formats[0]})")
    return lines


# ----------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------

def write_comparison(run_dirs: Sequence[str | Path], labels: Sequence[str] | None, out_dir: str | Path,
                     formats: Sequence[str] = ("pdf", "png"), width: str | float = DEFAULT_WIDTH, baseline: int = 0,
                     n_resamples: int = 2000, seed: int = 0, latex_layout: str = "page",
                     mask_ratio: TSelection | None = None) -> list[Path]:
    """Write the comparison figures, tables (CSV; LaTeX: ``tables.tex`` with every table and one
    ``latex/<name>.tex`` per table) and ``summary.md`` for several runs; return the paths.

    A masked-diffusion run's label gets what its numbers pool over t (``diffusion (pooled over t 0.1-0.9)``), on
    every figure and table; ``mask_ratio`` keeps only its sequences of one t or bin of t (``diffusion (t = 0.15)``),
    the other runs whole (:mod:`gradflow.figures.comparison_scope`).

    ``labels`` default to the run directory names; the first run is the baseline of the
    differences unless ``baseline`` says otherwise. Runs of different depths are compared at the
    same relative depth (:func:`gradflow.analysis.compare.matched_layers`). ``latex_layout``: as
    :func:`write_report`'s. Raises :class:`RunError` for a missing or malformed run directory and
    when the runs come from different tokenizers.
    """
    check_layout(latex_layout)
    if len(run_dirs) < 2:
        raise RunError(f"A comparison needs at least two run directories, got {len(run_dirs)}; use "
                       "write_report for a single run.")
    scoped = scope_runs([load_run(d) for d in run_dirs], labels, mask_ratio)
    runs = scoped.runs
    comp = compare_runs(runs, scoped.labels, baseline=baseline, n_resamples=n_resamples, seed=seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    incomplete = [lab for lab, run in zip(comp.labels, runs) if not run.complete]
    banner = _incomplete_banner(incomplete) if incomplete else None
    figures: dict[str, Callable[[], list[Artist]]] = {
        "compare_profiles": lambda: comparison_profiles(comp.profiles, comp.labels, width=width),
        "compare_ratios": lambda: comparison_ratios(comp, width=width),
        "compare_last_block": lambda: comparison_last_block(comp, width=width),
    }
    pressure = pressure_tables(runs, comp.labels, n_resamples, seed)  # when every run has it
    if pressure:
        figures["compare_" + PRESSURE_FIGURE] = lambda: pressure_bars(pressure, width=width)
    written: list[Path] = []
    for name, draw in figures.items():
        if name == "compare_last_block" and comp.last_block.empty:
            continue
        written += _render(draw, out / name, formats, banner, width)
    written += _write_tables(out / "tables", {
        "profiles": comp.profiles, "ratios": comp.ratios, "ratio_differences": comp.ratio_differences,
        "shares": comp.shares, "last_block": comp.last_block, "layer_tests": comp.tests, **pressure_csv(pressure)},
        COMPARISON_TABLES)
    summary = out / "summary.md"
    depths = {lab: run.num_layers for lab, run in zip(comp.labels, runs)}
    summary.write_text(_comparison_summary(scoped, comp, depths, incomplete, list(figures), formats, n_resamples,
                                           seed, out, pressure_section(pressure, n_resamples, seed)), encoding="utf-8")
    ci = f"95% sequence-bootstrap CIs ({n_resamples} resamples, seed {seed})"
    where = ("per layer" if len(set(depths.values())) == 1 else
             "at each relative depth (layer / blocks; the layers of each run in the second column), differences "
             "only where both runs have a layer at that depth")
    tag = runs_tag([run.meta for run in runs])
    latex = [replace(comparison_ratio_table(comp, depths), name="ratios",
                     label=latex_label("ratios", *comp.labels, tag),
                     caption=f"Context / loss-position gradient-norm ratio {where}, each run and its difference "
                             f"to {comp.baseline}; {ci}; 0: exactly zero.")]
    if not comp.last_block.empty:
        latex.append(replace(comparison_last_table(comp), name="last_block",
                             label=latex_label("last-block", *comp.labels, tag),
                             caption="Context share of the last block's weight gradient per sublayer (in "
                                     "parentheses: its ratio to the earlier blocks' mean; 0: exactly zero)."))
    return [summary, *write_latex(out, latex, "gradflow compare", latex_layout), *written]


def _comparison_summary(scoped: ScopedRuns, comp: Comparison, depths: Mapping[str, int], incomplete: list[str],
                        figures: list[str],
                        formats: Sequence[str], n_resamples: int, seed: int, out: Path,
                        extra: Sequence[str] = ()) -> str:
    """The Markdown summary of a comparison (written to ``out``)."""
    lines = ["# gradflow comparison: " + ", ".join(comp.labels), ""]
    if incomplete:
        lines += [f"> **Warning: incomplete run(s): {', '.join(incomplete)}.** Their `meta.json` has "
                  "`complete: false`: the numbers come from partial data and may change. Finish or resume "
                  "those runs before citing the comparison.", ""]
    runs = scoped.runs
    lines += ["## Runs", ""] + markdown_table(runs_table(scoped)) + [""] + scope_notes(scoped)
    same = len(set(depths.values())) == 1
    lines += [f"## Context / loss gradient-norm ratio, {'per layer' if same else 'by relative depth'} "
              f"(baseline: {comp.baseline})", "",
              f"Ratio [95% bootstrap CI over sequences; {n_resamples} resamples, seed {seed}] per run; "
              "differences are run − baseline with a bootstrap CI of the difference (paired when both runs "
              "measured the same sequences); 0 is exactly zero."
              + ("" if same else " The runs differ in depth ("
                 + "/".join(str(depths[lab]) for lab in comp.labels)
                 + " blocks), so rows are relative depths (layer / blocks) and each run's layer there is listed, in "
                   "the order of the runs; a "
                   "difference compares the layers at the same relative depth and is left out (–) where a run has "
                   "no layer at that depth."), ""]
    lines += markdown_table(comparison_ratio_table(comp, depths)) + [""]
    if not comp.last_block.empty:
        lines += ["## Last block: context share per sublayer", ""]
        lines += markdown_table(comparison_last_table(comp)) + [""]
    lines += [*extra, *_figure_list(figures, formats), ""]
    lines += ["## Provenance", ""]
    for lab, run in zip(comp.labels, runs):
        lines += [f"### {lab}", ""] + provenance_table(run, out) + [""]
    return "\n".join(lines)


__all__ = ["INCOMPLETE_NOTE", "write_comparison", "write_report"]
