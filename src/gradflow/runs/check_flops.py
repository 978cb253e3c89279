"""Matmul FLOPs of one masked batch, counted analytically from the model's shapes (for ``gradflow check``).

Every matmul-per-position call of the forward pass (``nn.Linear``, pointwise ``nn.Conv1d``, Linear-shaped
modules: :func:`matmul_features`) is seen by a forward hook, which only reads its shape:
``in`` and ``out`` features and the rows it ran on. A Linear costs ``2 * in * out`` FLOPs per token
forward and three times that forward + backward (the backward forms the input and the weight
gradients, one matmul each of the forward's size). Token calls (the batch's ``B * T`` rows) are
counted at the batch's real positions only (N, padding left out), as an unpadded implementation
computes them; other calls (DeBERTa's relative-position embeddings) at the rows they ran on.

Attention's score and value matmuls add, per block application and sequence s with ``n_s`` real
tokens, ``2 * n_s^2 * d_q`` (``Q K^T``) and ``2 * n_s^2 * d_v`` (``A V``) forward, times 3, where
``d_q`` and ``d_v`` are the output widths of the block's ``attn.q`` and ``attn.v`` (full attention:
an upper bound for local or sparse attention). Norms, softmax, activations and embedding look-ups
are not matmuls and are not counted; nor are convolutions (ConvBERT).

The MLM head (every Linear outside the base model, and the head modules an adapter places inside it:
``HeadSpec.in_base_model``, LLaDA's output layer) is counted at the N_loss loss positions, as
BERT's original pretraining code, flash-attention's BERT and MosaicBERT compute it (they gather the
selected positions first); what a dense head computes at the other positions is reported apart
(``head_unselected``) and is not in the total. So::

    total     = 3 * [ 2 N sum_{block Linear calls} in*out + 2 sum_blocks sum_s n_s^2 (d_q + d_v)
                      + 2 N sum_{encoder Linear calls outside the blocks} in*out
                      + 2 N_loss sum_{head Linear} in*out + 2 sum_{non-token calls} rows*in*out ]
    skippable = 3 * 2 * N_unselected * sum_{last block's Linear sublayers that get exactly zero
                context gradient (attn.q, attn.out, ffn.in, ffn.gate, ffn.out)} in*out
    share     = skippable / total

with N_unselected = N - N_loss (context and special positions). ``skippable_attention``: the last
block's score and value rows of the unselected queries, ``3 * 2 * sum_s u_s n_s (d_q + d_v)``
(``u_s`` unselected positions of sequence s), which flash-attention's ``last_layer_subset`` also
skips; it is reported apart, not in ``skippable``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch import nn

from gradflow.adapters import Adapter, SublayerSpec, get_module
from gradflow.roles import loss_position_mask

FORWARD_BACKWARD = 3
"""Forward + backward FLOPs of a matmul, in units of its forward FLOPs."""


@dataclass(frozen=True)
class FlopCount:
    """Forward + backward matmul FLOPs of one batch (see the module docstring for the formula).

    ``tokens``, ``loss_tokens``, ``unselected_tokens``: N, N_loss and N - N_loss (padding left out);
    ``blocks_linear``, ``attention``, ``encoder_other``, ``head``, ``non_token``: the terms of
    ``total``; ``head_unselected``: a dense head's extra cost at the unselected positions (not in the
    total); ``skippable``: the last block's zero-context Linear sublayers at the unselected positions
    (``skippable_sublayers``); ``share`` = skippable / total; ``skippable_attention`` and
    ``share_with_attention``: the same with the last block's attention rows of the unselected queries.
    """

    tokens: int
    loss_tokens: int
    unselected_tokens: int
    blocks_linear: float
    attention: float
    encoder_other: float
    head: float
    non_token: float
    head_unselected: float
    total: float
    skippable_sublayers: tuple[str, ...]
    skippable: float
    skippable_attention: float
    share: float
    share_with_attention: float

    def to_dict(self) -> dict:
        out = asdict(self)
        out["skippable_sublayers"] = list(self.skippable_sublayers)
        return out


@dataclass
class LinearCalls:
    """Shapes of the Linear calls of one forward: (module id, in, out, rows) in call order."""

    calls: list[tuple[int, int, int, int]]


def matmul_features(module: nn.Module) -> tuple[int, int] | None:
    """(inputs per output, outputs) of a module that is one matmul per position, else None: an
    ``nn.Linear``, a pointwise (kernel 1) ``nn.Conv1d`` on (B, C, T) (per group: ``in / groups`` inputs
    per output, SqueezeBERT), or a Linear-shaped module that is no ``nn.Linear`` (I-BERT's QuantLinear)."""
    if isinstance(module, nn.Conv1d):
        if module.kernel_size == (1,):
            return module.in_channels // module.groups, module.out_channels
        return None
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.Linear) or (isinstance(weight, torch.Tensor) and weight.dim() == 2
                                         and hasattr(module, "in_features") and hasattr(module, "out_features")):
        return module.in_features, module.out_features
    return None


@contextmanager
def count_linear_calls(model: nn.Module) -> Iterator[LinearCalls]:
    """Record the shape of every matmul-per-position call (``matmul_features``) of a forward (hooks removed on exit)."""
    seen = LinearCalls([])

    def hook(module: nn.Module, args: tuple, output: object) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor):
            fan_in, fan_out = matmul_features(module)
            channels = x.shape[1] if isinstance(module, nn.Conv1d) else x.shape[-1]
            seen.calls.append((id(module), fan_in, fan_out, x.numel() // channels))

    handles = [m.register_forward_hook(hook) for m in model.modules() if matmul_features(m) is not None]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def out_width(block: nn.Module, spec: SublayerSpec | None) -> int:
    """Output width of a matmul sublayer (its row chunk for a fused one); 0 if it is not one."""
    module = get_module(block, spec.path) if spec is not None else None
    features = matmul_features(module) if module is not None else None
    if features is None:
        return 0
    return features[1] // (spec.chunk[1] if spec.chunk else 1)


def count_flops(model: nn.Module, adapter: Adapter, blocks: Sequence[nn.Module], calls: LinearCalls,
                roles: torch.Tensor, attention_mask: torch.Tensor, zero_sublayers: Sequence[str]) -> FlopCount:
    """The batch's FlopCount. ``blocks``: the block modules in call order; ``roles``/``attention_mask``:
    (B, T); ``zero_sublayers``: the last block's sublayers measured to get exactly zero context gradient."""
    b, t = roles.shape
    real = attention_mask.to(torch.bool).cpu()
    lengths = real.sum(dim=1).to(torch.float64)
    n = int(real.sum())
    loss = loss_position_mask(roles.cpu()) & real
    n_loss = int(loss.sum())
    n_unsel = n - n_loss
    block_ids = {id(m) for block in blocks for m in block.modules()}
    base_ids = {id(m) for m in model.base_model.modules()} - _head_module_ids(model, adapter)
    terms = dict.fromkeys(("blocks_linear", "encoder_other", "head", "non_token", "head_unselected"), 0.0)
    for module_id, fan_in, fan_out, rows in calls.calls:
        per_token = 2.0 * fan_in * fan_out * FORWARD_BACKWARD
        # a model that pads the sequence itself (adapter.appends_padding: Longformer) runs its token calls
        # on B * T' rows, T' >= T; they are token calls, counted like every token call at the n real tokens
        padded = adapter.appends_padding and module_id in base_ids and rows % b == 0 and rows > b * t
        if rows not in (b * t, n) and not padded:
            terms["non_token"] += per_token * rows
        elif module_id in block_ids:
            terms["blocks_linear"] += per_token * n
        elif module_id in base_ids:
            terms["encoder_other"] += per_token * n
        else:
            terms["head"] += per_token * n_loss
            terms["head_unselected"] += per_token * n_unsel
    widths = [out_width(block, adapter.sublayers.get("attn.q")) + out_width(block, adapter.sublayers.get("attn.v"))
              for block in blocks]
    attention = 2.0 * FORWARD_BACKWARD * float((lengths ** 2).sum()) * sum(widths)
    total = terms["blocks_linear"] + attention + terms["encoder_other"] + terms["head"] + terms["non_token"]
    last = blocks[-1]
    skip_names = tuple(name for name in zero_sublayers if out_width(last, adapter.sublayers.get(name)))
    per_token = sum(2.0 * matmul_features(get_module(last, adapter.sublayers[name].path))[0]
                    * out_width(last, adapter.sublayers[name]) for name in skip_names)
    skippable = per_token * FORWARD_BACKWARD * n_unsel
    unselected = (real & ~loss).sum(dim=1).to(torch.float64)
    rows_attention = 2.0 * FORWARD_BACKWARD * float((unselected * lengths).sum()) * widths[-1]
    skip_attention = rows_attention if {"attn.q", "attn.out"} <= set(skip_names) else 0.0
    return FlopCount(
        tokens=n, loss_tokens=n_loss, unselected_tokens=n_unsel, blocks_linear=terms["blocks_linear"],
        attention=attention, encoder_other=terms["encoder_other"], head=terms["head"], non_token=terms["non_token"],
        head_unselected=terms["head_unselected"], total=total, skippable_sublayers=skip_names, skippable=skippable,
        skippable_attention=skip_attention, share=skippable / total if total else 0.0,
        share_with_attention=(skippable + skip_attention) / total if total else 0.0,
    )


def _head_module_ids(model: nn.Module, adapter: Adapter) -> set[int]:
    """Ids of the head's modules inside the base model (``adapter.head.in_base_model``; a missing path skipped:
    LLaDA with tied weights has no ``ff_out``)."""
    ids: set[int] = set()
    for path in adapter.head.in_base_model:
        try:
            ids |= {id(m) for m in get_module(model, path).modules()}
        except LookupError:
            continue
    return ids


__all__ = ["FORWARD_BACKWARD", "FlopCount", "LinearCalls", "count_flops", "count_linear_calls", "matmul_features",
           "out_width"]
