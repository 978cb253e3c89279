"""Masking policies that produce input ids, labels and a role for every position.

The policies: :class:`BertMasking` (any rate, 80/10/10 or any split, whole words), :class:`ExplicitMasking`
(positions named by the caller) and the objectives of :mod:`gradflow.inputs.objectives` (masked
diffusion, span masking); every one may be shifted (:func:`shift_to_loss_side`).

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
from gradflow.inputs.batch import MaskedBatch, SequenceDraw, pad_draws
from gradflow.inputs.objectives import MaskedDiffusion, SpanMasking, select_spans
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
    draw may equal the original token and the position is still ``random``. ``shift``: the head is
    shifted (LLM2Vec's MNTP: logits at p predict p + 1; see :func:`shift_to_loss_side`).
    """

    rate: float = 0.15
    split: tuple[float, float, float] = (0.8, 0.1, 0.1)
    whole_word: bool = False
    seed: int = 0
    min_selected: int = 1
    shift: bool = False

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
        described = {"policy": "bert", "rate": self.rate, "split": list(self.split),
                     "whole_word": self.whole_word, "seed": self.seed, "min_selected": self.min_selected}
        return {**described, "shift": True} if self.shift else described  # (unshifted: as before shifts existed)


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
    shift: bool = False

    def __post_init__(self) -> None:
        if self.action not in ("mask", "random", "keep"):
            raise MaskingError(f"explicit masking action must be mask, random or keep, got {self.action!r}")

    def describe(self) -> dict:
        described = {"policy": "explicit", "action": self.action, "seed": self.seed,
                     "positions": {str(k): list(v) for k, v in self.positions.items()}}
        return {**described, "shift": True} if self.shift else described


MaskingPolicy = BertMasking | ExplicitMasking | MaskedDiffusion | SpanMasking


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
    """Mask one unpadded sequence: ``(input_ids, labels, roles)`` of :func:`draw_sequence`, as lists of ``len(ids)``."""
    draw = draw_sequence(ids, special, index, policy, info, word_ids)
    return draw.input_ids, draw.labels, draw.roles


def draw_sequence(
    ids: Sequence[int],
    special: Sequence[bool],
    index: int,
    policy: MaskingPolicy,
    info: TokenizerInfo,
    word_ids: Sequence[int | None] | None = None,
    prompt_length: int = 0,
) -> SequenceDraw:
    """Apply ``policy`` to one unpadded sequence of ``len(ids)`` tokens.

    ``special[t]`` marks positions left out of the draws, and a position holding a special id is
    vetoed after them. ``word_ids`` (from a fast tokenizer) groups pieces into words for
    whole-word and span selection. The first ``prompt_length`` positions (a supervised
    fine-tuning prompt) are never selected: the non-special ones are ``prompt`` and carry no loss.
    """
    rng = _generator(policy.seed, index)
    prompt = np.arange(len(ids)) < prompt_length
    drawn = np.array([not s for s in special], dtype=bool) & ~prompt  # the draw set, as before the veto
    vetoed = special_id_positions(ids, info)
    maskable = drawn & ~vetoed
    clean = np.array([not s for s in special], dtype=bool) & ~vetoed
    roles = np.where(clean, Role.CONTEXT, Role.SPECIAL).astype(np.int8)
    roles[clean & prompt] = Role.PROMPT
    ratio, weight = float("nan"), 1.0
    if isinstance(policy, ExplicitMasking):
        roles[_explicit_positions(ids, maskable, index, policy, info)] = {
            "mask": Role.MASKED, "random": Role.RANDOM, "keep": Role.KEPT}[policy.action]
    elif isinstance(policy, MaskedDiffusion):  # corruption "random": every maskable token carries the loss, weight 1
        ratio = policy.mask_ratio(rng, index)
        weight = 1.0 / ratio if policy.corruption == "mask" else 1.0
        roles[maskable] = Role.CONTEXT if policy.corruption == "mask" else Role.KEPT
        roles[_pick(rng, np.flatnonzero(maskable), ratio, policy.min_selected)] = (
            Role.MASKED if policy.corruption == "mask" else Role.RANDOM)
    elif isinstance(policy, SpanMasking):
        for span in select_spans(_selection_units(drawn, word_ids), maskable, policy, rng):
            roles[span] = _action(rng.random(), policy.split)
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
            for unit, sel, a in zip(units, picked, action):
                if sel:
                    roles[unit] = _action(a, policy.split)
    inputs = np.asarray(ids, dtype=np.int64).copy()
    inputs[roles == Role.MASKED] = info.mask_token_id
    random_pos = np.flatnonzero(roles == Role.RANDOM)
    if random_pos.size:
        inputs[random_pos] = _random_tokens(rng, random_pos.size, info)
    original = np.asarray(ids, dtype=np.int64)
    roles[vetoed] = Role.SPECIAL  # after every draw: the draws of all other positions stay put
    inputs[vetoed] = original[vetoed]
    labels = np.where(roles <= Role.KEPT, original, -100)
    input_roles = roles
    if policy.shift:
        roles, labels = shift_to_loss_side(input_roles, labels)
    norm = float((labels != -100).sum())
    if isinstance(policy, MaskedDiffusion):
        norm = float(len(ids) - min(prompt_length, len(ids)))  # LLaDA: b * l in pre-training, the response in SFT
    return SequenceDraw(inputs.tolist(), labels.tolist(), roles.tolist(), input_roles.tolist(), weight, ratio, norm)


def _pick(rng: np.random.Generator, positions: np.ndarray, rate: float, min_selected: int) -> np.ndarray:
    """The ``positions`` selected independently with probability ``rate`` (``min_selected`` of them at least)."""
    picked = rng.random(positions.size) < rate
    need = min(min_selected, positions.size)
    if picked.sum() < need:
        picked[:] = False
        picked[rng.choice(positions.size, size=need, replace=False)] = True
    return positions[picked]


def _action(draw: float, split: tuple[float, float, float]) -> int:
    """The role of a selected unit whose action draw is ``draw``: masked, random or kept by ``split``."""
    p_mask, p_random, _ = split
    return Role.MASKED if draw < p_mask else Role.RANDOM if draw < p_mask + p_random else Role.KEPT


def shift_to_loss_side(input_roles: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Roles and labels of a shifted head (logits at ``p`` predict the token at ``p + 1``), from the inputs' ones.

    Position ``p`` carries the loss of the token at ``p + 1`` when that token is selected: its role
    becomes that token's (``masked``, ``random`` or ``kept``) and its label that token, whatever
    ``p``'s own input is (a special [CLS]/<s> before a selected token carries loss too). Every other
    position carries no loss: ``context`` (a corrupted input whose successor is not selected
    included), or ``prompt``/``special``/``pad`` as its input. ``input_roles`` and ``labels``: (T,) arrays.
    """
    roles = np.where(input_roles <= Role.CONTEXT, Role.CONTEXT, input_roles).astype(np.int8)
    shifted = np.full_like(labels, -100)
    carries = input_roles[1:] <= Role.KEPT
    roles[:-1][carries] = input_roles[1:][carries]
    shifted[:-1][carries] = labels[1:][carries]
    return roles, shifted


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
    optionally ``word_ids`` and ``prompt_length`` (a fine-tuning prompt's leading tokens, never
    selected). Sequences longer than ``max_length`` raise (window them first:
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
    draws = []
    for enc, index in zip(encodings, indices):
        if len(enc["input_ids"]) > max_length:
            raise MaskingError(
                f"sequence {index} has {len(enc['input_ids'])} tokens, more than max_length={max_length}; "
                "split long documents into windows (gradflow.inputs.corpus.windows) or raise max_length"
            )
        draws.append(draw_sequence(enc["input_ids"], enc["special_tokens_mask"], index, policy, info,
                                   enc.get("word_ids"), int(enc.get("prompt_length", 0))))
    pad_id = info.pad_token_id if info.pad_token_id >= 0 else 0
    prompted = any(int(enc.get("prompt_length", 0)) > 0 for enc in encodings)
    batch = pad_draws(draws, [enc["input_ids"] for enc in encodings], indices, pad_id,
                      weighted=isinstance(policy, MaskedDiffusion), shifted=policy.shift,
                      mean_over_sequences=prompted and isinstance(policy, MaskedDiffusion))
    batch.extra_inputs = token_inputs(tokenizer, batch.input_ids, batch.attention_mask)
    return batch


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
