"""Ctrl-C (SIGINT) during a corpus job: a request to stop at the next batch boundary.

Python turns SIGINT into ``KeyboardInterrupt`` wherever the main thread happens to be, and an
exception raised inside a finaliser or a callback run from C is printed and dropped: the job then
runs on to the end as if nothing happened. While :func:`stop_on_sigint` is active, the first SIGINT
only sets :attr:`StopRequest.requested` (and says so on stderr); the job's batch loop checks it
between batches and ends there, so the partial results always end at a whole batch. A second SIGINT
raises ``KeyboardInterrupt`` at once, as without the handler. The handler is installed only in the
main thread and only over Python's default one (a SIGINT that is ignored, as in a shell's
background job, or handled by someone else, is left as it is); the previous handler comes back on exit.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class StopRequest:
    """Whether SIGINT asked the running job to stop (``requested``)."""

    requested: bool = False


@contextmanager
def stop_on_sigint() -> Iterator[StopRequest]:
    """Inside: the first SIGINT sets the yielded request's ``requested``; a second raises ``KeyboardInterrupt``."""
    request = StopRequest()
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield request
        return

    def on_sigint(signum: int, frame: object) -> None:
        if request.requested:
            raise KeyboardInterrupt
        request.requested = True
        print("\ngradflow: interrupted: stopping after this batch and writing what was done "
              "(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield request
    finally:
        signal.signal(signal.SIGINT, previous)


__all__ = ["StopRequest", "stop_on_sigint"]
