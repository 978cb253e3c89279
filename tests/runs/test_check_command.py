"""``gradflow check``: measured exact zeros per block and parameter, theory comparison, FLOP share, CLI."""

from __future__ import annotations

import json

import pytest
import torch

from gradflow.adapters import adapter_for
from gradflow.runs.check import check_batch, check_model
from gradflow.cli import main
from tiny import tiny_batch, tiny_model

JSON_KEYS = {"model", "model_type", "family", "attn_norm", "num_blocks", "batch", "params", "sublayers", "unsplit",
             "theory", "flops", "skippable_share", "notes", "shared_parameters"}
FLOP_KEYS = {"tokens", "loss_tokens", "unselected_tokens", "blocks_linear", "attention", "encoder_other", "head",
             "non_token", "head_unselected", "total", "skippable_sublayers", "skippable", "skippable_attention", "share",
             "share_with_attention"}


def _flagged(result, layer: int, standard: bool = True) -> set[str]:
    return {s.sublayer for s in result.flagged(layer) if s.standard == standard}


@pytest.mark.parametrize("family", ["bert", "roberta-prelayernorm", "esmc"])
def test_measured_zeros_agree_with_theory(family):
    model = tiny_model(family)
    result = check_batch(model, tiny_batch())
    adapter = adapter_for(model)
    last = result.num_blocks
    assert result.disagreements == [] and result.to_dict()["theory"]["agree"] is True
    assert _flagged(result, last) == set(adapter.after_mixing())
    assert ("attn.norm" in _flagged(result, last)) == (adapter.attn_norm == "post")
    assert {"attn.k", "attn.v"}.isdisjoint(_flagged(result, last))
    for layer in range(1, last):  # earlier blocks: nothing flagged, and context always sends gradient
        assert result.flagged(layer) == []
        assert all(p.context_zero is False for p in result.params if p.layer == layer)
    for p in result.params:
        if p.layer == last and p.sublayer in adapter.after_mixing():
            # measured: context and special send exactly 0.0, and so does padding; loss roles do not
            assert {"context", "special", "pad"} <= set(p.zero_roles) and p.positions_nonzero["context"] == 0
            assert p.contribution["context"] == 0.0 and p.loss_nonzero
    agreements = {(s.layer, s.sublayer) for s in result.agreements}
    assert {(last, name) for name in adapter.after_mixing()} <= agreements


def test_other_modules_of_the_block_are_measured_too():
    result = check_batch(tiny_model("esmc"), tiny_batch())
    last = result.num_blocks
    assert _flagged(result, last, standard=False) == {"self_attn.q_norm"}  # k_norm gets context gradient
    assert all(not s.flagged for s in result.sublayers if s.layer < last)
    assert result.unsplit == []


def test_a_block_parameter_that_cannot_be_split_is_listed_with_its_reason():
    result = check_batch(tiny_model("convbert"), tiny_batch())
    assert result.disagreements == []
    reasons = {row["parameter"]: row["reason"] for row in result.unsplit if row["layer"] == result.num_blocks}
    assert "Conv1d" in reasons["attention.self.key_conv_attn_layer.depthwise.weight"]
    assert "attention.self.conv_kernel_layer" in _flagged(result, result.num_blocks, standard=False)


def test_flop_share_equals_a_hand_computation():
    torch.manual_seed(0)
    batch = tiny_batch()  # 3 rows of 12; the last has 8 real tokens; 6 loss positions
    result = check_batch(tiny_model("bert"), batch)
    h, i, v, layers = 32, 48, 64, 3
    n, n_loss, sq_lengths = 12 + 12 + 8, 6, 12 ** 2 + 12 ** 2 + 8 ** 2
    block_linear = 4 * h * h + 2 * h * i
    total = 3 * (2 * n * layers * block_linear + 2 * layers * sq_lengths * (h + h) + 2 * n_loss * (h * h + h * v))
    skippable = 3 * 2 * (n - n_loss) * (h * h + h * h + h * i + i * h)  # attn.q, attn.out, ffn.in, ffn.out
    f = result.flops
    assert (f.tokens, f.loss_tokens, f.unselected_tokens) == (n, n_loss, n - n_loss)
    assert f.total == pytest.approx(total, rel=1e-12) and f.skippable == pytest.approx(skippable, rel=1e-12)
    assert result.skippable_share == pytest.approx(skippable / total, rel=1e-12)
    unselected = [12 - 2, 12 - 3, 8 - 1]
    rows = 3 * 2 * sum(u * length for u, length in zip(unselected, (12, 12, 8))) * (h + h)
    assert f.skippable_attention == pytest.approx(rows, rel=1e-12)
    assert f.head_unselected == pytest.approx(3 * 2 * (n - n_loss) * (h * h + h * v), rel=1e-12)


def test_json_output_has_the_documented_keys(tiny_mlm_dir, tiny_corpus, capsys):
    code = main(["check", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--batch-size", "4",
                 "--max-length", "32", "--seed", "3", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out)
    assert set(data) == JSON_KEYS and set(data["flops"]) == FLOP_KEYS
    assert data["theory"]["agree"] is True and data["theory"]["disagreements"] == []
    assert set(data["theory"]["last_block_expected_zero"]) == {"attn.q", "attn.out", "attn.norm", "ffn.in",
                                                               "ffn.out", "ffn.norm"}
    assert data["batch"]["seed"] == 3 and data["batch"]["sequences"] == 4 and data["num_blocks"] == 2
    assert {"layer", "sublayer", "param", "zero_roles", "context_zero", "flagged"} <= set(data["params"][0])
    assert 0 < data["skippable_share"] < 1
    assert data["shared_parameters"] == [] and data["notes"] == []  # no weight sharing in BERT


def test_check_model_takes_a_loaded_model(tiny_mlm_dir, tiny_corpus):
    from gradflow.models import load_model

    loaded = load_model(str(tiny_mlm_dir))
    result = check_model(loaded, str(tiny_corpus), batch_size=2, max_length=32, seed=1)
    assert result.model == str(tiny_mlm_dir) and result.batch["sequences"] == 2 and result.disagreements == []
    assert {s.sublayer for s in result.flagged(2)} == set(loaded.adapter.after_mixing())


def test_text_output_is_a_table(tiny_mlm_dir, tiny_corpus, capsys):
    assert main(["check", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--max-length", "32"]) == 0
    out = capsys.readouterr().out
    assert "disagreements: none" in out and "Skippable compute:" in out
    assert any(line.split()[:2] == ["2", "attn.q"] and line.rstrip().endswith("*") for line in out.splitlines())


@pytest.mark.parametrize("case, message", [
    ("missing-texts", "does not exist"),
    ("missing-model", "does not exist"),
    ("not-mlm", "no masked-LM head"),
    ("batch-size", "--batch-size"),
    ("max-length", "--max-length"),
])
def test_bad_input_exits_2_with_a_clear_message(case, message, tmp_path, tiny_mlm_dir, bare_encoder_dir, capsys):
    args = {"missing-texts": ["--model", str(tiny_mlm_dir), "--texts", str(tmp_path / "nope.txt")],
            "missing-model": ["--model", str(tmp_path / "no-model")],
            "not-mlm": ["--model", str(bare_encoder_dir)],
            "batch-size": ["--model", str(tiny_mlm_dir), "--batch-size", "0"],
            "max-length": ["--model", str(tiny_mlm_dir), "--max-length", "4096"]}[case]
    assert main(["check", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradflow: error:") and message in err and "Traceback" not in err


def test_embedded_model():
    result = check_model("gradflow-mini-en", batch_size=2, max_length=64)
    assert result.model_type == "roformer" and result.num_blocks == 6 and result.disagreements == []
    assert _flagged(result, 6) == {"attn.q", "attn.out", "attn.norm", "ffn.in", "ffn.out", "ffn.norm"}
    assert all(result.flagged(layer) == [] for layer in range(1, 6))
    assert 0.05 < result.skippable_share < 0.2
    assert result.batch["texts"] == "gradflow:data/sotu_sample.txt"
