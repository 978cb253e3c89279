"""The ``gradflow`` command line: one module per command, named after it; each parses, calls the library, prints."""

from gradflow.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
