"""``gradflow record`` on a tiny native DiffusionGemma (issue 61, part 3): both objectives, both corpus kinds, and
the one-sentence refusals of a prompt that leaves the canvas no room and of `gradflow check` (not two-pass yet).

The run directory joins the encoder pass (the prompt, role ``prompt``) and the decoder pass (the canvas) of each
depth: at the last layer every after-mixing sublayer has exactly 0 from the prompt (and, under masked diffusion,
from the canvas's ``context``), the key path does not, and the last block's sites get no gradient at the prompt.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from gradflow.adapters.diffusion_gemma import DIFFUSION_GEMMA
from gradflow.cli.main import main
from gradflow.schema import CHANNELS_FILE, EXPERTS_FILE, SUBLAYERS_FILE
from tiny_diffusion_gemma import build_tiny_diffusion_gemma_dir

FLAGS = ["--max-length", "24", "--batch-size", "2", "--limit", "4", "--quiet", "--mask-ratio", "0.5"]
OBJECTIVES = {"diffusion": ("context",), "random-canvas": ()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_diffusion_gemma_dir(tmp_path_factory.mktemp("diffusion_gemma"))


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_records_under_both_objectives(objective, model_dir, tiny_corpus, tmp_path):
    out = tmp_path / "run"
    assert main(["record", "--model", str(model_dir), "--texts", str(tiny_corpus), "--out", str(out),
                 "--objective", objective, *FLAGS]) == 0
    meta = json.loads((out / "meta.json").read_text())
    tokens = meta["counts"]["tokens_per_role"]
    assert tokens["prompt"] > 0 and (tokens["masked"] > 0) == (objective == "diffusion")
    assert (tokens["random"] > 0 and tokens["kept"] > 0 and tokens["context"] == 0) == (objective != "diffusion")
    table = pd.read_csv(out / SUBLAYERS_FILE)
    last = table[table.layer == 3]
    after = set(DIFFUSION_GEMMA.after_mixing())
    for role in ("prompt", *OBJECTIVES[objective]):
        rows = last[last.role == role]
        zero = rows[rows.sublayer.isin(after)]
        assert set(zero.sublayer) == after
        assert (zero.contribution_norm_mean == 0).all() and (zero.n_nonzero == 0).all(), zero
        assert (rows[rows.sublayer == "attn.k"].contribution_norm_mean > 0).all(), role
    loss_roles = ["masked"] if objective == "diffusion" else ["random", "kept"]
    assert (last[last.role.isin(loss_roles)].contribution_norm_mean > 0).all()
    earlier = table[(table.layer == 2) & (table.role == "prompt")]
    assert (earlier.contribution_norm_mean > 0).all()  # the tied weights' prompt pass, below the last block
    channels = pd.read_csv(out / CHANNELS_FILE)
    prompt_last = channels[(channels.layer == 3) & (channels.role == "prompt")]
    assert len(prompt_last) == 2 and (prompt_last.grad_norm_zero_fraction == 1).all()
    assert (channels[(channels.layer == 2) & (channels.role == "prompt")].grad_norm_mean > 0).all()
    assert set(pd.read_csv(out / EXPERTS_FILE).layer) == {1, 2, 3}


def _jsonl(path, prompt: str) -> str:
    rows = [{"prompt": prompt, "response": "The abundant fruits of another year have blessed our country."}] * 3
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_records_prompt_response_pairs(model_dir, tmp_path):
    texts = _jsonl(tmp_path / "pairs.jsonl", "What did the president say?")
    out = tmp_path / "run"
    assert main(["record", "--model", str(model_dir), "--texts", texts, "--prompt-field", "prompt", "--out", str(out),
                 "--objective", "random-canvas", *FLAGS]) == 0
    tokens = json.loads((out / "meta.json").read_text())["counts"]["tokens_per_role"]
    assert tokens["prompt"] > 0 and tokens["random"] + tokens["kept"] + tokens["special"] <= 3 * 8  # the canvas: 8


def test_a_prompt_that_leaves_the_canvas_no_room_is_one_sentence(model_dir, tmp_path, capsys):
    texts = _jsonl(tmp_path / "long.jsonl", " ".join(["the progress of public credit"] * 10))
    code = main(["record", "--model", str(model_dir), "--texts", texts, "--prompt-field", "prompt", "--out",
                 str(tmp_path / "refused"), "--objective", "diffusion", *FLAGS])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err
    assert "line 1: the prompt takes" in err
    assert "leaves none for the response (a two-pass model's canvas: no room)" in err
    assert not (tmp_path / "refused" / "meta.json").exists()


def test_check_refuses_a_two_pass_model_in_one_sentence(model_dir, tiny_corpus, capsys):
    code = main(["check", "--model", str(model_dir), "--texts", str(tiny_corpus), "--max-length", "24"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err
    assert "gradflow check does not run two-pass models yet" in err and "gradflow record does" in err
