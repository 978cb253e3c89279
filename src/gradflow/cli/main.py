"""The ``gradflow`` command line: parser assembly, dispatch and exit codes.

Each command lives in the module of its name (``gradflow record`` in :mod:`gradflow.cli.record`), which
has ``add_parser(subparsers)`` and ``run(args, argv)``: it parses, calls the library and prints; options
several commands share come from :mod:`gradflow.cli.options`. Exit codes: 0 success; 2 bad input (one line,
``gradflow: error: ...``, no traceback: every :class:`~gradflow.errors.GradflowError`, including
out-of-range options); 130 interrupted (partial results flushed and marked ``"complete": false``).
``gradflow --version`` prints gradflow's version and those of torch, transformers and Python, and exits 0.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence
from importlib import metadata

from gradflow.cli import (
    atlas,
    channels,
    check,
    compare,
    demo,
    diagnose,
    explore,
    finetune,
    probe,
    record,
    repair,
    report,
    surgery,
    tasks,
    zoo,
)
from gradflow.errors import GradflowError
from gradflow.version import __version__

COMMAND_MODULES = (record, demo, report, compare, channels, diagnose, zoo, tasks, surgery, finetune, repair, probe,
                   check, atlas, explore)
"""One module per command, named after it, in the order ``gradflow --help`` lists them."""


def version_text() -> str:
    """``gradflow 0.1.0 (torch 2.x, transformers 4.x, Python 3.x)``: installed versions read from package
    metadata, so that ``--version`` stays fast (torch is not imported); a missing package reads ``not installed``."""
    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"
    return (f"gradflow {__version__} (torch {installed('torch')}, transformers {installed('transformers')}, "
            f"Python {platform.python_version()})")


class _VersionAction(argparse.Action):
    """``--version``: print :func:`version_text` and exit 0 (argparse's own action would need the text when
    the parser is built, that is on every command)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    """The ``gradflow`` parser with every command registered."""
    parser = argparse.ArgumentParser(prog="gradflow", description="Where the training signal of a masked LM goes.")
    parser.add_argument("--version", action=_VersionAction,
                        help="print gradflow's version (and torch's, transformers', Python's) and exit")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradflow`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = None
    try:
        args = build_parser().parse_args(argv)
        return args.run(args, argv)
    except GradflowError as err:
        print(f"gradflow: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        where = getattr(args, "out", None)
        print(f"gradflow: {err or 'interrupted (SIGINT)'}; what was recorded so far is in {where} with "
              '"complete": false in meta.json', file=sys.stderr)
        return 130
    except RuntimeError as err:  # torch.OutOfMemoryError derives from RuntimeError; importing torch here would
        if "out of memory" not in str(err).lower():  # make `gradflow --help` slow
            raise
        where = getattr(args, "out", None)
        print(f"gradflow: error: out of memory on {getattr(args, 'device', None) or 'the device'}: pass a smaller "
              "--batch-size or --max-length (or --dtype bfloat16 on a GPU)"
              + (f"; what was recorded so far is in {where} with \"complete\": false in meta.json" if where else "")
              + f". ({str(err).splitlines()[0][:200]})", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
