"""Extend a masked LM's vocabulary with whole words, each new row initialised from its old pieces.

``extend_vocabulary(model, tokenizer, ["photosynthesis", ...])`` adds every word as one token
(normalised as the tokenizer normalises its input, e.g. lower-cased for an uncased BERT), grows
the input embedding matrix (and the MLM decoder and its bias with it) and sets each new row to the
mean of the rows of the sub-word pieces the word was split into before. Where the decoder is not
tied to the input embeddings, its new rows and biases are initialised the same way from its own.

Where the new rows then get their gradient is measured by
:class:`gradflow.interventions.new_rows.NewRowGradients`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gradflow.errors import GradflowError


@dataclass(frozen=True)
class VocabularyExtension:
    """What :func:`extend_vocabulary` did: per new word, its token id and the old piece ids it came from."""

    words: tuple[str, ...]
    new_ids: tuple[int, ...]
    pieces: tuple[tuple[int, ...], ...]
    tied: bool

    def to_dict(self) -> dict:
        return {"words": list(self.words), "new_ids": list(self.new_ids),
                "pieces": [list(p) for p in self.pieces], "tied": self.tied}


def read_word_list(path: str | Path) -> list[str]:
    """One word per line (blank lines and lines starting with ``#`` skipped)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise GradflowError(f"cannot read the word list {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise GradflowError(f"the word list {path} is not UTF-8 text: save it as UTF-8, one word per line") from None
    words = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not words:
        raise GradflowError(f"the word list {path} has no words: write one word per line")
    return words


def normalise(tokenizer, word: str) -> str:
    """``word`` as the tokenizer's normaliser sees it (unchanged for tokenizers without one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normaliser = getattr(backend, "normalizer", None) if backend is not None else None
    return normaliser.normalize_str(word) if normaliser is not None else word


def extend_vocabulary(model: nn.Module, tokenizer, words: Sequence[str]) -> VocabularyExtension:
    """Add ``words`` (each one new token) to ``tokenizer`` and ``model`` in place; see the module docstring.

    Raises :class:`GradflowError` for an empty list, a word with white space, or a word that is
    already one token of the vocabulary.
    """
    cleaned: list[str] = []
    for word in words:
        if not isinstance(word, str) or not word.strip() or any(ch.isspace() for ch in word.strip()):
            raise GradflowError(f"extend_vocabulary: {word!r} is not one word (no white space, not empty)")
        form = normalise(tokenizer, word.strip())
        if form not in cleaned:
            cleaned.append(form)
    if not cleaned:
        raise GradflowError("extend_vocabulary: no words given")
    vocab = tokenizer.get_vocab()
    known = [w for w in cleaned if w in vocab]
    if known:
        raise GradflowError(f"extend_vocabulary: already one token of the vocabulary: {', '.join(known[:5])}"
                            f"{' ...' if len(known) > 5 else ''}; leave them out")
    pieces = [tuple(tokenizer(w, add_special_tokens=False)["input_ids"]) for w in cleaned]
    empty = [w for w, p in zip(cleaned, pieces) if not p]
    if empty:
        raise GradflowError(f"extend_vocabulary: the tokenizer splits {empty[0]!r} into no pieces")
    inputs = model.get_input_embeddings()
    outputs = model.get_output_embeddings()
    tied = outputs is not None and outputs.weight.data_ptr() == inputs.weight.data_ptr()
    tokenizer.add_tokens(cleaned)
    new_ids = tuple(tokenizer.convert_tokens_to_ids(w) for w in cleaned)
    rows = max(len(tokenizer), inputs.weight.shape[0])
    model.resize_token_embeddings(rows, mean_resizing=False)
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    with torch.no_grad():
        for new, old in zip(new_ids, pieces):
            index = torch.tensor(old, device=inputs.weight.device)
            inputs.weight[new] = inputs.weight[index].mean(0)
            if outputs is not None and not tied:
                outputs.weight[new] = outputs.weight[index].mean(0)
            bias = getattr(outputs, "bias", None) if outputs is not None else None
            if bias is not None:
                bias[new] = bias[index].mean()
    return VocabularyExtension(tuple(cleaned), new_ids, tuple(pieces), tied)


__all__ = ["VocabularyExtension", "extend_vocabulary", "normalise", "read_word_list"]
