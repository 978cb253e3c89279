"""``gradflow surgery``: drop or re-initialise the last blocks of a masked LM and save the result."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gradflow.cli.options import add_blocks, add_model, add_seed


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``surgery``."""
    surgery = subparsers.add_parser("surgery", help="drop or re-initialise the last blocks and save the result")
    add_model(surgery, required=True)
    add_blocks(surgery)
    add_seed(surgery, meaning="random seed of the re-initialisation")
    surgery.add_argument("--out", required=True, help="output model directory")
    surgery.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    surgery.set_defaults(run=run)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Operate, save and print where the model went."""
    from gradflow.interventions.surgery import surgery_to_dir

    path = surgery_to_dir(args.model, args.out, drop_last=args.drop_last, reinit_last=args.reinit_last, seed=args.seed,
                          overwrite=args.overwrite)
    print(f"wrote {path}")
    return 0
