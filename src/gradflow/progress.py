"""Progress bars that suit both a terminal and a log file.

On a terminal or in Jupyter (a widget there, through ``tqdm.auto``) a bar redraws up to 10 times a
second. When stderr is a file or a pipe (a cluster job's log, ``2> log``), it draws at most once
every 30 s and at the end, so a long run leaves a few lines in the log instead of one per batch.
"""

from __future__ import annotations

import sys

TERMINAL_INTERVAL_S = 0.1
LOG_INTERVAL_S = 30.0


def redraw_interval() -> float:
    """Seconds between redraws: short on a terminal or in a Jupyter kernel, long into a log file."""
    interactive = sys.stderr.isatty() or "ipykernel" in sys.modules
    return TERMINAL_INTERVAL_S if interactive else LOG_INTERVAL_S


def progress_bar(*args, **kwargs):
    """A ``tqdm.auto`` bar (same arguments) with :func:`redraw_interval` as its ``mininterval``.

    Update its postfix with ``set_postfix(..., refresh=False)``: a forced refresh ignores the interval."""
    from tqdm.auto import tqdm

    kwargs.setdefault("mininterval", redraw_interval())
    return tqdm(*args, **kwargs)


__all__ = ["LOG_INTERVAL_S", "TERMINAL_INTERVAL_S", "progress_bar", "redraw_interval"]
