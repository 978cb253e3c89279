"""``gradflow explore``: the channel view as a local web page (type a sentence, click tokens to mask them)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gradflow.cli.options import AT_LEAST_ONE, add_device, add_number, add_objective, model_help, objective_from_args
from gradflow.errors import UsageError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``explore``."""
    parser = subparsers.add_parser("explore", help="interactive channel view in the browser (local web app)")
    parser.add_argument("--model", nargs="+", default=None, metavar="MODEL",
                        help="models the page may choose among, each an " + model_help(None)
                             + " (default: the embedded models); the page can never name another")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; another address exposes the "
                             "explorer to the network)")
    add_number(parser, "--port", int, AT_LEAST_ONE, "port to listen on", 8765)
    add_number(parser, "--max-tokens", int, AT_LEAST_ONE, "longest sentence shown, in tokens (special tokens included)", 64)
    add_device(parser)
    add_objective(parser)  # what the page's "random" masking draws (its seed is the page's)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Serve the explorer until interrupted."""
    from gradflow.explore.server import serve
    from gradflow.explore.service import ExploreConfig, ExploreService
    from gradflow.models.embedded import installed_embedded_models

    if args.port > 65535:
        raise UsageError(f"--port must be at most 65535, got {args.port}")
    models = tuple(dict.fromkeys(args.model or installed_embedded_models()))  # (the companion's only when installed)
    service = ExploreService(ExploreConfig(models=models, max_tokens=args.max_tokens, device=args.device,
                                           objective=objective_from_args(args)))
    service.load_all(progress=lambda name: print(f"gradflow explore: loading {name}", file=sys.stderr))
    try:
        serve(service, host=args.host, port=args.port)
    except KeyboardInterrupt:
        pass
    return 0
