"""gradflow.progress: frequent redraws on a terminal or in Jupyter, rare ones into a log file."""

from __future__ import annotations

import io
import sys

from gradflow.progress import LOG_INTERVAL_S, TERMINAL_INTERVAL_S, progress_bar, redraw_interval


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_interval_follows_where_stderr_goes(monkeypatch):
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert redraw_interval() == LOG_INTERVAL_S
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert redraw_interval() == TERMINAL_INTERVAL_S
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.setitem(sys.modules, "ipykernel", object())
    assert redraw_interval() == TERMINAL_INTERVAL_S


def test_a_bar_into_a_log_draws_at_start_and_end_only(monkeypatch):
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    bar = progress_bar(total=500, desc="steps", file=log)
    for step in range(500):
        bar.update(1)
        bar.set_postfix(step=step, refresh=False)
    bar.close()
    assert 1 <= log.getvalue().count("steps:") <= 3
    assert progress_bar(total=1, file=io.StringIO(), mininterval=5).mininterval == 5  # the caller may choose
