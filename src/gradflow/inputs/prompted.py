"""Prompt/response corpora for supervised fine-tuning of a diffusion LM: the prompt is never masked.

A ``.jsonl`` file whose every line is an object with a string prompt field and a string response
field (names chosen with ``--prompt-field`` and ``--response-field``) gives one window per line:
the pair tokenised as the tokenizer joins two segments (BERT: ``[CLS] prompt [SEP] response [SEP]``),
``prompt_length`` = the tokens before the response's first (its special tokens included), so the
masking never selects them (LLaDA's SFT: ``noisy_batch[prompt_index] = input_ids[prompt_index]``).
A response too long for the window is cut to fit (counted in meta.json's ``truncated_responses``);
a prompt that leaves the response no token is refused, naming its line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from gradflow.errors import CorpusError
from gradflow.inputs.streaming import LongLine


@dataclass(frozen=True)
class PromptFields:
    """The jsonl fields of a prompt/response corpus."""

    prompt: str = "prompt"
    response: str = "response"

    def describe(self) -> dict:
        """For meta.json."""
        return {"prompt_field": self.prompt, "response_field": self.response}


def prompted_records(lines: Iterable[tuple[int, str | LongLine]], source: str,
                     fields: PromptFields) -> Iterator[tuple[str, str, int]]:
    """``(prompt, response, line number)`` of every non-blank line; a line without both string fields raises
    :class:`CorpusError` naming the file, the line and the field."""
    expected = f"each line must be a JSON object with string \"{fields.prompt}\" and \"{fields.response}\" fields"
    for number, line in lines:
        if isinstance(line, LongLine):
            raise CorpusError(f"{source}, line {number}: a record this long cannot fit one window; {expected}, "
                              "short enough for --max-length.")
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as err:
            raise CorpusError(f"{source}, line {number}: not valid JSON ({getattr(err, 'msg', err)}); "
                              f"{expected}.") from None
        for name in (fields.prompt, fields.response):
            if not isinstance(record, dict) or not isinstance(record.get(name), str):
                raise CorpusError(f"{source}, line {number}: no string \"{name}\" field; {expected} (choose the "
                                  "names with --prompt-field and --response-field).")
        yield record[fields.prompt], record[fields.response], number


def prompted_encoding(tokenizer, prompt: str, response: str, max_length: int, where: str) -> dict:
    """One window of a prompt/response pair: ``input_ids``, ``special_tokens_mask``, ``word_ids``,
    ``prompt_length`` (lists of length T <= ``max_length``) and ``truncated`` (the response was cut to fit)."""
    if not getattr(tokenizer, "is_fast", False):
        raise CorpusError(f"{type(tokenizer).__name__} is a slow tokenizer: a prompt/response corpus needs a fast "
                          "one (it tells the response's tokens from the prompt's).")
    enc = tokenizer(prompt, response, add_special_tokens=True, return_special_tokens_mask=True)
    response_tokens = sum(1 for s in enc.sequence_ids() if s == 1)
    others = len(enc["input_ids"]) - response_tokens  # the prompt and every special token
    if response_tokens == 0:
        raise CorpusError(f"{where}: the response tokenizes to no token; give it text.")
    if max_length - others < 1:
        raise CorpusError(f"{where}: the prompt takes {others} of the window's {max_length} tokens (special tokens "
                          "included) and leaves none for the response (a two-pass model's canvas: no room); raise --max-length or "
                          "shorten the prompt.")
    truncated = len(enc["input_ids"]) > max_length
    if truncated:
        enc = tokenizer(prompt, response, add_special_tokens=True, return_special_tokens_mask=True,
                        truncation="only_second", max_length=max_length)
    segments = list(enc.sequence_ids())
    return {"input_ids": list(enc["input_ids"]), "special_tokens_mask": [bool(s) for s in enc["special_tokens_mask"]],
            "word_ids": list(enc.word_ids()), "prompt_length": segments.index(1), "truncated": truncated}


__all__ = ["PromptFields", "prompted_encoding", "prompted_records"]
