"""``gradflow report``: figures and summary.md for one run (a probe directory: its probe figure, drawn again)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gradflow.cli.options import LAYOUT_RULE, add_figure_output, add_latex_layout, formats, latex_layout, probe_dirs


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``report``."""
    report = subparsers.add_parser(
        "report", help="figures and summary.md for one run",
        description=f"Figures, tables (CSV and LaTeX) and summary.md for one run. {LAYOUT_RULE}")
    report.add_argument("run_dir", help="a run directory written by `gradflow record`, or a probe directory "
                                        "(`gradflow probe`: its figure is drawn again)")
    add_figure_output(report, width=True)
    add_latex_layout(report)
    report.set_defaults(run=run)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Write the report and print how many files it has."""
    from gradflow.figures.report import write_report

    width = str(args.width)
    if probe_dirs([args.run_dir]):  # a gradflow probe directory: its probe figure, drawn again into --out
        from gradflow.figures.probes import write_probe_figures

        paths = write_probe_figures([args.run_dir], None, args.out, formats=formats(args.format), width=width)
    else:
        paths = write_report(args.run_dir, args.out, formats=formats(args.format), width=width,
                             latex_layout=latex_layout(args))
    print(f"wrote {len(paths)} files to {args.out}")
    return 0
