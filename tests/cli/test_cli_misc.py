"""CLI entry points other than record: zoo listing, demo on the embedded models, finetune, module entry."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gradflow.cli import main
from gradflow.models import CORE_MODELS, embedded_model_dir


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


@pytest.mark.slow
def test_python_dash_m_entry_point_help():
    proc = subprocess.run([sys.executable, "-m", "gradflow", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "record" in proc.stdout and "demo" in proc.stdout and "finetune" in proc.stdout


@pytest.mark.slow
def test_version_flag_prints_the_versions_and_exits_0():
    from importlib import metadata

    from gradflow.version import __version__

    proc = subprocess.run([sys.executable, "-m", "gradflow", "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.startswith(f"gradflow {__version__} (")
    assert f"torch {metadata.version('torch')}" in proc.stdout
    assert f"transformers {metadata.version('transformers')}" in proc.stdout
    assert "Python 3." in proc.stdout


def test_version_text_names_a_missing_package(monkeypatch):
    import importlib
    from importlib import metadata

    cli_main = importlib.import_module("gradflow.cli.main")  # the module (gradflow.cli.main is also the function)
    real = metadata.version

    def fake(name):
        if name == "transformers":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(cli_main.metadata, "version", fake)
    assert "transformers not installed" in cli_main.version_text()


def _toy_task(root) -> str:
    """A sequence task directory: sentences with and without "progress", labelled pos / neg."""
    from conftest import SAMPLE_LINES

    root.mkdir()
    (root / "task.json").write_text(json.dumps({"name": "toy", "kind": "sequence", "metric": "accuracy",
                                                "labels": ["neg", "pos"]}))
    rows = [{"text": line + (" progress" if i % 2 else ""), "label": "pos" if i % 2 else "neg"}
            for i, line in enumerate(SAMPLE_LINES * 4)]
    for split in ("train", "validation", "test"):
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(root)


def test_finetune_command(tmp_path, capsys, tiny_mlm_dir):
    out = tmp_path / "ft"
    code = main(["finetune", "--model", str(tiny_mlm_dir), "--task", _toy_task(tmp_path / "toy"), "--out", str(out),
                 "--steps", "2", "--batch-size", "4", "--eval-every", "1", "--train-limit", "8", "--eval-limit", "4",
                 "--max-length", "32", "--lr", "1e-3", "--drop-last", "1", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    final = json.loads(captured.out)
    assert set(final) == {"validation", "test"} and "accuracy" in final["test"]
    config = json.loads((out / "result.json").read_text())["config"]
    assert (config["steps"], config["lr"], config["drop_last"], config["weight_decay"]) == (2, 1e-3, 1, 0.01)
    assert main(["finetune", "--model", str(tiny_mlm_dir), "--task", "brown-pos", "--data-root",
                 str(tmp_path / "no-tasks"), "--out", str(tmp_path / "ft2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradflow: error: no task 'brown-pos'") and "`gradflow tasks fetch --out " in err


@pytest.mark.slow
@pytest.mark.skipif(not all((embedded_model_dir(n) / "model.safetensors").exists() for n in CORE_MODELS),
                    reason="embedded model weights not in this checkout")  # the demo's pair: in the core package
def test_demo_runs_offline(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["demo", "--out", str(tmp_path / "demo"), "--limit", "24", "--quiet"]) == 0
    # it ends with its answer (issue 26), read from the report tables it wrote
    answer = capsys.readouterr().out.strip().splitlines()
    assert answer[0].startswith("gradflow demo: where the training signal goes")
    assert "0 [0, 0] leaving it" in answer[1] and answer[1].startswith("  mini-en (MLM loss):")
    assert answer[2].endswith("attn.q, attn.out, attn.norm, ffn.in, ffn.out, ffn.norm (6 of 8 sublayers)")
    assert "leaving it" in answer[3] and "0 [0, 0]" not in answer[3] and answer[4].endswith("none (0 of 8 sublayers)")
    assert str(tmp_path / "demo" / "report" / "compare") in answer[-1]
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


@pytest.mark.slow
def test_report_and_compare_bad_input_exit_2(tmp_path, capsys, tiny_mlm_dir, tiny_corpus):
    assert main(["report", str(tmp_path / "missing"), "--out", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert "missing" in err and "Traceback" not in err
    run = tmp_path / "run"
    assert main(["record", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--out", str(run),
                 "--max-length", "24", "--quiet"]) == 0
    # a second run from another tokenizer: compare must refuse per-token comparison
    from transformers import AutoTokenizer

    from conftest import build_tiny_mlm_dir

    other = build_tiny_mlm_dir(tmp_path / "other")
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["gradflowtoken"])
    tok.save_pretrained(other)
    from transformers import AutoModelForMaskedLM

    model = AutoModelForMaskedLM.from_pretrained(other)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(other)
    run2 = tmp_path / "run2"
    assert main(["record", "--model", str(other), "--texts", str(tiny_corpus), "--out", str(run2),
                 "--max-length", "24", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["compare", str(run), str(run2), "--out", str(tmp_path / "cmp")]) == 2
    assert "tokenizer" in capsys.readouterr().err
    # an incomplete run is reported, with the warning in summary.md
    meta = json.loads((run / "meta.json").read_text())
    meta["complete"] = False
    (run / "meta.json").write_text(json.dumps(meta))
    assert main(["report", str(run), "--out", str(tmp_path / "inc")]) == 0
    assert "complete" in (tmp_path / "inc" / "summary.md").read_text().lower()


def test_finetune_extends_the_vocabulary_and_logs_the_new_rows(tmp_path, capsys, tiny_mlm_dir):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    words = tmp_path / "words.txt"
    words.write_text("Treasuries\nstockholder\n", encoding="utf-8")
    out = tmp_path / "ft"
    code = main(["finetune", "--model", str(tiny_mlm_dir), "--task", _toy_task(tmp_path / "toy"), "--out", str(out),
                 "--steps", "2", "--batch-size", "4", "--eval-every", "1", "--train-limit", "8", "--eval-limit", "4",
                 "--test-limit", "3", "--max-length", "32", "--extend-vocabulary", str(words), "--continue-mlm", "2",
                 "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    config = json.loads((out / "result.json").read_text())["config"]
    assert config["extend_vocabulary"] == ["Treasuries", "stockholder"]  # as given; normalised when added
    assert config["continue_mlm_steps"] == 2 and config["test_limit"] == 3
    continued = out / "encoder" / "continued"
    meta = json.loads((continued / "continued.json").read_text())
    assert meta["vocabulary_extension"]["words"] == ["treasuries", "stockholder"]
    rows = (continued / "new_rows.csv").read_text().splitlines()
    assert rows[0] == "step,side,role,grad_norm,n_positions" and len(rows) > 1
    # words only: an extended checkpoint, no continued MLM
    code = main(["finetune", "--model", str(tiny_mlm_dir), "--task", _toy_task(tmp_path / "toy2"), "--out",
                 str(tmp_path / "ft2"), "--steps", "1", "--batch-size", "4", "--train-limit", "4", "--eval-limit", "4",
                 "--max-length", "32", "--extend-vocabulary", str(words), "--no-progress"])
    assert code == 0
    extension = json.loads((tmp_path / "ft2" / "encoder" / "extended" / "vocabulary.json").read_text())
    assert len(extension["new_ids"]) == 2
    empty = tmp_path / "empty.txt"
    empty.write_text("\n", encoding="utf-8")
    assert main(["finetune", "--model", str(tiny_mlm_dir), "--task", _toy_task(tmp_path / "toy3"), "--out",
                 str(tmp_path / "ft3"), "--extend-vocabulary", str(empty), "--no-progress"]) == 2
    assert "has no words" in capsys.readouterr().err
