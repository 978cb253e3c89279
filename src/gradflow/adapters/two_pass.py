"""Two passes through tied blocks (DiffusionGemma): where the first pass's blocks are and how a batch feeds both.

A two-pass model runs a *prompt* through one list of blocks (an encoder, causal, that caches its keys and values)
and then a *canvas* through another list (a decoder, bidirectional over the cached prompt and the canvas) whose
blocks share every parameter with the first list's, depth by depth. gradflow joins the two calls of depth ``d``
into one block record: the batch is laid out as ``(B, P + C)``, the prompt's ``P`` positions first (right-padded)
and the canvas's ``C`` after them (right-padded), and every per-position table covers both.

:class:`TwoPassSpec` holds the facts: the path of the first pass's blocks (the adapter's ``blocks`` are the second
pass's), the model class to load (no masked-LM class maps the type), how the forward takes the two parts, and the
config attribute holding the model's canvas length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TwoPassSpec:
    """The first pass's blocks and the forward's inputs of a two-pass model (module docstring).

    ``first_blocks``: path (relative to ``model.base_model``) of the first pass's ``ModuleList``; ``model_class``:
    the transformers class the checkpoint loads with; ``prompt_ids``/``prompt_mask``: the forward's keywords of the
    prompt (B, P) and its attention mask; ``canvas_ids``: of the canvas (B, C); ``canvas_mask``: the canvas's mask
    over the cached prompt and the canvas (B, P + C); ``canvas_positions``: the canvas's position ids (B, C), so that
    a row's canvas follows its own prompt, not the batch's padded width; ``canvas_length``: the config attribute (of
    the model's config or its ``text_config``) holding the canvas length the model was trained with.
    """

    first_blocks: str
    model_class: str
    prompt_ids: str = "input_ids"
    prompt_mask: str = "attention_mask"
    canvas_ids: str = "decoder_input_ids"
    canvas_mask: str = "decoder_attention_mask"
    canvas_positions: str = "decoder_position_ids"
    canvas_length: str = "canvas_length"

    def model_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> dict:
        """The forward's keyword arguments of a (B, P + C) batch whose first ``prompt_width`` = P positions are the
        prompt: ids and masks (long, 1 for real tokens) cut at P; the canvas's positions continue each row's prompt."""
        prompt_mask = attention_mask[:, :prompt_width]
        width = input_ids.shape[1] - prompt_width
        positions = prompt_mask.sum(dim=1, keepdim=True) + torch.arange(width, device=input_ids.device)
        return {self.prompt_ids: input_ids[:, :prompt_width], self.prompt_mask: prompt_mask,
                self.canvas_ids: input_ids[:, prompt_width:], self.canvas_mask: attention_mask,
                self.canvas_positions: positions}

    def default_canvas(self, config: object) -> int | None:
        """The canvas length of ``config`` (or of its ``text_config``), None where neither has one."""
        for holder in (config, getattr(config, "text_config", None)):
            value = getattr(holder, self.canvas_length, None)
            if isinstance(value, int) and value > 0:
                return value
        return None


def first_pass_blocks(spec: TwoPassSpec, base: nn.Module) -> list[nn.Module]:
    """The first pass's blocks of ``base`` (the model's base model), in call order."""
    return list(base.get_submodule(spec.first_blocks))


def canvas_logits(logits: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """(B, C, V) logits of the canvas placed at the canvas positions of a (B, P + C) batch: (B, P + C, V), zeros at
    the ``prompt_width`` = P prompt positions (which carry no label, so no loss and no gradient)."""
    pad = logits.new_zeros(logits.shape[0], prompt_width, logits.shape[2])
    return torch.cat([pad, logits], dim=1)


__all__ = ["TwoPassSpec", "canvas_logits", "first_pass_blocks"]
