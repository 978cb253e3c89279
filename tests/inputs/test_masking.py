"""Masking policies: role counts, never selecting specials or padding, seeded reproducibility."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from conftest import SAMPLE_LINES
from gradflow.inputs.masking import BertMasking, ExplicitMasking, TokenizerInfo, mask_batch, mask_sequence, mlm_roles
from gradflow.roles import Role

INFO = TokenizerInfo(mask_token_id=4, vocab_size=100, special_ids=(0, 1, 2, 3, 4), pad_token_id=0)


def _sequence(n: int = 200):
    ids = [2] + [10 + (i % 80) for i in range(n - 2)] + [3]
    special = [True] + [False] * (n - 2) + [True]
    return ids, special


def test_counts_match_policy_within_binomial_tolerance():
    ids, special = _sequence(130)
    policy = BertMasking(rate=0.15, split=(0.8, 0.1, 0.1), seed=3)
    totals = torch.zeros(6)
    sequences = 400
    for index in range(sequences):
        _, _, roles = mask_sequence(ids, special, index, policy, INFO)
        totals += torch.bincount(torch.tensor(roles), minlength=6).float()
    n = sequences * 128  # maskable positions
    selected = totals[:3].sum()
    p = 0.15
    assert abs(selected - n * p) <= 4 * math.sqrt(n * p * (1 - p))
    for code, frac in ((Role.MASKED, 0.8), (Role.RANDOM, 0.1), (Role.KEPT, 0.1)):
        expect = selected * frac
        assert abs(totals[code] - expect) <= 4 * math.sqrt(selected * frac * (1 - frac)), code
    assert totals[Role.SPECIAL] == 2 * sequences


def test_specials_never_selected_and_inputs_consistent():
    ids, special = _sequence(60)
    for index in range(50):
        inputs, labels, roles = mask_sequence(ids, special, index, BertMasking(rate=0.9, seed=1), INFO)
        for t, (s, r) in enumerate(zip(special, roles)):
            if s:
                assert r == Role.SPECIAL and labels[t] == -100 and inputs[t] == ids[t]
            if r == Role.MASKED:
                assert inputs[t] == INFO.mask_token_id and labels[t] == ids[t]
            if r == Role.KEPT:
                assert inputs[t] == ids[t] and labels[t] == ids[t]
            if r == Role.RANDOM:
                assert inputs[t] not in INFO.special_ids and labels[t] == ids[t]
            if r == Role.CONTEXT:
                assert labels[t] == -100 and inputs[t] == ids[t]


def test_same_seed_same_roles_and_index_dependence():
    ids, special = _sequence(80)
    a = mask_sequence(ids, special, 7, BertMasking(seed=11), INFO)
    b = mask_sequence(ids, special, 7, BertMasking(seed=11), INFO)
    c = mask_sequence(ids, special, 8, BertMasking(seed=11), INFO)
    d = mask_sequence(ids, special, 7, BertMasking(seed=12), INFO)
    assert a == b
    assert a[2] != c[2] and a[2] != d[2]


def test_padding_never_selected_in_batches(tiny_mlm_dir):
    from transformers import AutoTokenizer

    from gradflow.inputs.masking import mask_batch

    tok = AutoTokenizer.from_pretrained(tiny_mlm_dir)
    texts = ["the nation", "the progress of public credit is witnessed by a considerable rise of american stock"]
    batch = mask_batch(tok, texts, BertMasking(rate=0.5, seed=0))
    pad = batch.attention_mask == 0
    assert pad.any()
    assert torch.all(batch.roles[pad] == Role.PAD) and torch.all(batch.labels[pad] == -100)
    # the roles of a sequence do not depend on what it is batched with
    alone = mask_batch(tok, texts[1:], BertMasking(rate=0.5, seed=0), indices=[1])
    n = int(alone.attention_mask.sum())
    assert torch.equal(alone.roles[0, :n], batch.roles[1, :n])


def test_whole_word_selects_all_pieces_of_a_word():
    ids = [2, 10, 11, 12, 13, 14, 15, 3]
    special = [True, False, False, False, False, False, False, True]
    words = [None, 0, 0, 0, 1, 2, 2, None]
    for index in range(40):
        _, _, roles = mask_sequence(ids, special, index, BertMasking(rate=0.5, whole_word=True, seed=0), INFO, words)
        assert len({roles[1], roles[2], roles[3]}) == 1
        assert roles[5] == roles[6]


def test_explicit_positions_and_errors():
    ids, special = _sequence(10)
    _, labels, roles = mask_sequence(ids, special, 0, ExplicitMasking({0: (2, 5)}), INFO)
    assert [t for t, r in enumerate(roles) if r == Role.MASKED] == [2, 5]
    assert labels[2] == ids[2]
    _, _, roles = mask_sequence(ids, special, 0, ExplicitMasking({0: (3,)}, action="keep"), INFO)
    assert roles[3] == Role.KEPT
    with pytest.raises(ValueError, match="special token"):
        mask_sequence(ids, special, 0, ExplicitMasking({0: (0,)}), INFO)
    with pytest.raises(ValueError, match="outside"):
        mask_sequence(ids, special, 0, ExplicitMasking({0: (99,)}), INFO)


def test_policy_validation():
    with pytest.raises(ValueError, match="sum"):
        BertMasking(split=(0.5, 0.1, 0.1))
    with pytest.raises(ValueError, match="rate"):
        BertMasking(rate=0.0)


def test_mlm_roles_by_hand():
    ids = torch.tensor([[2, 4, 9, 11, 3, 0]])
    labels = torch.tensor([[-100, 8, 10, 11, -100, -100]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    roles = mlm_roles(ids, labels, mask, mask_token_id=4, special_ids=(0, 2, 3))
    assert roles.tolist() == [[Role.SPECIAL, Role.MASKED, Role.RANDOM, Role.KEPT, Role.SPECIAL, Role.PAD]]
    roles = mlm_roles(ids, labels, mask)  # no tokenizer: random counts as masked, specials as context
    assert roles.tolist() == [[Role.CONTEXT, Role.MASKED, Role.MASKED, Role.KEPT, Role.CONTEXT, Role.PAD]]


def test_mlm_roles_recover_the_roles_mask_batch_drew(tiny_mlm_dir):
    """Roles read back from a masked batch's labels are the drawn ones, except a random draw of the original
    token (kept: the labels cannot tell) and [UNK] (left out of the special ids here: masking keeps it a word)."""
    tok = AutoTokenizer.from_pretrained(tiny_mlm_dir)
    batch = mask_batch(tok, SAMPLE_LINES * 3, BertMasking(rate=0.4, seed=1), max_length=64)
    specials = tuple(i for i in tok.all_special_ids if i != tok.unk_token_id)
    back = mlm_roles(batch.input_ids, batch.labels, batch.attention_mask, tok.mask_token_id, specials)
    lucky = (batch.roles == Role.RANDOM) & (batch.input_ids == batch.original_ids)
    assert torch.equal(back[~lucky], batch.roles[~lucky])
    assert (back[lucky] == Role.KEPT).all()
    assert set(back.unique().tolist()) >= {Role.MASKED, Role.RANDOM, Role.KEPT, Role.CONTEXT, Role.SPECIAL}


def test_random_replacements_draw_from_the_vocabulary_less_the_special_ids_built_once():
    from gradflow.inputs.masking import _random_tokens, _replacement_candidates

    info = TokenizerInfo(mask_token_id=4, vocab_size=50, special_ids=(0, 2, 3, 4, 1), pad_token_id=0, unk_token_id=1)
    candidates = _replacement_candidates(50, (0, 2, 3, 4, 1))
    assert candidates.tolist() == list(range(5, 50)) and not candidates.flags.writeable
    assert _replacement_candidates(50, (0, 2, 3, 4, 1)) is candidates  # built once per tokenizer
    # the same draws as the vocabulary filtered at every call (what earlier runs' masks were made with)
    got = _random_tokens(np.random.default_rng(7), 1000, info)
    fresh = np.setdiff1d(np.arange(50), np.array([0, 2, 3, 4, 1]))
    assert got.tolist() == fresh[np.random.default_rng(7).integers(0, fresh.size, size=1000)].tolist()
    assert set(got.tolist()) == set(range(5, 50))
