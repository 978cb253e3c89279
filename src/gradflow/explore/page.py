"""The explorer's HTML page: served live by ``gradflow explore``, or written as one self-contained file.

Both are the same template (``static/page.html``) and script (``static/explore.js``); the live page
loads plotly.js from the server (``static/plotly.min.js``, the copy inside the plotly wheel) and
asks the server for each view, the static page carries plotly.js and one view's data inline, so it
opens offline in any browser with no server. Nothing is ever fetched from a CDN.

In a notebook (:func:`notebook_html`) each view is the static page in a sandboxed frame without
plotly.js: the frame asks the notebook page for it with ``postMessage``. The first view displayed in
a kernel session carries plotly.js once, as inert text (``<script type="text/plain">``), beside a
small script that answers those requests; later views carry only that script, so an executed
notebook holds plotly.js (about 4.7 MB) once however many views it shows.
"""

from __future__ import annotations

import html
import json
import re
from importlib import resources
from pathlib import Path

from gradflow.errors import ExploreError

STATIC_DIR: Path = Path(__file__).with_name("static")
"""The page template, its script and its style sheet."""
MARKER = re.compile(r"/\*(STYLE|CONFIG|SCRIPT|PLOTLY)\*/")
NOTEBOOK_PLOTLY_ID = "gradflow-plotly-js"
"""The id of the element holding plotly.js as text in the notebook output that carries it."""
# In the notebook page, beside each view: keep plotly.js's text (so it outlives a cleared output) and answer
# each view frame's request for it. Installed once per page, however many outputs run it.
NOTEBOOK_RESPONDER = """<script>
(function () {
  var w = window, el = document.getElementById("NOTEBOOK_PLOTLY_ID");
  if (el && !w.gradflowPlotlyJs) w.gradflowPlotlyJs = el.textContent;
  if (w.gradflowPlotlyResponder) return;
  w.gradflowPlotlyResponder = true;
  w.addEventListener("message", function (e) {
    if (!e.data || e.data.gradflow !== "plotly?" || !e.source) return;
    var js = w.gradflowPlotlyJs || (document.getElementById("NOTEBOOK_PLOTLY_ID") || {}).textContent || null;
    e.source.postMessage({gradflow: "plotly", js: js}, "*");
  });
})();
</script>""".replace("NOTEBOOK_PLOTLY_ID", NOTEBOOK_PLOTLY_ID)
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


def _plotly_js() -> str:
    return plotly_js_path().read_text(encoding="utf-8").replace("</script", "<\\/script")


def static_page(view_payload: dict, plotly: str = "inline") -> str:
    """One HTML file with the script and one view's data inline. ``plotly``: ``"inline"`` puts plotly.js in it
    too (about 4.7 MB; opens offline anywhere); ``"parent"`` leaves it out: the page, framed in a notebook,
    asks its parent for it (see :func:`notebook_html`)."""
    if plotly not in ("inline", "parent"):
        raise ExploreError(f"plotly must be 'inline' or 'parent', got {plotly!r}")
    if plotly == "parent":
        return _render({"mode": "static", "plotly": "parent", "view": view_payload}, "")
    return _render({"mode": "static", "plotly": "inline", "view": view_payload}, f"<script>{_plotly_js()}</script>")


def notebook_html(view_payload: dict, height: int, carry_plotly: bool) -> str:
    """A notebook output showing one view: the page (without plotly.js) in a sandboxed frame, the script that
    hands the frame plotly.js and, when ``carry_plotly``, plotly.js itself as inert text (the first view of a
    kernel session)."""
    carrier = (f'<script type="text/plain" id="{NOTEBOOK_PLOTLY_ID}">{_plotly_js()}</script>\n'
               if carry_plotly else "")
    frame = html.escape(static_page(view_payload, plotly="parent"), quote=True)
    return (f'{carrier}{NOTEBOOK_RESPONDER}\n<iframe srcdoc="{frame}" style="width:100%;height:{height}px;border:0" '
            'sandbox="allow-scripts allow-downloads"></iframe>')


__all__ = ["INSTALL_HINT", "NOTEBOOK_PLOTLY_ID", "NOTEBOOK_RESPONDER", "STATIC_DIR", "live_page", "notebook_html",
           "plotly_js_path", "static_page"]
