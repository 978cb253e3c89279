"""The public API: curated, light to import, listed in docs/api.md and rendered by mkdocstrings on
docs/reference/python-api.md (both generated; a new name fails until listed)."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import gradflow

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("pyarrow", "pandas", "matplotlib", "starlette", "plotly", "uvicorn", "sklearn")


def test_docs_api_md_is_current():
    render = runpy.run_path(str(ROOT / "docs" / "make_api_reference.py"))["render"]
    assert (ROOT / "docs" / "api.md").read_text(encoding="utf-8") == render(), \
        "docs/api.md is stale: run python docs/make_api_reference.py"


def test_python_api_page_is_current_and_names_every_public_name():
    render = runpy.run_path(str(ROOT / "docs" / "make_api_reference.py"))["render_python_api"]
    page = (ROOT / "docs" / "reference" / "python-api.md").read_text(encoding="utf-8")
    assert page == render(), "docs/reference/python-api.md is stale: run python docs/make_api_reference.py"
    blocks = [line.removeprefix("::: ") for line in page.splitlines() if line.startswith("::: ")]
    assert sorted(path.rpartition(".")[2] for path in blocks) == sorted(gradflow.__all__)


def test_mkdocstrings_renders_the_python_api_without_a_warning(tmp_path):
    """A scratch site of the API pages builds with ``mkdocs build --strict``: every ``:::`` path resolves and
    griffe warns about no docstring of the public names."""
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra is not installed")
    docs = tmp_path / "docs"
    (docs / "reference").mkdir(parents=True)
    pages = ["reference/python-api.md", "api.md"]  # links to other pages are the site build's business
    for page in pages:
        (docs / page).write_text((ROOT / "docs" / page).read_text(encoding="utf-8"), encoding="utf-8")
    config = {"site_name": "scratch", "docs_dir": str(docs), "site_dir": str(tmp_path / "site"),
              "use_directory_urls": False, "nav": pages, "markdown_extensions": ["tables", "attr_list", "toc"],
              "validation": {"links": {"not_found": "info", "anchors": "info", "unrecognized_links": "info"}},
              "plugins": [{"mkdocstrings": {"handlers": {"python": {"paths": [str(ROOT / "src")], "options": {
                  "docstring_style": "google", "show_root_heading": True, "show_source": False,
                  "filters": ["!^_"]}}}}}]}
    (tmp_path / "mkdocs.yml").write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(tmp_path / "mkdocs.yml")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    html = (tmp_path / "site" / "reference" / "python-api.html").read_text(encoding="utf-8")
    assert all(f'id="{line[4:]}"' in html for line in
               (ROOT / "docs" / "reference" / "python-api.md").read_text(encoding="utf-8").splitlines()
               if line.startswith("::: "))


def test_every_public_name_resolves_and_is_listed():
    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    for name in gradflow.__all__:
        assert getattr(gradflow, name) is not None
        assert f"| `{name}` |" in page


def test_the_getting_started_names_are_public():
    """Load a model, mask a batch, record a batch, record a corpus, load a run, report, the callback, the errors."""
    assert {"load_model", "mask_batch", "BertMasking", "GradFlowRecorder", "record_corpus", "RecordConfig", "load_run",
            "write_report", "write_comparison", "GradFlowCallback", "GradflowError"} <= set(gradflow.__all__)


def test_import_gradflow_loads_nothing_heavy():
    code = "import sys, gradflow; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


def test_unknown_names_still_raise_attribute_error():
    try:
        gradflow.no_such_name  # noqa: B018
    except AttributeError as err:
        assert "no_such_name" in str(err)
    else:
        raise AssertionError("gradflow.no_such_name did not raise")
