"""``gradflow channels`` on a tiny native DiffusionGemma (issue 61): one sentence split by the plain corpus's rule
(the last min(C, n - 1) tokens the canvas, the rest the prompt), masked on the canvas only, drawn in the (1, P + C)
layout: the prompt reaches the gradient through the encoder pass at the earlier blocks, and at the last block's
sites (after the last attention) every position without a loss, the prompt included, gets exactly 0. A mask position
in the prompt and an attribution quantity are refused in one sentence (exit 2)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from gradflow.cli.main import main
from tiny_diffusion_gemma import build_tiny_diffusion_gemma_dir

TEXT = "the cat sat on the mat and looked at the dog"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_diffusion_gemma_dir(tmp_path_factory.mktemp("diffusion_gemma"))


@pytest.mark.parametrize("objective", ["diffusion", "random-canvas"])
def test_channel_view_of_a_two_pass_model(objective, model_dir, tmp_path):
    out = tmp_path / "view"
    assert main(["channels", "--model", str(model_dir), "--text", TEXT, "--out", str(out), "--objective", objective,
                 "--seed", "1", "--format", "png"]) == 0
    table = pd.read_csv(out / "channel_view.csv")
    first = table[table.site == "embeddings.out"].sort_values("position")
    canvas = int(json.loads((model_dir / "config.json").read_text())["canvas_length"])
    n = len(first)
    assert list(first.role[: n - canvas]) == ["prompt"] * (n - canvas)  # the split rule: the last C are the canvas
    assert "prompt" not in set(first.role[n - canvas:])
    assert (first.role.isin(["masked", "random", "kept"])).any()
    assert (first[first.role == "prompt"].grad_norm > 0).all()  # the encoder pass carries gradient to the prompt
    last = table[table.layer == table.layer.max()]
    silent = last[~last.role.isin(["masked", "random", "kept"])]
    assert set(silent.role) >= {"prompt"} and (silent.grad_norm == 0.0).all()  # exactly 0, the prompt included
    assert (last[last.role.isin(["masked", "random", "kept"])].grad_norm > 0).all()
    assert (out / "channel_view.png").is_file()


def _one_sentence(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def test_a_mask_position_in_the_prompt_is_one_sentence(model_dir, tmp_path, capsys):
    assert main(["channels", "--model", str(model_dir), "--text", TEXT, "--out", str(tmp_path / "v"),
                 "--mask-positions", "2"]) == 2
    err = _one_sentence(capsys)
    assert "mask position 2 is in the prompt" in err and "choose a canvas position" in err


def test_attributions_of_a_two_pass_model_are_one_sentence(model_dir, tmp_path, capsys):
    assert main(["channels", "--model", str(model_dir), "--text", TEXT, "--out", str(tmp_path / "v"),
                 "--quantity", "attribution"]) == 2
    assert "use --quantity grad_norm" in _one_sentence(capsys)
