"""docs/tutorial.ipynb runs top to bottom, offline, as a student would run it (its cells assert the zeros)."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "docs" / "tutorial.ipynb"


def test_tutorial_notebook_runs_top_to_bottom(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("plotly")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), \
        "commit the notebook without outputs"
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    frames = [o for o in outputs if o.output_type == "execute_result" and "text/html" in o.get("data", {})]
    assert sum("<iframe srcdoc=" in o["data"]["text/html"] for o in frames) == 3  # the three views displayed
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "gradflow-mini-en           mlm            context channels dark in the last block: 16 of 16" in printed
    assert "context channels dark in the last block: 0 of 16" in printed
