"""``gradflow diagnose``: representation diagnostics per layer and role over a corpus (tables and figures)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gradflow.cli.options import add_checkpointing, add_corpus, add_figure_output, add_model, command_line, formats


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``diagnose``."""
    diagnose = subparsers.add_parser("diagnose", help="representation diagnostics per layer and role over a corpus")
    add_model(diagnose)
    add_corpus(diagnose, seed_meaning="random seed of the masking and of the probes' samples")
    add_figure_output(diagnose)
    diagnose.add_argument("--overwrite", action="store_true",
                          help="start over in an --out that holds an unfinished run's checkpoints (they are removed)")
    add_checkpointing(diagnose)
    diagnose.set_defaults(run=run)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Diagnose, draw, and print how many tables and figures were written."""
    from gradflow.figures.diagnostics import plot_diagnostics
    from gradflow.models import load_model
    from gradflow.runs.diagnose import diagnose_corpus

    tables = diagnose_corpus(load_model(args.model), args.texts, args.out, max_length=args.max_length,
                             batch_size=args.batch_size, limit=args.limit, seed=args.seed,
                             command=command_line(argv), resume=args.resume, overwrite=args.overwrite,
                             checkpoint_every=args.checkpoint_every, checkpoint_minutes=args.checkpoint_minutes)
    paths = plot_diagnostics(tables, args.out, formats(args.format))
    print(f"wrote {len(tables)} tables and {len(paths)} figures to {args.out}")
    return 0
