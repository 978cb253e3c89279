"""The ``prompt`` role: masking a prompt/response window gives ``prompt`` on exactly the prompt's non-special tokens,
never selects them, and leaves them out of the all-positions loss only where they are special."""

from __future__ import annotations

import pytest
import torch

from gradflow.inputs.masking import BertMasking, MaskedDiffusion, SpanMasking, mask_batch
from gradflow.inputs.prompted import prompted_encoding
from gradflow.losses import all_positions_labels
from gradflow.roles import Role

PAIRS = [("What did the president say about public credit?",
          "The progress of public credit is witnessed by a considerable rise of American stock abroad."),
         ("Name a [MASK] blessing.", "The abundant fruits of another year have blessed our country with plenty."),
         ("What must we ensure?", "We must ensure that the laws are faithfully executed.")]
POLICIES = [MaskedDiffusion(ratio=1.0, seed=3), MaskedDiffusion(seed=3, min_selected=1),
            MaskedDiffusion(ratio=1.0, seed=3, shift=True), BertMasking(rate=1.0, seed=3),
            SpanMasking(rate=0.9, seed=3), BertMasking(rate=1.0, seed=3, shift=True)]
IDS = ["diffusion at t = 1", "diffusion t ~ U", "shifted diffusion at t = 1", "BERT at rate 1", "span masking at 0.9",
       "shifted BERT at rate 1"]


@pytest.fixture(scope="module")
def tokenizer(tiny_mlm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_mlm_dir)


def _expected_prompt(tokenizer, enc: dict) -> torch.Tensor:
    """(T,) bool: the prompt's positions that hold no special id (a literal "[MASK]" in the prompt is special)."""
    special = set(tokenizer.all_special_ids) - {tokenizer.unk_token_id}
    return torch.tensor([t < enc["prompt_length"] and not enc["special_tokens_mask"][t] and i not in special
                         for t, i in enumerate(enc["input_ids"])])


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_prompt_role_is_exactly_the_prompts_non_special_tokens_and_never_selected(tokenizer, policy):
    encodings = [prompted_encoding(tokenizer, p, r, 64, f"pair {i}") for i, (p, r) in enumerate(PAIRS)]
    batch = mask_batch(tokenizer, encodings=encodings, policy=policy, max_length=64)
    inputs = batch.clean_input_roles()
    for row, enc in enumerate(encodings):
        n = len(enc["input_ids"])
        want = _expected_prompt(tokenizer, enc)
        assert want.sum() >= 3 and torch.equal(inputs[row, :n] == Role.PROMPT, want)
        assert torch.equal(batch.roles[row, :n] == Role.PROMPT, want)  # loss side too: a prompt token's successor
        #                                                                is a prompt token or [SEP], never selected
        prompt = slice(0, enc["prompt_length"])
        assert torch.equal(batch.input_ids[row, prompt], batch.original_ids[row, prompt])  # never corrupted
        assert (batch.labels[row, :n][want] == -100).all()  # never selected, no loss
        assert ((inputs[row, enc["prompt_length"]:n] <= Role.KEPT) | (inputs[row, enc["prompt_length"]:n]
                                                                     == Role.CONTEXT)).sum() >= 5
    assert not bool((batch.roles[batch.attention_mask == 0] != Role.PAD).any())
    if getattr(policy, "ratio", None) == 1.0 or getattr(policy, "rate", None) == 1.0:  # every response token drawn
        assert not bool((inputs == Role.CONTEXT).any())  # so nothing is context: the prompt is not


def test_a_literal_special_token_in_the_prompt_stays_special(tokenizer):
    enc = prompted_encoding(tokenizer, *PAIRS[1], 64, "pair 1")
    batch = mask_batch(tokenizer, encodings=[enc], policy=MaskedDiffusion(ratio=0.5, seed=0), max_length=64)
    at = enc["input_ids"].index(tokenizer.mask_token_id)
    assert at < enc["prompt_length"] and batch.roles[0, at] == Role.SPECIAL


def test_the_all_positions_loss_still_reads_the_prompt(tokenizer):
    """``all-positions`` is every non-special, non-pad position: the prompt's tokens as before they had a role."""
    encodings = [prompted_encoding(tokenizer, p, r, 64, "pair") for p, r in PAIRS]
    batch = mask_batch(tokenizer, encodings=encodings, policy=MaskedDiffusion(ratio=0.5, seed=1), max_length=64)
    labels = all_positions_labels(batch)
    prompt = batch.roles == Role.PROMPT
    assert bool(prompt.any()) and torch.equal(labels[prompt], batch.original_ids[prompt])
    assert torch.equal(labels != -100, (batch.roles != Role.SPECIAL) & (batch.roles != Role.PAD))
