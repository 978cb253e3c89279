"""Progress bars that suit both a terminal and a log file.

On a terminal or in Jupyter (a widget there, through ``tqdm.auto``) a bar redraws up to 10 times a
second. When stderr is a file or a pipe (a cluster job's log, ``2> log``), it draws at most once
every 30 s and at the end, so a long run leaves a few lines in the log instead of one per batch.
A terminal that reports no size (a pseudo-terminal opened without one, as ``docker run -t`` gives a
script) gets an 80 x 24 bar: fitted to the reported 0 x 0, tqdm would draw nothing (it reads the height
as -1 rows and hides every bar below it).
"""

from __future__ import annotations

import os
import sys

TERMINAL_INTERVAL_S = 0.1
LOG_INTERVAL_S = 30.0
TQDM_MAXINTERVAL_S = 10.0  # tqdm's default: its monitor thread redraws a bar idle this long
FALLBACK_COLUMNS = 80
FALLBACK_ROWS = 24


def redraw_interval() -> float:
    """Seconds between redraws: short on a terminal or in a Jupyter kernel, long into a log file."""
    try:
        terminal = sys.stderr.isatty()
    except (AttributeError, ValueError):  # no isatty (a replaced stream) or closed
        terminal = False
    interactive = terminal or "ipykernel" in sys.modules
    return TERMINAL_INTERVAL_S if interactive else LOG_INTERVAL_S


def terminal_columns(stream) -> int | None:
    """The width in columns of the terminal ``stream`` writes to; None when it is not a terminal."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # no fileno (StringIO, Jupyter), not a terminal, closed
        return None


def progress_bar(*args, **kwargs):
    """A ``tqdm.auto`` bar (same arguments) with :func:`redraw_interval` as its ``mininterval``, and
    :data:`FALLBACK_COLUMNS` x :data:`FALLBACK_ROWS` on a terminal that reports a width of 0.

    Update its postfix with ``set_postfix(..., refresh=False)``: a forced refresh ignores the interval."""
    from tqdm.auto import tqdm

    interval = kwargs.setdefault("mininterval", redraw_interval())
    kwargs.setdefault("maxinterval", max(interval, TQDM_MAXINTERVAL_S))  # the monitor: never sooner than ours
    if kwargs.get("ncols") is None and terminal_columns(kwargs.get("file") or sys.stderr) == 0:
        kwargs.update(ncols=FALLBACK_COLUMNS, dynamic_ncols=False)
        if kwargs.get("nrows") is None:  # tqdm reads the 0 rows as -1 and draws no bar at all
            kwargs["nrows"] = FALLBACK_ROWS
    return tqdm(*args, **kwargs)


__all__ = ["FALLBACK_COLUMNS", "FALLBACK_ROWS", "LOG_INTERVAL_S", "TERMINAL_INTERVAL_S", "TQDM_MAXINTERVAL_S",
           "progress_bar", "redraw_interval", "terminal_columns"]
