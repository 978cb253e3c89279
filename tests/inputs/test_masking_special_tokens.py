"""Special-token text inside a document is never a loss position; ordinary text masks as before.

The tokenizer's ``special_tokens_mask`` marks only the [CLS]/[SEP] it adds. A literal "[SEP]",
"[PAD]", "[MASK]", "[UNK]" (or "<s>", "</s>", "<pad>", "<mask>" for RoBERTa) in the text is
tokenized to the same special id and must get the role ``special``, never a loss role. [UNK]
stays maskable however it arose (it stands for a real word; BERT's pretraining data masked it).
Batch padding stays ``pad``. The pinned values below were produced by the code before this change: ordinary text must
still give exactly them.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from transformers import AutoTokenizer

from gradflow.inputs.corpus import default_texts, document_windows, read_documents
from gradflow.inputs.masking import BertMasking, ExplicitMasking, TokenizerInfo, mask_batch, mask_sequence
from gradflow.models import embedded_model_dir
from gradflow.roles import Role

EMBEDDED = embedded_model_dir("gradflow-mini-en")
needs_embedded = pytest.mark.skipif(not (EMBEDDED / "tokenizer.json").exists(),
                                    reason="embedded tokenizer not in this checkout")
IN_TEXT = "fo [UNK] bar [SEP] baz [PAD] qux [MASK] end"
ORDINARY = [
    "The progress of public credit is witnessed by a considerable rise of American stock abroad.",
    "Congress will consider the state of the treasury and the revenues of the nation this year.",
]
OOV = "Neither the managers nor the commission tile@@ suggestion, so we had the horse."  # '@' -> [UNK]
INFO = TokenizerInfo(mask_token_id=4, vocab_size=100, special_ids=(0, 1, 2, 3, 4), pad_token_id=0,
                     special_tokens=("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"))


@pytest.fixture(scope="module")
def bert_tok():
    if not (EMBEDDED / "tokenizer.json").exists():
        pytest.skip("embedded tokenizer not in this checkout")
    return AutoTokenizer.from_pretrained(EMBEDDED)


@pytest.fixture(scope="module")
def roberta_tok():
    """A tiny byte-level BPE tokenizer with RoBERTa's special tokens, trained offline."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaTokenizerFast

    from conftest import SAMPLE_LINES

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(SAMPLE_LINES * 4, vocab_size=400, min_frequency=1,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    return RobertaTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>",
                                sep_token="</s>", cls_token="<s>", unk_token="<unk>", pad_token="<pad>",
                                mask_token="<mask>")


def _in_text_special(batch, tok) -> torch.Tensor:
    """Real (attention 1) positions holding a special id other than the unknown token, other than the
    added first and last token."""
    ids = [i for i in tok.all_special_ids if i != tok.unk_token_id]
    special = torch.isin(batch.original_ids, torch.tensor(ids)) & (batch.attention_mask == 1)
    special[:, 0] = False
    ends = batch.attention_mask.sum(1) - 1
    special[torch.arange(len(ends)), ends] = False
    return special


def _assert_never_loss(batch, where: torch.Tensor) -> None:
    assert torch.all(batch.roles[where] == Role.SPECIAL)
    assert torch.all(batch.labels[where] == -100)
    assert torch.equal(batch.input_ids[where], batch.original_ids[where])


# ------------------------------------------------------------------------------------------------
# In-text special tokens
# ------------------------------------------------------------------------------------------------

@needs_embedded
def test_embedded_tokenizer_keeps_literal_special_tokens_whole(bert_tok):
    """The premise: "[SEP]" etc. in text become the special ids themselves, not word pieces."""
    tokens = bert_tok.convert_ids_to_tokens(bert_tok(IN_TEXT)["input_ids"])
    for name in ("[UNK]", "[SEP]", "[PAD]", "[MASK]"):
        assert tokens.count(name) == (2 if name == "[SEP]" else 1), tokens


@needs_embedded
@pytest.mark.parametrize("whole_word", [False, True])
def test_200_sentences_in_text_specials_get_no_loss_role(bert_tok, whole_word):
    batch = mask_batch(bert_tok, [IN_TEXT] * 200, BertMasking(seed=0, whole_word=whole_word))
    where = _in_text_special(batch, bert_tok)
    assert int(where.sum()) == 600  # [SEP], [PAD], [MASK] in each of 200 rows (before: ~16% had a loss role)
    _assert_never_loss(batch, where)
    # the 7 word pieces and the [UNK] around them still carry the loss: every row (min_selected=1),
    # at about the policy's rate plus the fallback
    loss = batch.roles <= Role.KEPT
    assert torch.all(loss.any(1))
    assert 0.12 * 1600 < int(loss.sum()) < 0.30 * 1600


@needs_embedded
def test_literal_pad_is_special_while_batch_padding_is_pad(bert_tok):
    texts = ["a [PAD] b", "the nation [PAD] and the progress of public credit [PAD] is witnessed by a rise"]
    batch = mask_batch(bert_tok, texts * 50, BertMasking(rate=0.9, seed=1))
    pad = batch.attention_mask == 0
    assert pad.any()
    assert torch.all(batch.roles[pad] == Role.PAD) and torch.all(batch.labels[pad] == -100)
    literal = (batch.original_ids == bert_tok.pad_token_id) & ~pad
    assert int(literal.sum()) == 150
    _assert_never_loss(batch, literal)


@needs_embedded
def test_unk_stays_maskable_from_text_and_out_of_vocabulary_characters(bert_tok):
    batch = mask_batch(bert_tok, [OOV, "literal [UNK] here"] * 100, BertMasking(rate=0.9, seed=2))
    unk = batch.original_ids == bert_tok.unk_token_id
    assert int(unk.sum()) == 300  # two from "@@", one literal, per pair
    assert not torch.any(batch.roles[unk] == Role.SPECIAL)
    assert int((batch.roles[unk] <= Role.KEPT).sum()) > 0.8 * 300  # selected at about the rate 0.9


@needs_embedded
def test_random_replacements_are_never_special_ids(bert_tok):
    batch = mask_batch(bert_tok, [IN_TEXT, OOV] * 100, BertMasking(rate=1.0, split=(0.0, 1.0, 0.0), seed=4))
    random = batch.roles == Role.RANDOM
    assert int(random.sum()) > 1000
    assert not torch.isin(batch.input_ids[random], torch.tensor(bert_tok.all_special_ids)).any()
    _assert_never_loss(batch, _in_text_special(batch, bert_tok))


@pytest.mark.parametrize("whole_word", [False, True])
def test_roberta_style_specials_in_text(roberta_tok, whole_word):
    text = "a <s> b </s> c <pad> d <mask> e <unk> f"
    batch = mask_batch(roberta_tok, [text] * 200, BertMasking(rate=0.5, seed=0, whole_word=whole_word))
    where = _in_text_special(batch, roberta_tok)
    assert int(where.sum()) == 800  # <s>, </s>, <pad>, <mask>; <unk> stays maskable
    _assert_never_loss(batch, where)
    assert int((batch.roles <= Role.KEPT).sum()) > 1000


def test_a_special_id_in_the_text_changes_no_other_position():
    """Veto after the draws: replacing one token by a special id leaves every other output alone."""
    base = [2] + [10 + i for i in range(30)] + [3]
    special = [True] + [False] * 30 + [True]
    words = [None] + [i // 2 for i in range(30)] + [None]
    for whole_word in (False, True):
        policy = BertMasking(rate=0.4, seed=5, whole_word=whole_word, min_selected=0)
        for index in range(100):
            for t, sid in ((7, 3), (12, 1), (20, 4), (21, 0)):
                ids = list(base)
                ids[t] = sid
                old = mask_sequence(base, special, index, policy, INFO, words)
                new = mask_sequence(ids, special, index, policy, INFO, words)
                assert new[2][t] == Role.SPECIAL and new[1][t] == -100 and new[0][t] == sid
                for a, b in zip(old, new):
                    assert a[:t] + a[t + 1:] == b[:t] + b[t + 1:]


def test_whole_word_with_special_pieces():
    """A word whose pieces mix a special id and real pieces: the real pieces move together."""
    ids = [2, 10, 1, 11, 12, 3, 13, 3]
    special = [True, False, False, False, False, False, False, True]
    words = [None, 0, 0, 0, 1, 2, 3, None]
    seen = set()
    for index in range(200):
        _, labels, roles = mask_sequence(ids, special, index, BertMasking(rate=0.5, whole_word=True, seed=0),
                                         INFO, words)
        assert roles[2] == roles[5] == Role.SPECIAL and labels[2] == labels[5] == -100
        assert roles[1] == roles[3]
        seen.add(roles[1])
    assert {Role.CONTEXT, Role.MASKED} <= seen


@needs_embedded
def test_min_selected_never_forces_a_special_id(bert_tok):
    """Text made of special tokens only: nothing is selectable, so nothing is forced (before: one was)."""
    batch = mask_batch(bert_tok, ["[SEP] [MASK] [PAD]"] * 50, BertMasking(seed=0, min_selected=1))
    assert not (batch.roles <= Role.KEPT).any()
    assert torch.all(batch.roles[batch.attention_mask == 1] == Role.SPECIAL)
    # the fallback still picks a real token when the draw picked only special ids
    for index in range(200):
        _, _, roles = mask_sequence([2, 10, 3, 3, 3, 3, 3, 3, 3, 3, 3], [True] + [False] * 9 + [True], index,
                                    BertMasking(rate=0.3, seed=0, min_selected=1), INFO)
        assert roles[1] in (Role.MASKED, Role.RANDOM, Role.KEPT)


# ------------------------------------------------------------------------------------------------
# ExplicitMasking
# ------------------------------------------------------------------------------------------------

@needs_embedded
def test_explicit_position_on_in_text_special_raises_naming_it(bert_tok):
    tokens = bert_tok.convert_ids_to_tokens(bert_tok(IN_TEXT)["input_ids"])
    sep = tokens.index("[SEP]")  # the literal one, inside the text
    assert 0 < sep < len(tokens) - 1
    with pytest.raises(ValueError, match=rf"explicit position {sep} is the special token '\[SEP\]' \(id 3\)"):
        mask_batch(bert_tok, [IN_TEXT], ExplicitMasking({0: (1, sep)}))
    unk = tokens.index("[UNK]")  # maskable: an explicit position on it is fine
    kept = mask_batch(bert_tok, [IN_TEXT], ExplicitMasking({0: (unk,)}, action="keep"))
    assert int(kept.roles[0, unk]) == Role.KEPT
    ok = mask_batch(bert_tok, [IN_TEXT], ExplicitMasking({0: (1, sep + 1)}))
    assert [int(t) for t in torch.nonzero(ok.roles[0] == Role.MASKED)] == [1, sep + 1]


def test_explicit_position_on_roberta_mask_raises(roberta_tok):
    text = "a <mask> b"
    position = roberta_tok.convert_ids_to_tokens(roberta_tok(text)["input_ids"]).index("<mask>")
    with pytest.raises(ValueError, match=f"explicit position {position} is the special token '<mask>'"):
        mask_batch(roberta_tok, [text], ExplicitMasking({0: (position,)}))


def test_tokenizer_info_names_special_ids(roberta_tok):
    info = TokenizerInfo.from_tokenizer(roberta_tok)
    assert dict(zip(info.special_ids, info.special_tokens)) == {
        roberta_tok.convert_tokens_to_ids(t): t for t in ("<s>", "<pad>", "</s>", "<unk>", "<mask>")}
    assert info.token_name(roberta_tok.mask_token_id) == f"'<mask>' (id {roberta_tok.mask_token_id})"
    assert info.token_name(99) == "id 99"


# ------------------------------------------------------------------------------------------------
# Ordinary text: outputs pinned from the code before this change
# ------------------------------------------------------------------------------------------------

PINNED = {  # policy -> per sentence (input_ids, roles as digits), recorded before the change
    "token": [
        ([2, 108, 4, 4, 4, 2020, 157, 4259, 117, 184, 36, 2539, 4, 114, 4, 2469, 4, 17, 3], "4300033333330303034"),
        ([2, 381, 230, 604, 108, 4, 4, 108, 3349, 123, 108, 4, 4, 4, 402, 196, 4, 17, 3], "4333300313300033034"),
    ],
    "whole_word": [
        ([2, 108, 4, 4, 4, 2020, 157, 4259, 117, 184, 36, 2539, 3117, 114, 510, 4, 2152, 4, 3],
         "4300033333333230304"),
        ([2, 381, 230, 604, 108, 4, 4, 108, 3349, 123, 108, 4, 4, 4, 402, 196, 4, 17, 3], "4333300313300033034"),
    ],
    "explicit": [
        ([2, 108, 6648, 114, 474, 706, 157, 4259, 117, 184, 36, 2539, 3117, 114, 510, 2469, 2152, 17, 3],
         "4313313333333333334"),
        ([2, 8013, 230, 2078, 4747, 501, 114, 108, 1127, 123, 108, 2753, 114, 108, 402, 196, 294, 17, 3],
         "4131133333333333334"),
    ],
}
POLICIES = {"token": BertMasking(rate=0.3, seed=0), "whole_word": BertMasking(rate=0.3, seed=0, whole_word=True),
            "explicit": ExplicitMasking({0: (2, 5), 1: (1, 3, 4), 2: (1, 9)}, action="random", seed=3)}


def _rows(batch) -> list[tuple[list[int], str, list[int]]]:
    out = []
    for i in range(batch.input_ids.shape[0]):
        n = int(batch.attention_mask[i].sum())
        out.append((batch.input_ids[i, :n].tolist(), "".join(str(int(r)) for r in batch.roles[i, :n]),
                    batch.labels[i, :n].tolist()))
    return out


@needs_embedded
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_ordinary_text_masks_exactly_as_before(bert_tok, name):
    rows = _rows(mask_batch(bert_tok, [*ORDINARY, OOV], POLICIES[name]))
    for (ids, roles, labels), (want_ids, want_roles), text in zip(rows, PINNED[name], ORDINARY):
        assert (ids, roles) == (want_ids, want_roles)
        original = bert_tok(text)["input_ids"]
        assert labels == [o if r in "012" else -100 for o, r in zip(original, roles)]


@needs_embedded
def test_out_of_vocabulary_unk_masks_exactly_as_before(bert_tok):
    """'tile@@' -> til ##e [UNK] [UNK] (positions 10, 11): [UNK] stays maskable, so every output is
    the one recorded before the special-token change (the token policy masks position 10)."""
    before = {
        "token": ([2, 4, 108, 6869, 4, 4, 108, 4, 8103, 85, 4, 1, 4485, 15, 249, 4, 313, 108, 4327, 17, 3],
                  "403300303303333033334"),
        "whole_word": ([2, 4, 108, 6869, 77, 124, 4, 934, 4, 4, 1, 1, 4, 15, 249, 174, 313, 4, 4327, 17, 3],
                       "403331030033033330334"),
        "explicit": ([2, 6917, 108, 6869, 77, 873, 108, 934, 8103, 214, 1, 1, 4485, 15, 249, 174, 313, 108, 4327,
                      17, 3], "413333333133333333334"),
    }
    for name, want in before.items():
        got_ids, got_roles, _ = _rows(mask_batch(bert_tok, [*ORDINARY, OOV], POLICIES[name]))[2]
        assert (got_ids, got_roles) == want, name


def _digest(tok, policy: BertMasking) -> str:
    windows = [w for d in read_documents(default_texts()) for w in document_windows(tok, d, 128)]
    h = hashlib.sha256()
    for start in range(0, len(windows), 64):
        group = windows[start:start + 64]
        batch = mask_batch(tok, policy=policy, encodings=group, indices=range(start, start + len(group)))
        for ids, roles, labels in _rows(batch):
            h.update(repr((ids, roles, labels)).encode())
    return h.hexdigest()[:16]


@needs_embedded
@pytest.mark.slow
@pytest.mark.parametrize("whole_word", [False, True])
def test_demo_corpus_masks_as_before(bert_tok, whole_word):
    """All 558 windows of the shipped SOTU sample (seed 0, max_length 128): ids, roles and labels
    are exactly those of the code before the change (digests recorded then)."""
    pinned = {False: "75ec2168b98403f0", True: "f2d743e53cacf1d9"}
    assert _digest(bert_tok, BertMasking(seed=0, whole_word=whole_word)) == pinned[whole_word]
