"""Recording masked diffusion LMs end to end: the exact last-block zero at every masking ratio of a grid, on every
supported diffusion family (LLaDA unshifted, Dream shifted, a BERT under the diffusion objective), from the run's
own per-sequence tables; and the head's shift checked against the objective's."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from gradflow.cli.main import main
from models.remote_code.tiny_remote import build_dream_tiny, build_llada_tiny

GRID = "0.1,0.3,0.5,0.7,0.9,1"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_mlm_dir) -> dict:
    return {"llada": build_llada_tiny(tmp_path_factory.mktemp("llada")),
            "dream": build_dream_tiny(tmp_path_factory.mktemp("dream")), "bert": tiny_mlm_dir}


def _record(model, corpus, out, *extra) -> int:
    return main(["record", "--model", str(model), "--texts", str(corpus), "--out", str(out), "--objective",
                 "diffusion", "--mask-ratios", GRID, "--max-length", "24", "--batch-size", "6", "--limit", "18",
                 "--quiet", *extra])


@pytest.mark.parametrize("family, extra", [("llada", ["--trust-remote-code"]),
                                           ("dream", ["--trust-remote-code", "--shift"]), ("bert", [])])
def test_exact_zero_at_every_ratio_of_a_grid(tmp_path, checkpoints, tiny_corpus, family, extra):
    out = tmp_path / family
    assert _record(checkpoints[family], tiny_corpus, out, *extra) == 0
    meta = json.loads((out / "meta.json").read_text())
    zero = set(meta["after_mixing_sublayers"])
    assert {"attn.q", "attn.out", "ffn.out"} <= zero
    last = meta["num_layers"]
    ratios = pd.read_parquet(out / "mask_ratios.parquet")
    assert sorted(ratios["mask_ratio"].unique()) == [0.1, 0.3, 0.5, 0.7, 0.9, 1.0]
    sums = pd.read_parquet(out / "sublayer_sequences.parquet").merge(ratios, on="sequence_index")
    at_last = sums[sums["layer"] == last]
    checked = 0
    for t, rows in at_last.groupby("mask_ratio"):
        context = rows[rows["role"] == "context"]
        loss = rows[rows["role"] == "masked"]
        assert len(loss) and (loss.groupby("sublayer")["magnitude_sum"].sum() > 0).all(), t
        after = context[context["sublayer"].isin(zero)]
        assert (after["magnitude_sum"] == 0).all(), (family, t)  # exactly zero, at every ratio
        checked += (after["n_positions"] > 0).sum()
        mixing = context[context["sublayer"].isin({"attn.k", "attn.v"})]
        assert t == 1.0 or (mixing["magnitude_sum"] > 0).any(), (family, t)  # context still feeds the keys
    assert checked > 0
    grads = pd.read_parquet(out / "sequences.parquet")
    out_site = grads[(grads["layer"] == last) & (grads["point"] == "out")]
    assert (out_site[out_site["role"] == "context"]["grad_norm_sum"] == 0).all()


def test_the_shift_must_match_the_head(tmp_path, checkpoints, tiny_corpus, capsys):
    assert _record(checkpoints["dream"], tiny_corpus, tmp_path / "d", "--trust-remote-code") == 2
    assert "trained with a shifted head" in capsys.readouterr().err and not (tmp_path / "d").exists()
    assert _record(checkpoints["llada"], tiny_corpus, tmp_path / "l", "--trust-remote-code", "--shift") == 2
    assert "drop --shift" in capsys.readouterr().err
    assert _record(checkpoints["bert"], tiny_corpus, tmp_path / "b", "--shift") == 2
    assert "predicts each token at its own position" in capsys.readouterr().err
    # the generic adapter cannot tell a shifted head: both objectives are taken
    assert _record(checkpoints["dream"], tiny_corpus, tmp_path / "a", "--trust-remote-code",
                   "--adapter", "auto") == 0
    assert json.loads((tmp_path / "a" / "meta.json").read_text())["masking"]["shift"] is False
    # (and LLaDA, whose LLaDAModelLM calls its base model as .forward(): three batches through the generic adapter)
    assert _record(checkpoints["llada"], tiny_corpus, tmp_path / "s", "--trust-remote-code", "--shift",
                   "--adapter", "auto") == 0
    assert json.loads((tmp_path / "s" / "meta.json").read_text())["counts"]["batches"] == 3
