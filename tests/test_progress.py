"""gradflow.progress: frequent redraws on a terminal or in Jupyter, rare ones into a log file."""

from __future__ import annotations

import io
import sys

from gradflow.progress import LOG_INTERVAL_S, TERMINAL_INTERVAL_S, TQDM_MAXINTERVAL_S, progress_bar, redraw_interval


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


def test_the_monitor_thread_does_not_redraw_a_log_bar_sooner_than_its_interval(monkeypatch):
    # tqdm's monitor redraws a bar idle for maxinterval seconds (default 10): a slow run into a log drew every 10-20 s
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    bar = progress_bar(total=10, file=io.StringIO())
    assert bar.mininterval == LOG_INTERVAL_S and bar.maxinterval >= LOG_INTERVAL_S
    bar.close()
    monkeypatch.setattr(sys, "stderr", _Terminal())
    bar = progress_bar(total=10, file=io.StringIO())
    assert bar.mininterval == TERMINAL_INTERVAL_S and bar.maxinterval == TQDM_MAXINTERVAL_S  # tqdm's default
    bar.close()


def _read_all(fd: int) -> str:
    import os
    import select

    text = b""
    while select.select([fd], [], [], 0.5)[0]:
        text += os.read(fd, 4096)
    return text.decode(errors="replace")


def test_a_terminal_that_reports_no_width_gets_an_80_column_bar(monkeypatch):
    # a new pseudo-terminal reports 0 x 0 (as `docker run -t` from a script gives): tqdm alone would fit the bar
    # to -1 columns and read the height as -1 rows, and print nothing at all. The bar writes to sys.stderr, as
    # `gradflow record`'s does: tqdm reads the screen's size only for sys.stderr and sys.stdout
    import os
    import pty

    from gradflow.progress import FALLBACK_COLUMNS, FALLBACK_ROWS, terminal_columns

    parent_fd, child_fd = pty.openpty()
    with os.fdopen(child_fd, "w") as terminal:
        assert terminal_columns(terminal) == 0
        monkeypatch.setattr(sys, "stderr", terminal)
        bar = progress_bar(desc="recording", unit="seq", dynamic_ncols=True, mininterval=0)
        assert bar.ncols == FALLBACK_COLUMNS and bar.nrows == FALLBACK_ROWS and not bar.dynamic_ncols
        bar.update(3)
        bar.set_postfix(tokens=12, refresh=False)
        bar.update(3)
        bar.close()
        terminal.flush()
        drawn = _read_all(parent_fd)
        monkeypatch.setattr(sys, "stderr", io.StringIO())
    os.close(parent_fd)
    assert "recording: 3seq" in drawn and "recording: 6seq" in drawn and "tokens=12" in drawn
    assert all(len(line) <= FALLBACK_COLUMNS for line in drawn.replace("\r", "\n").splitlines())
    assert terminal_columns(io.StringIO()) is None
    # a caller's width and height are kept
    kept = progress_bar(total=1, file=io.StringIO(), ncols=40, nrows=5)
    assert (kept.ncols, kept.nrows) == (40, 5)
