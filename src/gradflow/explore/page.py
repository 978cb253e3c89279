"""The explorer's HTML page: served live by ``gradflow explore``, or written as one self-contained file.

Both are the same template (``static/page.html``) and script (``static/explore.js``); the live page
loads plotly.js from the server (``static/plotly.min.js``, the copy inside the plotly wheel) and
asks the server for each view, the static page carries plotly.js and one view's data inline, so it
opens offline in any browser with no server. Nothing is ever fetched from a CDN.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

from gradflow.errors import ExploreError

STATIC_DIR: Path = Path(__file__).with_name("static")
"""The page template, its script and its style sheet."""
MARKER = re.compile(r"/\*(STYLE|CONFIG|SCRIPT|PLOTLY)\*/")
INSTALL_HINT = "install the explorer's extra: pip install 'gradflow[explore]' (./setup.sh does)"


def plotly_js_path() -> Path:
    """The minified plotly.js that ships inside the plotly wheel."""
    try:
        path = Path(str(resources.files("plotly") / "package_data" / "plotly.min.js"))
    except ModuleNotFoundError:
        raise ExploreError(f"the channel-view page needs plotly: {INSTALL_HINT}.") from None
    if not path.is_file():
        raise ExploreError(f"plotly is installed but its plotly.min.js is missing ({path}); reinstall plotly.")
    return path


def _script_json(data: object) -> str:
    """JSON safe inside a <script> element: ``<``, ``>`` and ``&`` escaped, so no text can end or open a tag."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _render(config: dict, plotly_tag: str) -> str:
    template = (STATIC_DIR / "page.html").read_text(encoding="utf-8")
    script = (STATIC_DIR / "explore.js").read_text(encoding="utf-8")
    parts = {"STYLE": (STATIC_DIR / "explore.css").read_text(encoding="utf-8"), "CONFIG": _script_json(config),
             "SCRIPT": script.replace("</script", "<\\/script"), "PLOTLY": plotly_tag}
    # one pass: inserted text (a user's sentence included) is never searched for markers again
    return MARKER.sub(lambda m: parts[m.group(1)], template)


def live_page(models: list[str], losses: dict[str, str], max_tokens: int, max_chars: int,
              examples: dict[str, str]) -> str:
    """The page ``gradflow explore`` serves at ``/`` (plotly.js from ``static/plotly.min.js``).

    ``examples``: the sentence the text box starts from for each model (swapped in on a model change
    unless the student has edited it)."""
    config = {"mode": "live", "models": models, "losses": losses, "max_tokens": max_tokens, "max_chars": max_chars,
              "examples": examples}
    return _render(config, '<script src="static/plotly.min.js"></script>')


def static_page(view_payload: dict) -> str:
    """One HTML file with plotly.js, the script and one view's data inline (about 4.7 MB)."""
    plotly_js = plotly_js_path().read_text(encoding="utf-8").replace("</script", "<\\/script")
    return _render({"mode": "static", "view": view_payload}, f"<script>{plotly_js}</script>")


__all__ = ["INSTALL_HINT", "STATIC_DIR", "live_page", "plotly_js_path", "static_page"]
