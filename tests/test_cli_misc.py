"""CLI entry points other than record: zoo listing, demo on the embedded models, module entry."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gradflow.cli import main
from gradflow.models import EMBEDDED_MODELS, embedded_model_dir


def test_zoo_list_and_unknown_name(capsys):
    assert main(["zoo", "list"]) == 0
    out = capsys.readouterr().out
    assert "antiberty" in out and "rxnfp" in out
    assert main(["zoo", "fetch", "nonexistent"]) == 2
    assert "nonexistent" in capsys.readouterr().err


def test_zoo_model_not_fetched_is_a_clear_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("GRADFLOW_CACHE", str(tmp_path / "empty-cache"))
    code = main(["record", "--model", "zoo:antiberty", "--out", str(tmp_path / "o"), "--quiet"])
    assert code == 2 and "gradflow zoo fetch antiberty" in capsys.readouterr().err


def test_python_dash_m_entry_point_help():
    proc = subprocess.run([sys.executable, "-m", "gradflow", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "record" in proc.stdout and "demo" in proc.stdout


@pytest.mark.skipif(not all((embedded_model_dir(n) / "model.safetensors").exists() for n in EMBEDDED_MODELS),
                    reason="embedded model weights not in this checkout")
def test_demo_runs_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["demo", "--out", str(tmp_path / "demo"), "--limit", "24", "--quiet"]) == 0
    mlm = tmp_path / "demo" / "mini-en_mlm"
    alltoken = tmp_path / "demo" / "mini-en-alltoken_all-positions"
    for run in (mlm, alltoken):
        assert json.loads((run / "meta.json").read_text())["complete"] is True
    import pandas as pd

    c = pd.read_csv(mlm / "channels.csv")
    last = c[(c.role == "context") & (c.layer == 6) & (c.point == "out")]
    assert float(last.grad_norm_mean.iloc[0]) == 0.0
    c = pd.read_csv(alltoken / "channels.csv")
    last = c[(c.role == "context") & (c.layer == 6) & (c.point == "out")]
    assert float(last.grad_norm_mean.iloc[0]) > 0.0
