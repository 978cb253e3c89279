"""docs/tutorial.ipynb runs top to bottom, offline, as a student would run it (its cells assert the zeros).

The executed notebook is also checked for what a student gets: no warning from the first cell, plotly.js
once (carried by the first view, handed by the notebook page to every view's frame), a short text form of
each view, a size of a few MB, and the instructions of its first cell. A headless Chromium then opens the
executed outputs as one page, as a notebook front end shows them, and every view must draw.
"""

from __future__ import annotations

import html
import importlib.util
import os
import re
import shutil
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "docs" / "tutorial.ipynb"
MAX_EXECUTED_MB = 6.0  # one plotly.js (4.7 MB) and three views' data; 16.9 MB when each view carried plotly.js
TIMEOUT = 60


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("plotly")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), \
        "commit the notebook without outputs"
    where = tmp_path_factory.mktemp("tutorial")
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(where)}})
    client.execute()
    path = where / "tutorial.ipynb"
    nbformat.write(notebook, path)
    return notebook, path


def _outputs(notebook) -> list:
    return [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]


def _views(notebook) -> list[str]:
    return [o["data"]["text/html"] for o in _outputs(notebook)
            if o.output_type == "execute_result" and "<iframe srcdoc=" in o.get("data", {}).get("text/html", "")]


@pytest.mark.slow
def test_tutorial_notebook_runs_top_to_bottom(executed):
    notebook, _ = executed
    outputs = _outputs(notebook)
    assert not [o for o in outputs if o.output_type == "error"]
    assert len(_views(notebook)) == 3  # the three views displayed
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "gradflow-mini-en           mlm            context channels dark in the last block: 16 of 16" in printed
    assert "context channels dark in the last block: 0 of 16" in printed


@pytest.mark.slow
def test_no_warning_in_the_notebook(executed):
    notebook, _ = executed
    errors = "".join(o.get("text", "") for o in _outputs(notebook) if o.output_type == "stream" and o.name == "stderr")
    assert "IProgress" not in errors and "Warning" not in errors, errors


@pytest.mark.slow
def test_plotly_js_once_and_a_small_notebook(executed):
    from gradflow.explore.page import plotly_js_path

    notebook, path = executed
    header = plotly_js_path().read_text(encoding="utf-8")[:200]  # plotly.js's licence header
    views = _views(notebook)
    assert [header in v for v in views] == [True, False, False]  # the first view carries it, the others ask for it
    everything = path.read_text(encoding="utf-8")
    assert everything.count(header.splitlines()[1]) == 1  # "* plotly.js v4...": once in the whole file
    size_mb = path.stat().st_size / 1e6
    assert size_mb < MAX_EXECUTED_MB, f"the executed notebook weighs {size_mb:.1f} MB"


@pytest.mark.slow
def test_a_view_prints_one_short_line(executed):
    notebook, _ = executed
    plain = [o["data"]["text/plain"] for o in _outputs(notebook)
             if o.output_type == "execute_result" and "<iframe srcdoc=" in o["data"].get("text/html", "")]
    assert len(plain) == 3
    for text in plain:
        assert text.startswith("<ChannelView gradflow-mini-en") and "\n" not in text and len(text) < 300, text
        assert "19 tokens" in text and "13 sites x 19 positions" in text


def test_the_first_cell_says_how_to_run_it():
    nbformat = pytest.importorskip("nbformat")
    first = nbformat.read(NOTEBOOK, as_version=4).cells[0].source
    assert "pip install -e '.[explore,notebook]'" in first and "jupyter lab docs/tutorial.ipynb" in first
    assert "jupyter execute docs/tutorial.ipynb" in first
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[ ]", d)[0] for d in extras["notebook"]}
    assert names == {"jupyterlab", "ipywidgets"}
    assert any(d.startswith("ipywidgets") for d in extras["test"])  # the suite's kernel is the student's
    assert any(d.startswith("nbclient") for d in extras["test"])  # nbclient brings `jupyter execute`
    if importlib.util.find_spec("nbclient") is not None:  # the command the cell names is there
        assert shutil.which("jupyter-execute", path=os.path.dirname(sys.executable))


@pytest.mark.slow
def test_every_view_draws_in_a_browser_with_one_plotly(executed, tmp_path):
    """The outputs in order on one page, as Jupyter shows them: each sandboxed frame gets plotly.js from the page."""
    from selenium.webdriver.support.ui import WebDriverWait

    from browser import headless_chromium

    notebook, _ = executed
    page = tmp_path / "outputs.html"
    body = "\n".join(o["data"]["text/html"] if "text/html" in o.get("data", {}) else
                     f"<pre>{html.escape(o.get('text', ''))}</pre>" for o in _outputs(notebook))
    page.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{body}</body></html>",
                    encoding="utf-8")
    with headless_chromium(offline=True) as chrome:
        chrome.get(page.as_uri())
        assert chrome.execute_script("return typeof Plotly") == "undefined"  # inert text on the notebook page
        frames = chrome.find_elements("tag name", "iframe")
        assert len(frames) == 3
        for frame in frames:
            chrome.switch_to.frame(frame)
            WebDriverWait(chrome, TIMEOUT).until(
                lambda d: d.find_element("id", "figures").get_attribute("data-state") == "ready"
                or "error" in d.find_element("id", "message").get_attribute("class"))
            assert chrome.find_element("id", "figures").get_attribute("data-state") == "ready", \
                chrome.find_element("id", "message").text
            assert chrome.execute_script("return document.querySelectorAll('#heatmap .main-svg').length") >= 1
            chrome.switch_to.default_content()
