"""A real headless Chromium for the explorer's tests (Debian's ``chromium`` and ``chromium-driver``).

``headless_chromium()`` starts one through Selenium with the system driver (Selenium Manager never
downloads anything); ``offline=True`` points every request at a closed proxy and every host name at
nothing, so a page that needed the network would fail. ``live_server(app)`` serves an ASGI app with
uvicorn on a free local port in a thread. Missing pieces skip the test with the reason.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVERS = ("chromedriver",)
INSTALL = "apt-get install chromium chromium-driver (as .ci/run does)"


def _find(names: tuple[str, ...]) -> str | None:
    return next((path for path in map(shutil.which, names) if path), None)


@contextmanager
def headless_chromium(offline: bool = False, width: int = 1400, height: int = 1100) -> Iterator[object]:
    """A Selenium Chrome driver on the system Chromium; skips the test when none can be started."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra has it)")
    from selenium.webdriver.chrome.service import Service

    browser, driver = _find(BROWSERS), _find(DRIVERS)
    if browser is None or driver is None:
        pytest.skip(f"no Chromium and chromedriver on PATH: {INSTALL}")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--disable-background-networking", "--no-first-run"):
        options.add_argument(arg)
    if offline:
        options.add_argument("--proxy-server=http://127.0.0.1:9")
        options.add_argument("--host-resolver-rules=MAP * ~NOTFOUND")
    try:
        chrome = webdriver.Chrome(service=Service(driver), options=options)
    except Exception as err:  # a browser that cannot start here is an environment problem, said as such
        pytest.skip(f"Chromium could not start ({type(err).__name__}: {str(err).splitlines()[0]}); {INSTALL}")
    try:
        yield chrome
    finally:
        chrome.quit()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def live_server(app) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 in a background thread; yields its base URL."""
    uvicorn = pytest.importorskip("uvicorn")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the explorer server did not start within 30 s")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.should_exit = True
        thread.join(10)
