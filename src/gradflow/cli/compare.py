"""``gradflow compare``: figures and summary.md across runs, or probe figures and paired drop differences across
probe directories."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from gradflow.cli.options import LAYOUT_RULE, add_figure_output, add_latex_layout, formats, latex_layout, probe_dirs
from gradflow.errors import UsageError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``compare``."""
    compare = subparsers.add_parser("compare", help="figures and summary.md across runs",
                                    description="Figures, tables (CSV and LaTeX) and summary.md across runs. "
                                                + LAYOUT_RULE)
    compare.add_argument("run_dirs", nargs="+", help="two or more run directories (the first is the baseline), or "
                                                     "two or more probe directories written by `gradflow probe`")
    compare.add_argument("--labels", nargs="+", default=None, help="one label per run (default: directory names)")
    compare.add_argument("--mask-ratio", default=None, metavar="T|LOW,HIGH",
                         help="masked-diffusion runs: compare only their sequences of this masking ratio t (a grid "
                              "value, e.g. 0.15) or bin of t (LOW,HIGH: [LOW, HIGH)); other runs stay whole. Default: "
                              "every t pooled, said in each diffusion run's label")
    add_figure_output(compare, width=True)
    add_latex_layout(compare)
    compare.set_defaults(run=run)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Write the comparison and print how many files it has."""
    from gradflow.figures.report import write_comparison

    _check_comparable(args.run_dirs)
    if probe_dirs(args.run_dirs):
        from gradflow.figures.probes import write_probe_figures

        if args.mask_ratio is not None:
            raise UsageError("--mask-ratio selects masked-diffusion runs' sequences by t; probe directories have "
                             "none: leave it out.")

        paths = write_probe_figures(args.run_dirs, args.labels, args.out, formats=formats(args.format),
                                    width=str(args.width))
        paths.extend(_probe_differences(args))
    else:
        paths = write_comparison(args.run_dirs, args.labels, args.out, formats=formats(args.format),
                                 width=str(args.width), latex_layout=latex_layout(args),
                                 mask_ratio=_t_selection(args.mask_ratio))
    print(f"wrote {len(paths)} files to {args.out}")
    return 0


def _probe_differences(args: argparse.Namespace) -> list[Path]:
    """Write and print each probe directory's last-layer drop minus the baseline's (paired CIs), and ``tables.tex``
    (each directory's drop and the paired differences)."""
    from gradflow.analysis.probe_tables import probe_drop_differences
    from gradflow.runs.files import write_csv
    from gradflow.runs.probe_tables import write_comparison_tables
    from gradflow.schema import PROBE_DIFFERENCE_COLUMNS, PROBE_DIFFERENCES_FILE

    result = probe_drop_differences(args.run_dirs, args.labels)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    tables = write_comparison_tables(args.run_dirs, args.labels, args.out, result.table)
    if result.table.empty:
        return [tables]
    for row in result.table.itertuples():
        print(f"{row.regime:9s} last-layer accuracy drop, {row.label} - {row.baseline}: {row.difference:+.4f} "
              f"[{row.ci_low:+.4f}, {row.ci_high:+.4f}] ({row.n_words} words, {row.n_sentences} sentences)")
    path = Path(args.out) / PROBE_DIFFERENCES_FILE
    write_csv(result.table, path, PROBE_DIFFERENCE_COLUMNS)
    return [path, tables]


def _t_selection(text: str | None):
    """``--mask-ratio`` as a :class:`gradflow.analysis.by_t.TSelection` (None: every t pooled)."""
    if text is None:
        return None
    from gradflow.analysis.by_t import parse_t_selection

    try:
        return parse_t_selection(text)
    except ValueError as err:
        raise UsageError(f"--mask-ratio: {err}.") from None


def _check_comparable(run_dirs: Sequence[str]) -> None:
    """A comparison needs two runs; a single one is what ``gradflow report`` is for."""
    if len(run_dirs) < 2:
        raise UsageError(f"gradflow compare needs at least two run directories, got {len(run_dirs)}; for a single "
                         "run use `gradflow report RUN_DIR --out DIR`.")
