"""Masking policies that produce input ids, MLM labels and a role for every position.

Every draw of a sequence comes from its own random generator, seeded by ``(seed, sequence
index)`` through NumPy's ``SeedSequence`` (PCG64, identical on every platform). The roles of a
sequence therefore depend only on the seed, the policy and the sequence's index in the corpus:
never on batch composition, padding, device or the number of processes.

A token whose id is in the tokenizer's ``all_special_ids`` ([CLS], [SEP], [PAD], [MASK], <s>,
</s>, <mask>, ...) is never selected and has the role ``special``, also where the text itself
contains it (a literal "[SEP]"); batch padding (attention mask 0) stays ``pad``. The unknown
token ([UNK], <unk>) is the exception: it stands for a real word the vocabulary lacks, it is a
clean channel like any other word, and BERT's own pretraining data masked it (only [CLS] and
[SEP] were excluded), so it stays maskable wherever it comes from (an out-of-vocabulary
character or a literal "[UNK]"). The draws run over the positions ``special_tokens_mask`` leaves
free, as they always did, and a special id then vetoes its position: it changes no other
position (unless the ``min_selected`` fallback fires), and text without special ids masks
exactly as before.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gradflow.adapters.extra_inputs import token_inputs
from gradflow.errors import MaskingError
from gradflow.roles import Role


@dataclass(frozen=True)
class TokenizerInfo:
    """What masking needs from a tokenizer: the mask id, vocabulary size and special ids."""

    mask_token_id: int
    vocab_size: int
    special_ids: tuple[int, ...]
    pad_token_id: int
    special_tokens: tuple[str, ...] = ()  # the token text of each of special_ids, for messages
    unk_token_id: int = -1  # maskable although special (see the module docstring); -1: none

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "TokenizerInfo":
        """Read the fields from a Hugging Face tokenizer; clear error if it has no mask token."""
        if tokenizer.mask_token_id is None:
            raise MaskingError(
                f"tokenizer {type(tokenizer).__name__} has no mask token: gradflow needs a masked-LM "
                "tokenizer (one with [MASK] or <mask>). Load the tokenizer that belongs to a "
                "ForMaskedLM checkpoint."
            )
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else -1
        special = tuple(sorted(int(i) for i in tokenizer.all_special_ids))
        return cls(
            mask_token_id=int(tokenizer.mask_token_id),
            vocab_size=len(tokenizer),
            special_ids=special,
            pad_token_id=int(pad),
            special_tokens=tuple(str(t) for t in tokenizer.convert_ids_to_tokens(list(special))),
            unk_token_id=int(tokenizer.unk_token_id) if tokenizer.unk_token_id is not None else -1,
        )

    def token_name(self, token_id: int) -> str:
        """``'[SEP]' (id 3)`` for a special id; ``id N`` when its text is unknown."""
        name = dict(zip(self.special_ids, self.special_tokens)).get(token_id)
        return f"id {token_id}" if name is None else f"{name!r} (id {token_id})"


@dataclass(frozen=True)
class BertMasking:
    """BERT-style policy: select ``rate`` of the maskable tokens, then split them.

    ``split`` = (fraction replaced by the mask token, by a random token, kept unchanged); it must
    sum to 1. ``whole_word`` selects words (all their pieces together, one action per word).
    ``min_selected``: if a sequence with maskable tokens draws fewer selections than this, that
    many are drawn uniformly instead, so every sequence carries loss (default 1).
    Random replacements are drawn uniformly from the non-special vocabulary; like BERT, a random
    draw may equal the original token and the position is still ``random``.
    """

    rate: float = 0.15
    split: tuple[float, float, float] = (0.8, 0.1, 0.1)
    whole_word: bool = False
    seed: int = 0
    min_selected: int = 1

    def __post_init__(self) -> None:
        if not 0.0 < self.rate <= 1.0:
            raise MaskingError(f"mask rate must be in (0, 1], got {self.rate}")
        if len(self.split) != 3 or any(s < 0 for s in self.split) or abs(sum(self.split) - 1) > 1e-6:
            raise MaskingError(
                f"mask split must be three non-negative fractions (mask, random, kept) summing to 1, "
                f"got {self.split}"
            )

    def describe(self) -> dict:
        """JSON-ready description, for meta.json."""
        return {"policy": "bert", "rate": self.rate, "split": list(self.split),
                "whole_word": self.whole_word, "seed": self.seed, "min_selected": self.min_selected}


@dataclass(frozen=True)
class ExplicitMasking:
    """The caller names the selected positions of each sequence (by sequence index).

    ``positions[i]`` lists token positions (in the tokenized sequence, special tokens included)
    of sequence ``i``; ``action`` says what happens to their input: ``"mask"``, ``"random"`` or
    ``"keep"``. ``seed`` only matters for ``"random"``. A position holding a special id (special-token text in
    the document included; [UNK] excepted) raises ``MaskingError`` naming position and token.
    """

    positions: dict[int, tuple[int, ...]] = field(default_factory=dict)
    action: str = "mask"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.action not in ("mask", "random", "keep"):
            raise MaskingError(f"explicit masking action must be mask, random or keep, got {self.action!r}")

    def describe(self) -> dict:
        return {"policy": "explicit", "action": self.action, "seed": self.seed,
                "positions": {str(k): list(v) for k, v in self.positions.items()}}


MaskingPolicy = BertMasking | ExplicitMasking


@dataclass
class MaskedBatch:
    """One batch ready for the recorder. All tensors are (B, T).

    ``input_ids``: corrupted inputs; ``original_ids``: the uncorrupted tokens; ``labels``: the
    original token at selected positions, -100 elsewhere; ``roles``: int8 role codes
    (:class:`gradflow.roles.Role`); ``attention_mask``: 1 for real tokens; ``sequence_index``: (B,)
    index of each row in the corpus.
    """

    input_ids: torch.Tensor
    original_ids: torch.Tensor
    labels: torch.Tensor
    roles: torch.Tensor
    attention_mask: torch.Tensor
    sequence_index: torch.Tensor
    extra_inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device: torch.device | str) -> "MaskedBatch":
        """Copy of the batch on ``device``."""
        return MaskedBatch(
            *(t.to(device) for t in (self.input_ids, self.original_ids, self.labels, self.roles,
                                      self.attention_mask, self.sequence_index)),
            extra_inputs={k: v.to(device) for k, v in self.extra_inputs.items()},
        )

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments for the model's forward."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, **self.extra_inputs}


def _generator(seed: int, index: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(index)])))


def mask_sequence(
    ids: Sequence[int],
    special: Sequence[bool],
    index: int,
    policy: MaskingPolicy,
    info: TokenizerInfo,
    word_ids: Sequence[int | None] | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """Mask one unpadded sequence.

    Returns ``(input_ids, labels, roles)`` as lists of length ``len(ids)``; ``special[t]`` marks
    positions left out of the draws, and a position holding a special id is vetoed after them.
    ``word_ids`` (from a fast tokenizer) groups pieces into words for whole-word selection.
    """
    rng = _generator(policy.seed, index)
    drawn = np.array([not s for s in special], dtype=bool)  # the draw set, as before the veto
    vetoed = special_id_positions(ids, info)
    maskable = drawn & ~vetoed
    roles = np.where(maskable, Role.CONTEXT, Role.SPECIAL).astype(np.int8)
    if isinstance(policy, ExplicitMasking):
        roles[_explicit_positions(ids, maskable, index, policy, info)] = {
            "mask": Role.MASKED, "random": Role.RANDOM, "keep": Role.KEPT}[policy.action]
    else:
        units = _selection_units(drawn, word_ids if policy.whole_word else None)
        if units:
            ok = maskable.tolist() if (vetoed & drawn).any() else None  # eligible: a piece not special
            eligible = np.array([ok is None or any(ok[t] for t in u) for u in units], dtype=bool)
            draw = rng.random(len(units))
            picked = draw < policy.rate  # a picked ineligible unit is vetoed below, after its draws
            need = min(policy.min_selected, int(eligible.sum()))
            if (picked & eligible).sum() < need:
                picked[:] = False
                picked[rng.choice(np.flatnonzero(eligible), size=need, replace=False)] = True
            action = rng.random(len(units))
            p_mask, p_random, _ = policy.split
            for unit, sel, a in zip(units, picked, action):
                if sel:
                    code = Role.MASKED if a < p_mask else Role.RANDOM if a < p_mask + p_random else Role.KEPT
                    roles[unit] = code
    inputs = np.asarray(ids, dtype=np.int64).copy()
    inputs[roles == Role.MASKED] = info.mask_token_id
    random_pos = np.flatnonzero(roles == Role.RANDOM)
    if random_pos.size:
        inputs[random_pos] = _random_tokens(rng, random_pos.size, info)
    original = np.asarray(ids, dtype=np.int64)
    roles[vetoed] = Role.SPECIAL  # after every draw: the draws of all other positions stay put
    inputs[vetoed] = original[vetoed]
    labels = np.where(roles <= Role.KEPT, original, -100)
    return inputs.tolist(), labels.tolist(), roles.tolist()


def special_id_positions(ids: Sequence[int], info: TokenizerInfo) -> np.ndarray:
    """Boolean mask of the positions whose token is a special id other than [UNK], wherever they are."""
    special = frozenset(info.special_ids) - {info.unk_token_id}
    return np.array([int(i) in special for i in ids], dtype=bool)


def _explicit_positions(ids: Sequence[int], maskable: np.ndarray, index: int, policy: ExplicitMasking,
                        info: TokenizerInfo) -> np.ndarray:
    """Boolean mask of the explicit positions of sequence ``index``; raises on out-of-range or special."""
    chosen = np.zeros(len(ids), dtype=bool)
    for t in policy.positions.get(index, ()):
        if not 0 <= t < len(ids):
            raise MaskingError(f"sequence {index}: explicit position {t} is outside 0..{len(ids) - 1}")
        if not maskable[t]:
            raise MaskingError(f"sequence {index}: explicit position {t} is the special token "
                             f"{info.token_name(int(ids[t]))}, which never carries the loss")
        chosen[t] = True
    return chosen


def _selection_units(maskable: np.ndarray, word_ids: Sequence[int | None] | None) -> list[list[int]]:
    """Positions grouped into the units that are selected together (tokens, or words)."""
    if word_ids is None:
        return [[t] for t in np.flatnonzero(maskable).tolist()]
    units: dict[int, list[int]] = {}
    order: list[int] = []
    for t, w in enumerate(word_ids):
        if not maskable[t]:
            continue
        key = w if w is not None else -(t + 1)
        if key not in units:
            units[key] = []
            order.append(key)
        units[key].append(t)
    return [units[k] for k in order]


def _random_tokens(rng: np.random.Generator, count: int, info: TokenizerInfo) -> np.ndarray:
    candidates = _replacement_candidates(int(info.vocab_size), tuple(int(i) for i in info.special_ids))
    return candidates[rng.integers(0, candidates.size, size=count)]


@functools.lru_cache(maxsize=16)
def _replacement_candidates(vocab_size: int, special_ids: tuple[int, ...]) -> np.ndarray:
    """(V - S,) int64 read-only: the ids a random replacement draws from (the vocabulary less the special ids),
    built once per tokenizer (``setdiff1d`` over the vocabulary took 1.4 ms a sequence at 8,192 words)."""
    candidates = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), np.asarray(special_ids, dtype=np.int64))
    candidates.flags.writeable = False
    return candidates


def mask_batch(
    tokenizer,
    texts: Sequence[str] | None = None,
    policy: MaskingPolicy | None = None,
    *,
    indices: Sequence[int] | None = None,
    encodings: Sequence[dict] | None = None,
    max_length: int = 128,
) -> MaskedBatch:
    """Tokenize (or take pre-tokenized ``encodings``), mask and pad one batch.

    ``indices`` are the corpus indices of the sequences (default 0..B-1): they, with the policy's
    seed, fix every draw. Each encoding is a dict with ``input_ids``, ``special_tokens_mask`` and
    optionally ``word_ids``. Sequences longer than ``max_length`` raise (window them first:
    :func:`gradflow.inputs.corpus.document_windows`).

    Every special id, added or in the text ("[SEP]", "[PAD]", "[MASK]"), is ``special`` and never
    selected; [UNK] stays maskable like the word it stands for (as in BERT's pretraining data);
    batch padding is ``pad``; random replacements are never special ids (nor [UNK]).
    ``extra_inputs`` holds what the tokenizer derives per token beyond the ids (RoCBert's shape and
    pronunciation ids: :func:`gradflow.adapters.extra_inputs.token_inputs`), from the corrupted ids.
    """
    policy = policy if policy is not None else BertMasking()
    info = TokenizerInfo.from_tokenizer(tokenizer)
    if encodings is None:
        if texts is None:
            raise MaskingError("mask_batch needs texts or encodings")
        encodings = [encode(tokenizer, text) for text in texts]
    indices = list(range(len(encodings))) if indices is None else list(indices)
    if len(indices) != len(encodings):
        raise MaskingError(f"{len(indices)} indices for {len(encodings)} sequences")
    rows = []
    for enc, index in zip(encodings, indices):
        if len(enc["input_ids"]) > max_length:
            raise MaskingError(
                f"sequence {index} has {len(enc['input_ids'])} tokens, more than max_length={max_length}; "
                "split long documents into windows (gradflow.inputs.corpus.windows) or raise max_length"
            )
        rows.append(mask_sequence(enc["input_ids"], enc["special_tokens_mask"], index, policy, info,
                                  enc.get("word_ids")))
    width = max(len(r[0]) for r in rows)
    pad_id = info.pad_token_id if info.pad_token_id >= 0 else 0
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    original = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, -100, dtype=torch.long)
    roles = torch.full(shape, int(Role.PAD), dtype=torch.int8)
    attention = torch.zeros(shape, dtype=torch.long)
    for b, ((inp, lab, rol), enc) in enumerate(zip(rows, encodings)):
        n = len(inp)
        input_ids[b, :n] = torch.tensor(inp)
        original[b, :n] = torch.tensor(enc["input_ids"])
        labels[b, :n] = torch.tensor(lab)
        roles[b, :n] = torch.tensor(rol, dtype=torch.int8)
        attention[b, :n] = 1
    return MaskedBatch(input_ids, original, labels, roles, attention, torch.tensor(indices, dtype=torch.long),
                       extra_inputs=token_inputs(tokenizer, input_ids, attention))


def mlm_roles(input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
              mask_token_id: int | None = None, special_ids: tuple[int, ...] = ()) -> torch.Tensor:
    """(B, T) int8 role codes of an MLM batch someone else masked (a ``DataCollatorForLanguageModeling`` batch).

    Positions with ``labels != -100`` are selected: ``masked`` if the input is ``mask_token_id``,
    ``kept`` if it equals the label, else ``random`` (a random replacement that happens to draw the
    original token counts as kept). Unselected positions are ``pad`` (attention mask 0), else
    ``special`` (an id in ``special_ids``), else ``context``. Without ``mask_token_id`` random replacements count as
    masked; without ``special_ids`` specials count as context. Unlike :func:`mask_batch`, [UNK] is
    ``special`` when ``special_ids`` holds it (a tokenizer's ``all_special_ids`` does).
    """
    selected = labels != -100
    roles = torch.full(input_ids.shape, int(Role.CONTEXT), dtype=torch.int8, device=input_ids.device)
    if special_ids:
        special = torch.isin(input_ids, torch.tensor(special_ids, device=input_ids.device))
        roles[special & ~selected] = Role.SPECIAL
    if attention_mask is not None:
        roles[(attention_mask == 0) & ~selected] = Role.PAD
    kept = selected & (input_ids == labels)
    masked = selected & ~kept
    if mask_token_id is not None:
        roles[masked & (input_ids != mask_token_id)] = Role.RANDOM
        masked = masked & (input_ids == mask_token_id)
    roles[masked] = Role.MASKED
    roles[kept] = Role.KEPT
    return roles


def encode(tokenizer, text: str, max_length: int | None = None) -> dict:
    """Tokenize one text with special tokens; returns input_ids, special_tokens_mask, word_ids."""
    enc = tokenizer(text, add_special_tokens=True, return_special_tokens_mask=True,
                    truncation=max_length is not None, max_length=max_length)
    out = {"input_ids": list(enc["input_ids"]), "special_tokens_mask": [bool(s) for s in enc["special_tokens_mask"]]}
    try:
        out["word_ids"] = enc.word_ids()
    except (ValueError, AttributeError):
        pass
    return out
