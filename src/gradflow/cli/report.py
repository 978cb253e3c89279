"""``gradflow report``: figures and summary.md for one run (a probe directory: its probe figure, drawn again)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gradflow.cli.options import DEFAULT_FIGURE_WIDTH, add_figure_output, add_latex_layout, formats, probe_dirs


class _Default(str):
    """An option's default, kept by argparse as given, so that :func:`run` tells it from the same value typed."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``report``."""
    report = subparsers.add_parser(
        "report", help="figures and summary.md for one run",
        description="Figures, tables (CSV and LaTeX) and summary.md for one run. The LaTeX tables' layout is "
                    "--latex-layout when given; else a --width given picks it (single: column, one column of a "
                    "two-column paper; double: wide); else page.")
    report.add_argument("run_dir", help="a run directory written by `gradflow record`, or a probe directory "
                                        "(`gradflow probe`: its figure is drawn again)")
    add_figure_output(report, width=True)
    add_latex_layout(report)
    report.set_defaults(run=run, width=_Default(DEFAULT_FIGURE_WIDTH), latex_layout=_Default("page"))


def latex_layout(args: argparse.Namespace) -> str:
    """``--latex-layout`` when given; else the layout a ``--width`` given suggests (``single``: ``column``,
    ``double``: ``wide``); else ``page``."""
    from gradflow.figures.report_tables import layout_for_width

    if not isinstance(args.latex_layout, _Default):
        return args.latex_layout
    return layout_for_width(args.width) if not isinstance(args.width, _Default) else str(args.latex_layout)


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
