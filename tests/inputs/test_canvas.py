"""Batches of prompt and canvas for a two-pass model (:mod:`gradflow.inputs.canvas`) and the random-canvas objective.

The split rule of a plain corpus (the canvas is a window's last ``min(C, n - 1)`` tokens), a prompt/response window's
canvas cut to ``C``, the refusal of a prompt that leaves the canvas no room, the (B, P + C) layout (prompts and
canvases right-padded, the prompt's positions ``prompt``), and DiffusionGemma's published recipe as an objective:
every canvas token carries the loss, a ratio t of them replaced by random tokens, weight 1.
"""

from __future__ import annotations

import pytest
import torch

from gradflow.errors import CorpusError, MaskingError
from gradflow.inputs.canvas import canvas_batch, split_encoding
from gradflow.inputs.corpus import Window
from gradflow.inputs.masking import MaskedDiffusion, encode, mask_batch
from gradflow.inputs.pipeline import mask_windows
from gradflow.inputs.prompted import prompted_encoding
from gradflow.losses import mlm_loss
from gradflow.roles import Role

TEXTS = ["The progress of public credit is witnessed by a considerable rise of American stock abroad.",
         "Congress will consider the state of the treasury."]


@pytest.fixture(scope="module")
def tokenizer(tiny_mlm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_mlm_dir)


def test_split_rule_of_a_plain_window():
    encoding = {"input_ids": list(range(10, 22)), "special_tokens_mask": [False] * 12}
    split = split_encoding(encoding, 8, "sequence 0")
    assert split["prompt_length"] == 4 and split["input_ids"] == encoding["input_ids"]  # the last 8 are the canvas
    short = split_encoding({"input_ids": [1, 2, 3], "special_tokens_mask": [False] * 3}, 8, "sequence 1")
    assert short["prompt_length"] == 1  # c = min(C, n - 1): the prompt keeps one token
    assert "prompt_length" not in encoding  # the window itself is left as it was
    with pytest.raises(CorpusError) as err:  # one token (a tokenizer adding no special token): no room for both
        split_encoding({"input_ids": [5], "special_tokens_mask": [False]}, 8, "sequence 3")
    assert str(err.value) == ("sequence 3: a window of 1 token(s) cannot hold both a prompt and a canvas (one token "
                              "each); raise --max-length to 2 or more, or drop the one-token document.")


def test_a_response_longer_than_the_canvas_is_cut_and_a_full_prompt_refused(tokenizer):
    enc = prompted_encoding(tokenizer, "What did the president say?", TEXTS[0], 64, "line 1")
    split = split_encoding(enc, 5, "sequence 0")
    assert split["prompt_length"] == enc["prompt_length"] and len(split["input_ids"]) == enc["prompt_length"] + 5
    assert split["word_ids"] == enc["word_ids"][:enc["prompt_length"] + 5]
    full = dict(enc, prompt_length=len(enc["input_ids"]))
    with pytest.raises(CorpusError) as err:
        split_encoding(full, 5, "sequence 7")
    message = str(err.value)
    assert message.startswith("sequence 7: the prompt takes") and "leaves the canvas no room" in message
    assert message.count(". ") == 0 and message.endswith("shorten the prompt.")


def test_layout_pads_prompt_and_canvas_and_names_the_prompt(tokenizer):
    encodings = [split_encoding(encode(tokenizer, text), 6, f"sequence {i}") for i, text in enumerate(TEXTS)]
    flat = mask_batch(tokenizer, policy=MaskedDiffusion(ratio=0.5, seed=1), encodings=encodings, max_length=64)
    prompts = [e["prompt_length"] for e in encodings]
    batch = canvas_batch(flat, prompts, tokenizer.pad_token_id)
    width = max(prompts)
    assert batch.prompt_width == width and batch.input_ids.shape == (2, width + 6)
    for b, (enc, p) in enumerate(zip(encodings, prompts)):
        n = len(enc["input_ids"])
        assert batch.input_ids[b, :p].tolist() == flat.input_ids[b, :p].tolist()
        assert batch.input_ids[b, width:width + n - p].tolist() == flat.input_ids[b, p:n].tolist()
        assert batch.labels[b, width:width + n - p].tolist() == flat.labels[b, p:n].tolist()
        assert (batch.roles[b, :p] == Role.PROMPT).all() and (batch.roles[b, p:width] == Role.PAD).all()
        assert (batch.attention_mask[b, p:width] == 0).all() and (batch.labels[b, :width] == -100).all()
    assert batch.roles[0, 0] == Role.PROMPT  # [CLS]: special in the window, a prompt token of the encoder
    assert torch.equal(batch.loss_norm, flat.loss_norm)
    with pytest.raises(CorpusError, match="leaves the canvas no room"):
        canvas_batch(flat, [int(flat.attention_mask[0].sum()), 2], tokenizer.pad_token_id)


def test_random_canvas_objective_puts_the_loss_on_every_canvas_token(tokenizer):
    policy = MaskedDiffusion(ratio=0.5, seed=2, corruption="random")
    windows = [Window(i, i, 0, encode(tokenizer, text)) for i, text in enumerate(TEXTS)]
    batch = mask_windows(tokenizer, windows, policy, 64, canvas=8)
    canvas = batch.roles[:, batch.prompt_width:]
    real = batch.attention_mask[:, batch.prompt_width:] == 1
    loss = (canvas == Role.RANDOM) | (canvas == Role.KEPT)
    assert torch.equal(loss, real & (canvas != Role.SPECIAL))  # every maskable canvas token carries the loss
    assert (canvas == Role.RANDOM).any() and (canvas == Role.KEPT).any() and not (canvas == Role.MASKED).any()
    kept = batch.roles == Role.KEPT
    assert torch.equal(batch.input_ids[kept], batch.original_ids[kept])
    assert torch.equal(batch.labels != -100, (batch.roles == Role.RANDOM) | kept)
    assert set(batch.loss_weights[batch.labels != -100].tolist()) == {1.0}
    assert batch.loss_norm.tolist() == real.sum(dim=1).float().tolist() and batch.mean_over_sequences
    logits = torch.zeros(*batch.input_ids.shape, len(tokenizer))
    assert float(mlm_loss(logits, batch)) == pytest.approx(torch.log(torch.tensor(float(len(tokenizer)))).item()
                                                           * float((loss.sum(1) / real.sum(1)).mean()), rel=1e-6)
    described = policy.describe()
    assert described["corruption"] == "random" and described["weights"] == "1"
    assert "corruption" not in MaskedDiffusion().describe()  # masked diffusion's meta.json as before
    with pytest.raises(MaskingError, match="mask or random"):
        MaskedDiffusion(corruption="uniform")
