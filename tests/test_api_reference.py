"""The public API: curated, light to import, and listed in docs/api.md (generated; a new name fails until listed)."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import gradflow

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("pyarrow", "pandas", "matplotlib", "starlette", "plotly", "uvicorn", "sklearn")


def test_docs_api_md_is_current():
    render = runpy.run_path(str(ROOT / "docs" / "make_api_reference.py"))["render"]
    assert (ROOT / "docs" / "api.md").read_text(encoding="utf-8") == render(), \
        "docs/api.md is stale: run python docs/make_api_reference.py"


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
