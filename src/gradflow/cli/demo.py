"""``gradflow demo``: record the 6-block embedded pair on the committed sample and write their reports (offline)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gradflow.cli.options import add_limit, command_line


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``demo``."""
    demo = subparsers.add_parser("demo", help="record the 6-block embedded pair on the committed sample (offline)")
    demo.add_argument("--out", required=True, help="output directory (one run directory per model)")
    add_limit(demo, "sequences per run", unset="the whole sample")
    demo.add_argument("--overwrite", action="store_true", help="replace the run files in a non-empty --out")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.set_defaults(run=run)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run the demo."""
    from gradflow.runs.demo import run_demo

    run_demo(args.out, limit=args.limit, overwrite=args.overwrite, quiet=args.quiet, command=command_line(argv))
    return 0
