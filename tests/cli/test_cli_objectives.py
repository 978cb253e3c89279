"""``--objective`` and its options: a diffusion recording writes each sequence's t; bad input is one sentence."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from gradflow.cli.main import main


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize("extra, message", [
    (["--objective", "diffusion", "--mask-rate", "0.4"],
     "--mask-rate applies to --objective bert or span, not to --objective diffusion"),
    (["--objective", "diffusion", "--whole-word"], "--whole-word applies to --objective bert, not to"),
    (["--eps", "0.01"], "--eps applies to --objective diffusion or random-canvas, not to --objective bert"),
    (["--objective", "random-canvas", "--mask-rate", "0.4"],
     "--mask-rate applies to --objective bert or span, not to --objective random-canvas"),
    (["--objective", "span", "--mask-ratio", "0.5"], "--mask-ratio applies to --objective diffusion"),
    (["--span-p", "0.3"], "--span-p applies to --objective span"),
    (["--objective", "diffusion", "--mask-ratio", "0.5", "--mask-ratios", "0.1,0.9"], "give one of them"),
    (["--objective", "diffusion", "--eps", "0"], "--eps must be in (0, 1)"),
    (["--objective", "diffusion", "--eps", "1"], "--eps must be in (0, 1)"),
    (["--objective", "diffusion", "--mask-ratio", "0"], "--mask-ratio must be in (0, 1]"),
    (["--objective", "diffusion", "--mask-ratio", "1.2"], "--mask-ratio must be in (0, 1]"),
    (["--objective", "diffusion", "--mask-ratios", "0.5,1.5"], "--mask-ratios must be comma-separated numbers"),
    (["--objective", "diffusion", "--mask-ratios", "a,b"], "--mask-ratios must be comma-separated numbers"),
    (["--objective", "span", "--span-max-words", "0"], "--span-max-words must be >= 1"),
], ids=["rate under diffusion", "whole word under diffusion", "eps under bert", "rate under random-canvas",
        "ratio under span",
        "span p under bert", "ratio and grid", "eps 0", "eps 1", "t 0", "t above 1", "grid above 1", "grid not numbers",
        "no span words"])
def test_bad_objective_options_are_one_sentence(tmp_path, capsys, tiny_mlm_dir, tiny_corpus, extra, message):
    out = tmp_path / "o"
    err = _one_line_error(capsys, ["record", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--out",
                                   str(out), "--quiet", *extra])
    assert message in err
    assert not out.exists()  # refused before anything was written


def test_record_diffusion_grid_writes_each_sequences_ratio(tmp_path, tiny_mlm_dir, tiny_corpus):
    out = tmp_path / "run"
    assert main(["record", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--out", str(out),
                 "--objective", "diffusion", "--mask-ratios", "0.2,0.6,1", "--max-length", "24", "--batch-size", "4",
                 "--limit", "12", "--seed", "3", "--quiet"]) == 0
    ratios = pd.read_parquet(out / "mask_ratios.parquet")
    assert ratios["sequence_index"].tolist() == list(range(12))
    assert ratios["mask_ratio"].tolist() == [0.2, 0.6, 1.0] * 4
    meta = json.loads((out / "meta.json").read_text())
    assert meta["masking"] == {"policy": "diffusion", "t": "grid", "eps": 0.001, "ratio": None, "ratios": [0.2, 0.6, 1],
                               "weights": "1/t", "normalisation": meta["masking"]["normalisation"], "seed": 3,
                               "shift": False}
    tokens = meta["counts"]["tokens_per_role"]
    assert tokens["random"] == tokens["kept"] == 0 and tokens["masked"] > 0
    assert "--objective diffusion" in meta["command"]


def test_record_span_and_shift_describe_themselves(tmp_path, tiny_mlm_dir, tiny_corpus):
    out = tmp_path / "span"
    assert main(["record", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--out", str(out),
                 "--objective", "span", "--mask-rate", "0.4", "--shift", "--max-length", "24", "--limit", "8",
                 "--quiet", "--norms-only", "--adapter", "auto"]) == 0  # (BERT's own adapter refuses --shift)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["masking"]["policy"] == "span" and meta["masking"]["rate"] == 0.4 and meta["masking"]["shift"]
    assert not (out / "mask_ratios.parquet").exists()
