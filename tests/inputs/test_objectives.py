"""The objectives as data: masked diffusion, span masking, the shift, and each loss against a hand-written reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gradflow.errors import MaskingError
from gradflow.inputs.masking import (
    BertMasking,
    MaskedDiffusion,
    SpanMasking,
    TokenizerInfo,
    draw_sequence,
    mask_batch,
    shift_to_loss_side,
)
from gradflow.inputs.objectives import select_spans
from gradflow.losses import all_positions_labels, get_loss, head_loss
from gradflow.roles import Role

INFO = TokenizerInfo(mask_token_id=4, vocab_size=64, special_ids=(0, 1, 2, 3, 4), pad_token_id=0)
LOSS = (Role.MASKED, Role.RANDOM, Role.KEPT)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_mlm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_mlm_dir)


def _sequence(n: int, seed: int = 0) -> tuple[list[int], list[bool]]:
    """[CLS] n random words [SEP]: ids and special_tokens_mask."""
    words = np.random.default_rng(seed).integers(5, 64, size=n).tolist()
    return [2, *words, 3], [True] + [False] * n + [True]


# ---------------------------------------------------------------------------------------------- masked diffusion

def test_diffusion_draws_t_per_sequence_from_u_eps_1_and_masks_every_selected_token():
    ids, special = _sequence(400)
    policy = MaskedDiffusion(eps=0.05, seed=3)
    ratios, fractions = [], []
    for index in range(40):
        draw = draw_sequence(ids, special, index, policy, INFO)
        roles = np.array(draw.roles)
        assert set(roles[1:-1].tolist()) <= {Role.MASKED, Role.CONTEXT}  # no random, no kept
        assert roles[0] == roles[-1] == Role.SPECIAL
        masked = roles == Role.MASKED
        assert (np.array(draw.input_ids)[masked] == INFO.mask_token_id).all()
        assert draw.weight == pytest.approx(1 / draw.ratio) and draw.norm == len(ids)
        assert draw_sequence(ids, special, index, policy, INFO) == draw  # seeded by (seed, index)
        ratios.append(draw.ratio)
        fractions.append(masked.sum() / 400)
    ratios = np.array(ratios)
    assert ((ratios >= 0.05) & (ratios <= 1)).all() and ratios.std() > 0.2  # drawn, not fixed
    assert np.abs(np.array(fractions) - ratios).max() < 0.1  # each token selected with probability t
    other = draw_sequence(ids, special, 0, MaskedDiffusion(eps=0.05, seed=4), INFO)
    assert other.ratio != ratios[0]


def test_fixed_ratio_and_grid_by_sequence_index():
    ids, special = _sequence(30)
    assert draw_sequence(ids, special, 5, MaskedDiffusion(ratio=0.3), INFO).ratio == 0.3
    grid = MaskedDiffusion(ratios=(0.1, 0.5, 0.9))
    assert [draw_sequence(ids, special, i, grid, INFO).ratio for i in range(5)] == [0.1, 0.5, 0.9, 0.1, 0.5]
    full = draw_sequence(ids, special, 0, MaskedDiffusion(ratio=1.0), INFO)
    assert full.roles[1:-1] == [Role.MASKED] * 30 and full.weight == 1.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(eps=0.0), "eps must be in \\(0, 1\\)"), (dict(eps=1.0), "eps must be in"),
    (dict(ratio=0.0), "masking ratio t must be in \\(0, 1\\]"), (dict(ratio=1.5), "masking ratio t"),
    (dict(ratios=(0.5, 0.0)), "every masking ratio of the grid"), (dict(ratio=0.5, ratios=(0.5,)), "not both"),
    (dict(min_selected=-1), "min_selected"),
], ids=["eps 0", "eps 1", "t 0", "t above 1", "grid with 0", "fixed and grid", "negative min_selected"])
def test_diffusion_refuses_bad_parameters(kwargs, match):
    with pytest.raises(MaskingError, match=match):
        MaskedDiffusion(**kwargs)


def test_prompt_is_never_masked_and_the_response_is_the_normaliser():
    ids, special = _sequence(40)
    for index in range(20):
        draw = draw_sequence(ids, special, index, MaskedDiffusion(ratio=1.0), INFO, prompt_length=15)
        assert draw.roles[1:15] == [Role.PROMPT] * 14 and draw.input_ids[:15] == ids[:15]
        assert draw.roles[15:-1] == [Role.MASKED] * 26
        assert draw.norm == len(ids) - 15


def test_describe_records_everything_in_meta():
    described = MaskedDiffusion(eps=0.01, ratios=(0.2, 0.8), seed=7, shift=True).describe()
    assert described["policy"] == "diffusion" and described["t"] == "grid" and described["ratios"] == [0.2, 0.8]
    assert described["weights"] == "1/t" and described["shift"] is True and described["seed"] == 7
    assert "shift" not in BertMasking().describe()  # unshifted BERT describes itself as before
    assert BertMasking(shift=True).describe()["shift"] is True


# ---------------------------------------------------------------------------------------------- span masking

def test_span_masking_selects_whole_word_spans_up_to_the_budget():
    n = 200
    ids, special = _sequence(n)
    words = [None] + [i // 2 for i in range(n)] + [None]  # two pieces a word
    units = [[1 + 2 * w, 2 + 2 * w] for w in range(n // 2)]
    maskable = np.array([False] + [True] * n + [False])
    policy = SpanMasking(rate=0.15, seed=1)
    words_per_span = []
    for index in range(30):
        draw = draw_sequence(ids, special, index, policy, INFO, words)
        roles = np.array(draw.roles)
        assert np.isin(roles, LOSS).sum() == math.ceil(0.15 * n)  # SpanBERT's budget, exactly
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([1, index])))  # the draw's generator
        spans = select_spans(units, maskable, policy, rng)
        assert sorted(t for span in spans for t in span) == np.flatnonzero(np.isin(roles, LOSS)).tolist()
        for k, span in enumerate(spans):
            assert span == list(range(span[0], span[0] + len(span)))  # contiguous
            assert span[0] % 2 == 1  # starts at a word's first piece
            assert len(span) % 2 == 0 or k == len(spans) - 1 or span[-1] + 1 in spans[k + 1]  # whole words but
            # where the budget ends it (or it runs into a later span's first word, which SpanBERT allows too)
            assert len(set(roles[span].tolist())) == 1  # one action a span
            words_per_span.append(math.ceil(len(span) / 2))
    assert max(words_per_span) <= 10 and 2.5 < np.mean(words_per_span) < 5  # geometric 0.2 clipped at 10: 3.8
    probabilities = policy.span_lengths()
    assert probabilities.sum() == pytest.approx(1) and probabilities[0] == pytest.approx(0.2 / (1 - 0.8 ** 10))


def test_span_masking_split_is_per_span():
    ids, special = _sequence(300)
    counts = np.zeros(3)
    for index in range(60):
        roles = np.array(draw_sequence(ids, special, index, SpanMasking(rate=0.3, seed=2), INFO).roles)
        counts += [(roles == r).sum() for r in LOSS]
    shares = counts / counts.sum()
    assert shares[0] == pytest.approx(0.8, abs=0.08) and shares[1] == pytest.approx(0.1, abs=0.06)


@pytest.mark.parametrize("kwargs, match", [
    (dict(rate=0.0), "span masking rate"), (dict(geometric_p=0.0), "geometric parameter"),
    (dict(max_words=0), "longest span"), (dict(split=(0.5, 0.5, 0.5)), "mask split"),
], ids=["rate 0", "p 0", "no words", "split over 1"])
def test_span_masking_refuses_bad_parameters(kwargs, match):
    with pytest.raises(MaskingError, match=match):
        SpanMasking(**kwargs)


# ---------------------------------------------------------------------------------------------- the shift

def test_shift_moves_roles_and_labels_to_the_predicting_position():
    R = Role
    input_roles = np.array([R.SPECIAL, R.MASKED, R.CONTEXT, R.MASKED, R.MASKED, R.RANDOM, R.CONTEXT, R.SPECIAL],
                           dtype=np.int8)
    labels = np.where(input_roles <= R.KEPT, np.arange(10, 18), -100)
    roles, shifted = shift_to_loss_side(input_roles, labels)
    assert roles.tolist() == [R.MASKED, R.CONTEXT, R.MASKED, R.MASKED, R.RANDOM, R.CONTEXT, R.CONTEXT, R.SPECIAL]
    assert shifted.tolist() == [11, -100, 13, 14, 15, -100, -100, -100]


def test_shifted_batch_keeps_input_roles_and_all_positions_predicts_the_next_token(tiny_tokenizer):
    texts = ["the cat sat on the mat", "a dog ran far away today"]
    policy = BertMasking(rate=0.4, seed=1, shift=True)
    batch = mask_batch(tiny_tokenizer, texts, policy)
    plain = mask_batch(tiny_tokenizer, texts, BertMasking(rate=0.4, seed=1))
    assert torch.equal(batch.input_ids, plain.input_ids) and torch.equal(batch.input_roles, plain.roles)
    assert torch.equal(batch.labels[:, :-1], plain.labels[:, 1:])
    labels = all_positions_labels(batch)
    keep = plain.roles[:, 1:] <= Role.CONTEXT
    assert torch.equal(labels[:, :-1][keep], plain.original_ids[:, 1:][keep]) and (labels[:, -1] == -100).all()


# ---------------------------------------------------------------------------------------------- losses vs references

VOCAB = 400  # above the tiny tokenizer's vocabulary


def _logits(batch, seed=0):
    torch.manual_seed(seed)
    return torch.randn(*batch.input_ids.shape, VOCAB, requires_grad=True)


def test_diffusion_loss_is_lladas_pretraining_loss(tiny_tokenizer):
    texts = ["the progress of public credit is witnessed"] * 3  # unpadded: b * l tokens
    batch = mask_batch(tiny_tokenizer, texts, MaskedDiffusion(seed=5), indices=[0, 1, 2])
    assert batch.attention_mask.all()
    logits = _logits(batch)
    masked = batch.input_ids == tiny_tokenizer.mask_token_id
    p_mask = batch.mask_ratio.float()[:, None].expand_as(masked)
    token_loss = F.cross_entropy(logits[masked], batch.original_ids[masked], reduction="none") / p_mask[masked]
    reference = token_loss.sum() / (batch.input_ids.shape[0] * batch.input_ids.shape[1])  # LLaDA GUIDELINES.md
    got = get_loss("mlm", "batch")(logits, batch)
    torch.testing.assert_close(got, reference, rtol=1e-6, atol=0)
    per_sequence = torch.stack([token_loss[masked.nonzero()[:, 0] == b].sum() / masked.shape[1] for b in range(3)])
    torch.testing.assert_close(get_loss("mlm", "sequence")(logits, batch), per_sequence.sum(), rtol=1e-6, atol=0)


def test_diffusion_loss_with_padding_is_mdlms_mean_over_real_tokens(tiny_tokenizer):
    batch = mask_batch(tiny_tokenizer, ["one two", "one two three four five six"], MaskedDiffusion(ratio=0.6, seed=1))
    assert not batch.attention_mask.all()
    logits = _logits(batch)
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), batch.labels.reshape(-1), ignore_index=-100,
                         reduction="none").reshape(batch.labels.shape)
    reference = (ce / 0.6 * batch.attention_mask).sum() / batch.attention_mask.sum()
    torch.testing.assert_close(get_loss("mlm", "batch")(logits, batch), reference, rtol=1e-6, atol=0)


def test_diffusion_sft_loss_is_lladas_sft_loss(tiny_tokenizer):
    from gradflow.inputs.masking import encode

    encodings = []
    for prompt, answer in [("what is it", "one two three"), ("say", "four five six seven eight")]:
        enc = encode(tiny_tokenizer, prompt + " " + answer)
        enc["prompt_length"] = len(encode(tiny_tokenizer, prompt)["input_ids"]) - 1  # [CLS] prompt
        encodings.append(enc)
    batch = mask_batch(tiny_tokenizer, policy=MaskedDiffusion(seed=2), encodings=encodings)
    assert batch.mean_over_sequences
    logits = _logits(batch)
    masked = batch.labels != -100
    prompt_index = torch.arange(batch.input_ids.shape[1])[None, :] < torch.tensor(
        [e["prompt_length"] for e in encodings])[:, None]
    assert not (masked & prompt_index).any()
    answer_lengths = (~prompt_index & batch.attention_mask.bool()).sum(dim=1, keepdim=True).expand_as(masked)
    p_mask = batch.mask_ratio.float()[:, None].expand_as(masked)
    token_loss = F.cross_entropy(logits[masked], batch.original_ids[masked], reduction="none") / p_mask[masked]
    reference = torch.sum(token_loss / answer_lengths[masked]) / batch.input_ids.shape[0]  # LLaDA's SFT
    torch.testing.assert_close(get_loss("mlm", "batch")(logits, batch), reference, rtol=1e-6, atol=0)


@pytest.mark.parametrize("policy", [BertMasking(rate=0.3, seed=1), SpanMasking(rate=0.3, seed=1),
                                    BertMasking(rate=0.3, seed=1, shift=True)], ids=["bert 30%", "span", "shifted"])
def test_unweighted_objectives_are_the_plain_mean(tiny_tokenizer, policy):
    batch = mask_batch(tiny_tokenizer, ["one two three four five six", "seven eight nine"], policy)
    assert batch.loss_weights is None
    logits = _logits(batch)
    selected = batch.labels != -100
    reference = F.cross_entropy(logits[selected], batch.labels[selected])
    torch.testing.assert_close(get_loss("mlm", "batch")(logits, batch), reference, rtol=1e-6, atol=0)


@pytest.mark.parametrize("reduction", ["batch", "sequence"])
@pytest.mark.parametrize("prompted", [False, True], ids=["pre-training", "sft"])
def test_head_loss_equals_the_loss_on_the_logits(tiny_tokenizer, reduction, prompted):
    encodings = [dict(encode_with(tiny_tokenizer, text), prompt_length=3 if prompted else 0)
                 for text in ["one two three four five six", "seven eight nine ten"]]
    batch = mask_batch(tiny_tokenizer, policy=MaskedDiffusion(seed=3, min_selected=1), encodings=encodings)
    torch.manual_seed(0)
    head = torch.nn.Linear(8, VOCAB)
    hidden = torch.randn(*batch.input_ids.shape, 8)
    want = get_loss("mlm", reduction)(head(hidden), batch)
    torch.testing.assert_close(head_loss(head, hidden, batch, "mlm", reduction), want, rtol=1e-6, atol=1e-7)


def encode_with(tokenizer, text):
    from gradflow.inputs.masking import encode

    return encode(tokenizer, text)
