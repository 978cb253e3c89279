"""Loading speaks gradflow's language: no transformers load report for unused heads, one warning for
encoder weights the checkpoint lacks (issue 27 point 9)."""

from __future__ import annotations

import json

import torch
from transformers import BertConfig, BertForPreTraining

from conftest import build_tiny_mlm_dir
from gradflow.models import load_model


def test_unused_heads_in_the_checkpoint_print_nothing(tmp_path, capfd):
    path = build_tiny_mlm_dir(tmp_path / "pretraining")
    torch.manual_seed(0)
    BertForPreTraining(BertConfig.from_pretrained(path)).save_pretrained(path)  # + pooler and NSP head
    capfd.readouterr()
    load_model(str(path))
    captured = capfd.readouterr()
    assert "LOAD REPORT" not in captured.err + captured.out
    assert "UNEXPECTED" not in captured.err + captured.out and "warning" not in captured.err


def test_missing_encoder_weights_get_one_gradflow_warning(tmp_path, capfd):
    path = build_tiny_mlm_dir(tmp_path / "short", layers=2)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))  # block 2 is not saved
    capfd.readouterr()
    load_model(str(path))
    err = capfd.readouterr().err
    assert "LOAD REPORT" not in err
    warnings = [line for line in err.splitlines() if line.startswith("gradflow: warning:")]
    assert len(warnings) == 1 and "bert.encoder.layer.2." in warnings[0] and "initialised at random" in warnings[0]
