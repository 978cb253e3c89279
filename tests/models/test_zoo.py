"""The zoo of third-party MLM checkpoints from PyPI wheels.

Unit tests run everywhere. Tests marked ``zoo`` need the converted models (``gradflow zoo fetch
antiberty rxnfp``) and skip otherwise.
"""

from __future__ import annotations

import json

import pytest
import torch

from gradflow import BertMasking, GradFlowRecorder, Role, mask_batch
from gradflow.models.zoo import (
    RESIDUE_REGEX,
    SMILES_REGEX,
    ZOO,
    ZooError,
    _mlm_state_dict,
    build_tokenizer,
    example_inputs,
    reference_pieces,
    resolve,
    zoo_list,
    zoo_path,
)

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

# Top-1 accuracy at masked positions of the example inputs (15% masked, torch seed 0), measured
# with transformers 5.23 on CPU: antiberty 0.916 (seeds 0-4: 0.84-0.92), rxnfp 0.929 (seeds 0-4:
# 0.90-0.94). Chance is 1/25 and 1/591. Thresholds leave a wide margin for numeric drift.
ACCURACY_THRESHOLD = {"antiberty": 0.75, "rxnfp": 0.80}


# ----------------------------------------------------------------------------- no download needed
def test_unknown_name_lists_known_models():
    with pytest.raises(ZooError, match="unknown zoo model 'nope'.*antiberty, rxnfp"):
        zoo_path("nope")


def test_missing_model_says_how_to_fetch(tmp_path):
    assert zoo_path("rxnfp", cache_dir=tmp_path) is None
    with pytest.raises(ZooError, match=r"zoo model 'rxnfp' is not fetched: run `gradflow zoo fetch rxnfp`"):
        resolve("rxnfp", cache_dir=tmp_path)


def test_list_contents(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADFLOW_CACHE", str(tmp_path))
    rows = zoo_list()
    assert [r["name"] for r in rows] == ["antiberty", "rxnfp"]
    assert {r["wheel"] for r in rows} == {"antiberty==0.1.3", "rxnfp==0.1.0"}
    assert all(r["path"] is None and r["description"] for r in rows)


def test_example_inputs_ship_with_the_package():
    antibodies = example_inputs("antiberty")
    reactions = example_inputs("rxnfp")
    assert 8 <= len(antibodies) <= 15 and 10 <= len(reactions) <= 20
    assert all(set(s) <= set("ACDEFGHIKLMNPQRSTVWY") and 100 <= len(s) <= 130 for s in antibodies)
    assert all(s.count(">>") == 1 for s in reactions)


def test_smiles_regex_presplit_before_wordpiece():
    vocab = SPECIALS + ["C", "c", "1", "(", ")", "=", "O", "Br", "Cl", ".", ">>", "[N+]", "[O-]"]
    tok = build_tokenizer(vocab, SMILES_REGEX)
    smiles = "Brc1ccccc1.ClC(=O)C>>O=[N+]([O-])[Si]"
    assert reference_pieces(smiles, SMILES_REGEX)[:6] == ["Br", "c", "1", "c", "c", "c"]
    # Br and Cl stay whole, bracket atoms are one piece; an unknown bracket atom is one [UNK]
    assert tok.tokenize(smiles) == ["Br", "c", "1", "c", "c", "c", "c", "c", "1", ".", "Cl", "C", "(", "=", "O",
                                    ")", "C", ">>", "O", "=", "[N+]", "(", "[O-]", ")", "[UNK]"]
    ids = tok("CC")["input_ids"]
    assert ids == [vocab.index("[CLS]"), vocab.index("C"), vocab.index("C"), vocab.index("[SEP]")]
    assert tok.decode(tok("C(=O)Cl")["input_ids"], skip_special_tokens=True) == "C(=O)Cl"


def test_residue_tokenizer_one_token_per_amino_acid():
    vocab = SPECIALS + list("ACDEFGHIKLMNPQRSTVWY")
    tok = build_tokenizer(vocab, RESIDUE_REGEX)
    assert tok.tokenize("EVQLV") == tok.tokenize("E V Q L V") == list("EVQLV")
    assert tok.tokenize("EV[MASK]LX") == ["E", "V", "[MASK]", "L", "[UNK]"]


def test_tokenizer_round_trip_keeps_pre_split(tmp_path):
    from transformers import AutoTokenizer

    vocab = SPECIALS + ["C", "Cl", "O", "=", "(", ")"]
    build_tokenizer(vocab, SMILES_REGEX).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": len(vocab)}))
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded.is_fast and len(reloaded) == len(vocab) and reloaded.mask_token == "[MASK]"
    assert reloaded.tokenize("ClC(=O)Cl") == ["Cl", "C", "(", "=", "O", ")", "Cl"]


def _tiny_state():
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=12, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=16, max_position_embeddings=16)
    torch.manual_seed(0)
    state = dict(BertForMaskedLM(config).state_dict())
    state["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"]
    state["bert.pooler.dense.weight"] = torch.zeros(8, 8)
    return config, state


def test_state_dict_check_accepts_and_drops_heads():
    config, state = _tiny_state()
    kept, dropped = _mlm_state_dict(config, state, ("bert.pooler.",))
    assert "bert.pooler.dense.weight" in dropped and "cls.predictions.decoder.weight" in dropped
    assert "bert.embeddings.word_embeddings.weight" in kept


@pytest.mark.parametrize("change, message", [
    (lambda s: s.pop("bert.encoder.layer.0.output.dense.weight"), "missing"),
    (lambda s: s.__setitem__("cls.extra.weight", torch.zeros(2)), "unexpected"),
    (lambda s: s.__setitem__("cls.predictions.decoder.weight", torch.zeros(12, 8)), "not tied"),
])
def test_state_dict_check_refuses_mismatches(change, message):
    config, state = _tiny_state()
    change(state)
    with pytest.raises(ZooError, match=message):
        _mlm_state_dict(config, state, ("bert.pooler.",))


# ------------------------------------------------------------------------------- fetched models
def _fetched(name: str):
    path = zoo_path(name)
    if path is None:
        pytest.skip(f"zoo model {name!r} is not fetched (run `gradflow zoo fetch {name}`)")
    return path


def _load(name: str):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    path = _fetched(name)
    return AutoModelForMaskedLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path), path


@pytest.mark.zoo
@pytest.mark.parametrize("name", sorted(ZOO))
def test_fetched_model_loads_with_provenance(name):
    model, tokenizer, path = _load(name)
    e = ZOO[name]
    assert model.config.model_type == "bert" and model.config.num_hidden_layers == e.num_layers
    assert model.config.hidden_size == e.hidden_size
    assert tokenizer.is_fast and len(tokenizer) == model.config.vocab_size and tokenizer.mask_token == "[MASK]"
    meta = json.loads((path / "zoo.json").read_text())
    assert meta["wheel"] == e.wheel and meta["wheel_sha256"] == e.sha256
    assert meta["source"].startswith(e.model_dir)


@pytest.mark.slow
@pytest.mark.zoo
@pytest.mark.parametrize("name", sorted(ZOO))
def test_masked_token_accuracy(name):
    model, tokenizer, _ = _load(name)
    enc = tokenizer(example_inputs(name), return_tensors="pt", padding=True, return_special_tokens_mask=True)
    ids = enc["input_ids"]
    maskable = (enc["special_tokens_mask"] == 0) & (enc["attention_mask"] == 1)
    generator = torch.Generator().manual_seed(0)
    chosen = maskable & (torch.rand(ids.shape, generator=generator) < 0.15)
    inputs = ids.masked_fill(chosen, tokenizer.mask_token_id)
    with torch.no_grad():
        logits = model(input_ids=inputs, attention_mask=enc["attention_mask"]).logits
    accuracy = (logits.argmax(-1)[chosen] == ids[chosen]).float().mean().item()
    assert chosen.sum() > 50
    assert accuracy > ACCURACY_THRESHOLD[name], f"{name}: top-1 accuracy {accuracy:.3f}"


@pytest.mark.slow
@pytest.mark.zoo
@pytest.mark.parametrize("name", sorted(ZOO))
def test_last_block_gradient_is_exactly_zero_off_loss(name):
    model, tokenizer, _ = _load(name)
    batch = mask_batch(tokenizer, example_inputs(name)[:6], BertMasking(seed=0), max_length=256)
    with GradFlowRecorder(model) as rec:
        record = rec.record(batch)
    grad, _ = record.site(f"blocks.{record.num_blocks - 1}.out")  # (B, T) gradient norms
    off_loss = (batch.roles == Role.CONTEXT) | (batch.roles == Role.SPECIAL) | (batch.roles == Role.PAD)
    assert record.num_blocks == ZOO[name].num_layers
    assert off_loss.any() and torch.all(grad[off_loss] == 0)
    assert torch.all(grad[batch.roles == Role.MASKED] > 0)


def test_example_inputs_path_is_the_shipped_file():
    from pathlib import Path

    from gradflow.models.zoo import example_inputs, example_inputs_path

    for name in ("antiberty", "rxnfp"):
        path = Path(example_inputs_path(name))
        assert path.is_file() and path.name == f"{name}.txt"
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        assert lines == example_inputs(name) and lines
