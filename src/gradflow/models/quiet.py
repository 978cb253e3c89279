"""Quiet loading: transformers' load report silenced where it means nothing to the user."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' log below errors inside the block (its load report: an expected missing
    task head, an unused pooler), restoring the previous verbosity on exit, also on exceptions."""
    from transformers.utils import logging as hf_logging  # on use: `import gradflow` stays light

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


__all__ = ["quiet_transformers"]
