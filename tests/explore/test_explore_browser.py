"""The explorer page in a real headless Chromium: type, click to mask, read the exact zeros off the page.

Screenshots go to ``$GRADFLOW_SCREENSHOT_DIR`` when set (docs/images/ has the committed one),
else to the test's temporary directory. Skips with the reason where no browser can be started.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("plotly")

from browser import headless_chromium, live_server  # noqa: E402
from gradflow.explore.server import create_app  # noqa: E402
from gradflow.explore.service import DEFAULT_TEXT, ExploreConfig, ExploreService  # noqa: E402
from gradflow.explore.view import channel_view  # noqa: E402

SENTENCE = "The abundant fruits of another year have blessed our country with plenty."
TIMEOUT = 60


def _shots(tmp_path: Path) -> Path:
    where = Path(os.environ.get("GRADFLOW_SCREENSHOT_DIR", tmp_path))
    where.mkdir(parents=True, exist_ok=True)
    return where


def _wait_state(chrome, state: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(chrome, TIMEOUT).until(
        lambda d: d.find_element("id", "figures").get_attribute("data-state") in (state, "error"))
    assert chrome.find_element("id", "figures").get_attribute("data-state") == state, \
        chrome.find_element("id", "message").text


def _chips(chrome) -> list[dict]:
    return chrome.execute_script(
        "return [...document.querySelectorAll('#tokens .token')].map(c => ({text: c.textContent, "
        "position: Number(c.dataset.position), role: c.dataset.role, zero: c.dataset.lastBlockZero === 'true'}));")


def _zero_cells(chrome) -> set[tuple[int, int]]:
    cells = chrome.execute_script(
        "const t = document.getElementById('heatmap').data.find(t => t.name === 'exactly 0'); return t.meta.cells;")
    return {(int(t), int(s)) for t, s in cells}


def _figure_facts(chrome) -> dict:
    return chrome.execute_script(
        "const d = document.getElementById('heatmap'); const heat = d.data[0];"
        "return {sites: heat.z[0].length, rows: heat.z.length, last: d.layout.shapes[0].x0 + 0.5,"
        " text: heat.customdata.map(r => r.map(c => c[3]))};")


def _text_of(chrome) -> str:
    return chrome.execute_script("return document.body.innerText;")


@pytest.fixture(scope="module")
def served():
    service = ExploreService(ExploreConfig(models=("gradflow-mini-en", "gradflow-mini-en-alltoken")))
    with live_server(create_app(service)) as url:
        yield url


@pytest.mark.slow
def test_first_screen_is_berts_15_percent_at_seed_0(served, tmp_path):
    """Opened with no interaction: the example sentence, BERT's masking drawn at seed 0, a drawn view, no notice."""
    from selenium.webdriver.common.by import By

    expected = channel_view("gradflow-mini-en", DEFAULT_TEXT, mask="random", seed=0)
    with headless_chromium() as chrome:
        chrome.get(served)
        _wait_state(chrome, "ready")
        chips = _chips(chrome)
        assert [c["role"] for c in chips] == expected.roles
        assert [c["position"] for c in chips if c["role"] in ("masked", "random", "kept")] == \
            expected.masking["selected"] != []
        assert [c["zero"] for c in chips] == expected.last_block_zero()
        assert chrome.find_element(By.ID, "seed").get_attribute("value") == "0"
        assert chrome.find_element(By.ID, "text").get_attribute("value") == DEFAULT_TEXT
        assert "No token is selected" not in _text_of(chrome)
        assert "In the last block (blocks.5)" in chrome.find_element(By.ID, "explanation").text
        labels = chrome.execute_script("return document.getElementById('heatmap').layout.xaxis.ticktext;")
        assert labels[0] == "embeddings.out" and labels[-1] == "blocks.5.out"
        assert chrome.find_element(By.ID, "exports").text == "Export: PNG · PDF · CSV"
        chrome.save_screenshot(str(_shots(tmp_path) / "explore_first_screen.png"))
        chrome.find_element(By.ID, "clear").click()  # no token selected: the notice is said once, not twice
        from selenium.webdriver.support.ui import WebDriverWait

        WebDriverWait(chrome, TIMEOUT).until(lambda d: "No token is selected" in _text_of(d))
        assert _text_of(chrome).count("No token is selected") == 1


@pytest.mark.slow
def test_type_click_and_read_the_last_block_zeros(served, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    with headless_chromium() as chrome:
        chrome.get(served)
        WebDriverWait(chrome, TIMEOUT).until(lambda d: len(_chips(d)) > 3)
        box = chrome.find_element(By.ID, "text")
        box.clear()
        box.send_keys(SENTENCE + Keys.ENTER)
        WebDriverWait(chrome, TIMEOUT).until(lambda d: any(c["text"] == "abundant" for c in _chips(d)))
        assert "No token is selected" in chrome.find_element(By.ID, "message").text
        target = next(c for c in _chips(chrome) if c["text"] == "fruits")
        chrome.find_element(By.CSS_SELECTOR, f'#tokens .token[data-position="{target["position"]}"]').click()
        _wait_state(chrome, "ready")

        chips = _chips(chrome)
        masked = [c for c in chips if c["role"] == "masked"]
        assert [c["position"] for c in masked] == [target["position"]] and masked[0]["text"] == "fruits → [MASK]"
        facts = _figure_facts(chrome)
        last_sites = range(int(facts["last"]), facts["sites"])
        assert len(last_sites) == 2 and facts["rows"] == len(chips)
        zeros = _zero_cells(chrome)
        for chip in chips:
            cells = {(chip["position"], s) for s in last_sites}
            if chip["role"] == "masked":
                assert not chip["zero"] and not cells & zeros
                assert all(facts["text"][chip["position"]][s] != "exactly 0" for s in last_sites)
            else:
                assert chip["zero"] and cells <= zeros, chip
                assert all(facts["text"][chip["position"]][s] == "exactly 0" for s in last_sites)
        assert "exactly 0" in chrome.find_element(By.ID, "explanation").text
        chrome.set_window_size(1400, 1500)
        chrome.save_screenshot(str(_shots(tmp_path) / "explore.png"))

        # the same sentence under the all-positions loss: no word channel is dark any more
        chrome.execute_script("document.getElementById('figures').dataset.state = 'stale';")
        from selenium.webdriver.support.ui import Select

        Select(chrome.find_element(By.ID, "loss")).select_by_value("all-positions")
        _wait_state(chrome, "ready")
        assert not any(c["zero"] for c in _chips(chrome) if c["role"] != "special")


@pytest.mark.slow
def test_errors_are_sentences_in_the_page(served):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    with headless_chromium() as chrome:
        chrome.get(served)
        WebDriverWait(chrome, TIMEOUT).until(lambda d: len(_chips(d)) > 3)
        box = chrome.find_element(By.ID, "text")
        box.clear()
        box.send_keys("word " * 80 + Keys.ENTER)
        message = chrome.find_element(By.ID, "message")
        WebDriverWait(chrome, TIMEOUT).until(lambda d: "error" in message.get_attribute("class"))
        assert "tokens" in message.text and "shorten it" in message.text and "Traceback" not in message.text
        box.clear()
        box.send_keys("The nation is at peace." + Keys.ENTER)
        WebDriverWait(chrome, TIMEOUT).until(lambda d: "error" not in message.get_attribute("class"))
        chrome.find_element(By.ID, "random").click()
        _wait_state(chrome, "ready")
        assert any(c["role"] in ("masked", "random", "kept") for c in _chips(chrome))


@pytest.mark.slow
def test_static_page_opens_offline(tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    page = tmp_path / "view.html"
    view = channel_view("gradflow-mini-en", SENTENCE, mask=[3])
    view.to_html(page)
    with headless_chromium(offline=True) as chrome:
        chrome.get(page.as_uri())
        WebDriverWait(chrome, TIMEOUT).until(
            lambda d: d.find_element("id", "figures").get_attribute("data-state") == "ready")
        assert chrome.execute_script("return typeof Plotly") == "object"
        assert chrome.execute_script("return document.getElementById('controls').offsetParent") is None  # no inputs
        assert "saved view" in chrome.find_element("id", "message").text
        assert chrome.execute_script("return document.querySelectorAll('#heatmap .main-svg').length") >= 1
        fetched = chrome.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name).filter(n => !n.startsWith('data:'));")
        assert fetched == []  # nothing was requested: everything the page needs is inside it
        chips = _chips(chrome)
        assert [c["zero"] for c in chips] == view.last_block_zero()
        assert chrome.find_element("id", "exports").text == "Export: PNG · CSV"  # no PDF, and no empty item
        ticks = chrome.execute_script("return document.getElementById('heatmap').data[0].colorbar.ticktext;")
        assert "0.1" in ticks and "0.01" in ticks and not any("e" in t for t in ticks), ticks  # as the PNG writes them
        chrome.save_screenshot(str(_shots(tmp_path) / "explore_static.png"))
