"""Batches of prompt and canvas for a two-pass model (DiffusionGemma): the split rule and the (B, P + C) layout.

A two-pass model (:mod:`gradflow.adapters.two_pass`) encodes a prompt and denoises a canvas of at most ``C``
tokens (``C``: ``gradflow record --canvas-length``, by default the model config's ``canvas_length``). Each window is
split into the two before masking:

- **a prompt/response ``.jsonl``** (``--prompt-field``): the prompt (with the special tokens before the response)
  is the prompt, the response (with the special tokens after it) is the canvas, cut to its first ``C`` tokens;
- **a plain corpus** (the split rule): a window of ``n`` tokens (special tokens included) puts its last
  ``c = min(C, n - 1)`` tokens on the canvas and the ``n - c`` before them in the prompt, so every prompt keeps at
  least one token and a full window of ``max_length`` tokens has a canvas of ``C`` tokens when ``max_length > C``.

The masking never selects a prompt token (:func:`gradflow.inputs.masking.draw_sequence` with ``prompt_length``);
a window whose prompt leaves the canvas no token, and a plain window of one token (no room for both), are refused in
one sentence (:class:`CorpusError`); a ``C`` asked at or above ``--max-length`` on a plain corpus is refused before
any window is read (:func:`gradflow.runs.job.canvas_length`). After masking,
:func:`canvas_batch` lays each row out as its prompt, right-padded to the batch's widest prompt ``P``, then its
canvas, right-padded to the widest canvas ``C``: a (B, P + C) :class:`~gradflow.inputs.batch.MaskedBatch` with
``prompt_width = P``. Every prompt position that is not padding has the role ``prompt`` (its special tokens
included: the prompt is the encoder's input, never a loss position); padding is ``pad`` in both parts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradflow.errors import CorpusError
from gradflow.inputs.batch import MaskedBatch
from gradflow.roles import Role

_CUT = ("input_ids", "special_tokens_mask", "word_ids")


def split_encoding(encoding: dict, canvas: int, where: str) -> dict:
    """``encoding`` (lists of length n, optionally ``prompt_length``) split into prompt and canvas (module docstring):
    a copy with ``prompt_length`` set and the canvas cut to at most ``canvas`` tokens. ``where`` names the window in
    the error raised when the prompt leaves the canvas no token."""
    n = len(encoding["input_ids"])
    prompt = encoding.get("prompt_length")
    if prompt is None:  # the split rule of a plain corpus
        if n < 2:
            raise CorpusError(f"{where}: a window of {n} token(s) cannot hold both a prompt and a canvas (one token "
                              "each); raise --max-length to 2 or more, or drop the one-token document.")
        prompt = n - min(canvas, n - 1)
    if n < 2 or prompt >= n:
        raise CorpusError(f"{where}: the prompt takes {min(prompt, n)} of the window's {n} tokens and leaves the "
                          "canvas no room; raise --max-length or shorten the prompt.")
    keep = prompt + min(canvas, n - prompt)
    split = {key: (value[:keep] if key in _CUT and isinstance(value, list) else value)
             for key, value in encoding.items()}
    split["prompt_length"] = prompt
    return split


def canvas_batch(batch: MaskedBatch, prompt_lengths: Sequence[int], pad_id: int) -> MaskedBatch:
    """The (B, P + C) two-pass layout of a right-padded (B, T) ``batch`` whose row ``b`` holds ``prompt_lengths[b]``
    prompt tokens and then its canvas (module docstring). ``pad_id`` fills the padding's ids."""
    real = batch.attention_mask.sum(dim=1)
    prompts = torch.as_tensor(list(prompt_lengths), dtype=torch.long)
    canvases = real - prompts
    if bool((canvases < 1).any()):
        row = int(torch.nonzero(canvases < 1)[0])
        raise CorpusError(f"sequence {int(batch.sequence_index[row])}: the prompt takes {int(prompts[row])} of its "
                          f"{int(real[row])} tokens and leaves the canvas no room; raise --max-length or shorten "
                          "the prompt.")
    width_p, width_c = int(prompts.max()), int(canvases.max())
    column = torch.arange(width_p + width_c)
    in_prompt = column[None, :] < prompts[:, None]
    in_canvas = (column[None, :] >= width_p) & (column[None, :] < width_p + canvases[:, None])
    source = torch.where(in_prompt, column[None, :], column[None, :] - width_p + prompts[:, None])
    valid = in_prompt | in_canvas
    source = torch.where(valid, source, torch.zeros_like(source))

    def place(values: torch.Tensor | None, fill: float | int) -> torch.Tensor | None:
        if values is None:
            return None
        moved = values.gather(1, source.to(values.device))
        return torch.where(valid.to(values.device), moved, torch.full_like(moved, fill))

    roles = place(batch.roles, int(Role.PAD))
    roles[in_prompt] = int(Role.PROMPT)
    input_roles = place(batch.input_roles, int(Role.PAD))
    if input_roles is not None:
        input_roles[in_prompt] = int(Role.PROMPT)
    return MaskedBatch(
        place(batch.input_ids, pad_id), place(batch.original_ids, pad_id), place(batch.labels, -100), roles,
        place(batch.attention_mask, 0), batch.sequence_index,
        extra_inputs={name: place(values, 0) for name, values in batch.extra_inputs.items()},
        loss_weights=place(batch.loss_weights, 0.0), loss_norm=batch.loss_norm,
        mean_over_sequences=batch.mean_over_sequences, mask_ratio=batch.mask_ratio, input_roles=input_roles,
        prompt_width=width_p)


__all__ = ["canvas_batch", "split_encoding"]
