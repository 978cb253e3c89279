"""extend_vocabulary (new rows = mean of their old pieces) and NewRowGradients (input side + output side
= autograd's gradient of the new rows, exactly; structural zeros by role)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from conftest import SAMPLE_LINES, build_tiny_mlm_dir
from gradflow.errors import GradflowError
from gradflow.interventions.callback import mlm_roles
from gradflow.interventions.new_rows import CSV_COLUMNS, CSV_NAME, NewRowGradients
from gradflow.interventions.vocabulary import extend_vocabulary, read_word_list

WORDS = ["Treasuries", "stockholder"]  # not one token of the tiny vocabulary; the first is lower-cased


def load(path, tie: bool = True):
    from transformers import AutoTokenizer, BertForMaskedLM

    model = BertForMaskedLM.from_pretrained(path, tie_word_embeddings=tie)
    if not tie:  # make the untied decoder differ from the input embeddings, so the test can tell them apart
        with torch.no_grad():
            model.get_output_embeddings().weight.copy_(torch.randn_like(model.get_output_embeddings().weight))
    return model.double(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_mlm_dir(tmp_path_factory.mktemp("vocab"), layers=2)


@pytest.mark.parametrize("tie", [True, False])
def test_new_rows_are_the_mean_of_their_pieces(tiny_dir, tie):
    model, tok = load(tiny_dir, tie)
    before_in = model.get_input_embeddings().weight.detach().clone()
    before_out = model.get_output_embeddings().weight.detach().clone()
    before_bias = model.get_output_embeddings().bias.detach().clone()
    pieces = [tok(w.lower(), add_special_tokens=False)["input_ids"] for w in WORDS]
    assert all(len(p) > 1 for p in pieces)
    ext = extend_vocabulary(model, tok, WORDS)
    assert ext.words == ("treasuries", "stockholder") and ext.tied is tie
    assert [list(p) for p in ext.pieces] == pieces
    assert list(ext.new_ids) == [before_in.shape[0], before_in.shape[0] + 1]
    emb, dec = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert emb.shape[0] == dec.shape[0] == model.get_output_embeddings().bias.shape[0] == before_in.shape[0] + 2
    assert torch.equal(emb[: before_in.shape[0]], before_in)  # old rows untouched
    for new, old in zip(ext.new_ids, pieces):
        torch.testing.assert_close(emb[new], before_in[old].mean(0), rtol=0, atol=1e-12)
        torch.testing.assert_close(dec[new], (before_in if tie else before_out)[old].mean(0), rtol=0, atol=1e-12)
        torch.testing.assert_close(model.get_output_embeddings().bias[new], before_bias[old].mean(), rtol=0, atol=1e-12)
    # the tokenizer now reads each word as one token, whatever its case
    assert tok("the treasuries", add_special_tokens=False)["input_ids"][-1] == ext.new_ids[0]
    assert tok("The TREASURIES", add_special_tokens=False)["input_ids"][-1] == ext.new_ids[0]


def test_bad_word_lists_are_refused(tiny_dir, tmp_path):
    model, tok = load(tiny_dir)
    with pytest.raises(GradflowError, match="already one token"):
        extend_vocabulary(model, tok, ["The"])
    with pytest.raises(GradflowError, match="not one word"):
        extend_vocabulary(model, tok, ["two words"])
    with pytest.raises(GradflowError, match="no words"):
        extend_vocabulary(model, tok, [])
    empty = tmp_path / "words.txt"
    empty.write_text("# a comment only\n\n", encoding="utf-8")
    with pytest.raises(GradflowError, match="has no words"):
        read_word_list(empty)
    with pytest.raises(GradflowError, match="cannot read"):
        read_word_list(tmp_path / "missing.txt")
    good = tmp_path / "good.txt"
    good.write_text("treasuries\n# skip\n  stockholder \n", encoding="utf-8")
    assert read_word_list(good) == ["treasuries", "stockholder"]


def batch_with_new_tokens(tok, ext):
    """Two sentences reading both new words; position roles set by hand: masked, kept, random, context."""
    enc = tok(["the treasuries and stockholder rise", "the treasuries of the nation"], return_tensors="pt",
              padding=True)
    ids = enc["input_ids"].clone()
    labels = torch.full_like(ids, -100)
    t0, t1 = ext.new_ids
    first = (ids[0] == t0).nonzero().item()
    labels[0, first] = t0
    ids[0, first] = tok.mask_token_id                  # masked: the row is asked for, not read
    second = (ids[1] == t0).nonzero().item()
    labels[1, second] = t0                              # kept: read and asked for
    labels[1, 1] = ids[1, 1]
    ids[1, 1] = t1                                      # random: the other new word read in place of "the"
    return ids, enc["attention_mask"], labels


@pytest.mark.parametrize("tie", [True, False])
def test_input_and_output_sides_sum_to_autograd(tiny_dir, tie):
    model, tok = load(tiny_dir, tie)
    ext = extend_vocabulary(model, tok, WORDS)
    ids, attention, labels = batch_with_new_tokens(tok, ext)
    roles = mlm_roles(ids, labels, attention, tok.mask_token_id, tuple(tok.all_special_ids))
    model.eval()
    with NewRowGradients(model, ext.new_ids) as watch:
        model(input_ids=ids, attention_mask=attention, labels=labels).loss.backward()
    vectors = watch.vectors(roles)
    new = list(ext.new_ids)
    emb, dec = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if tie:
        torch.testing.assert_close(vectors[("input", "all")][0] + vectors[("output", "all")][0], emb.grad[new],
                                   rtol=1e-10, atol=1e-12)
    else:
        torch.testing.assert_close(vectors[("input", "all")][0], emb.grad[new], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(vectors[("output", "all")][0], dec.grad[new], rtol=1e-10, atol=1e-12)
    # structural zeros: a masked occurrence is never read; context positions carry no loss
    assert vectors[("input", "masked")][1] == 0 and torch.count_nonzero(vectors[("input", "masked")][0]) == 0
    assert torch.count_nonzero(vectors[("output", "context")][0]) == 0
    for side_role in (("input", "kept"), ("input", "random"), ("input", "context"), ("output", "masked"),
                      ("output", "kept"), ("output", "random")):
        assert vectors[side_role][0].norm() > 0, side_role
    assert vectors[("input", "kept")][1] == 1 and vectors[("input", "random")][1] == 1
    assert vectors[("input", "context")][1] == 1  # stockholder read in the first sentence
    assert watch._handles == []  # hooks removed on exit


def test_no_backward_is_a_clear_error(tiny_dir):
    model, tok = load(tiny_dir)
    ext = extend_vocabulary(model, tok, WORDS)
    with NewRowGradients(model, ext.new_ids) as watch:
        pass
    with pytest.raises(GradflowError, match="no backward"):
        watch.split(torch.zeros(1, 1, dtype=torch.int8))


def test_continued_mlm_logs_the_new_rows(tiny_dir, tmp_path):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    from transformers import AutoTokenizer, BertForMaskedLM

    from gradflow.interventions.finetune import continue_mlm

    texts = [line.replace("treasury", "treasuries stockholder") for line in SAMPLE_LINES] * 6
    model_dir = continue_mlm(str(tiny_dir), texts, tmp_path, steps=4, batch_size=8, lr=1e-3, seed=0, log_every=2,
                             max_length=32, new_words=WORDS)
    rows = pd.read_csv(tmp_path / CSV_NAME)
    assert tuple(rows.columns) == CSV_COLUMNS and set(rows.step) == {1, 2, 4}
    assert set(rows.side) == {"input", "output"}
    output_all = rows[(rows.side == "output") & (rows.role == "all")]
    assert (output_all.grad_norm > 0).all()  # the softmax pushes every row at every loss position
    meta = json.loads((tmp_path / "continued.json").read_text())
    assert meta["vocabulary_extension"]["words"] == ["treasuries", "stockholder"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = BertForMaskedLM.from_pretrained(model_dir)
    new = meta["vocabulary_extension"]["new_ids"]
    assert tok.convert_tokens_to_ids("treasuries") == new[0]
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
