"""Subset functions (sparse last block, :mod:`gradflow.adapters.subset`) for BERT variants with their own attention.

YOSO, LUKE, ConvBERT, Nystromformer, X-MOD, I-BERT, SqueezeBERT and ESMC. Each function runs the last
block as its ``forward`` does, with keys, values and everything that reads neighbouring positions
(YOSO's and Nystromformer's value convolutions, ConvBERT's span convolutions) at every position, and
the query side at the selected positions ``index`` (B, n) only -> (B, n, H). Each was checked to be
exact: a position's query forms only that position's output.

- **YOSO** (``use_expectation=True``): the expected-LSH kernel ``(1 - acos(q.k) / pi) ** tau`` of each
  query row, through YOSO's own autograd function (its backward is YOSO's, not autograd's); the
  sampled-hash path (``use_expectation=False``, CUDA kernels, a random draw per forward) is refused.
- **LUKE**: words only (entity inputs are refused; with them entity queries would be computed too).
- **ConvBERT**: the span kernel of position i is ``softmax(conv_kernel_layer(key_conv(i) * query(i)))``,
  where ``key_conv`` is a depthwise convolution over neighbouring hidden states (at every position)
  and its pointwise map (at i only); the kernel weighs ``conv_out_layer`` at i's neighbours (every
  position, zero beyond the ends as ``unfold`` pads).
- **Nystromformer**: the exact-attention configuration only (``num_landmarks == segment_means_seq_len``;
  landmarks average every position's query, see :mod:`gradflow.adapters.extra_inputs`).
- **X-MOD**: post-norm; the language adapter (per sequence, ``lang_ids``) and both calls of
  ``output.LayerNorm`` at the selected positions.
- **I-BERT** (``quant_mode=False``): the QuantLinear/QuantAct/IntLayerNorm modules compute float maps;
  in training mode their activation-range buffers (``x_min``, ``x_max``, unused without quant_mode)
  are updated from the rows they see, so the last block's query-side ranges come from the loss positions.
- **SqueezeBERT**: channels-first (B, C, T) hidden states, pointwise grouped ``Conv1d`` projections.
- **ESMC**: the Llama-style block with LayerNorms on the projected queries (``q_norm``: per position, at
  the selected rows) and keys (``k_norm``: every position), residual branches divided by
  ``sqrt(num_hidden_layers / 36)``.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from gradflow.adapters.subset import (
    _check_layout,
    _no_cross_attention,
    attend,
    mask_rows,
    rotary_rows,
    select_rows,
    split_heads,
)
from gradflow.errors import SparseTrainingError


def _bert_like(**extra: set[str]) -> dict[str, set[str]]:
    """BERT's post-LN block layout (no pre-norm modules) with ``extra`` children per parent (dots as '__')."""
    layout = {
        "": {"attention", "intermediate", "output"},
        "attention": {"self", "output"},
        "attention.self": {"query", "key", "value", "dropout"},
        "attention.output": {"dense", "LayerNorm", "dropout"},
        "output": {"dense", "LayerNorm", "dropout"},
    }
    for parent, names in extra.items():
        key = parent.replace("__", ".")
        layout[key] = layout.get(key, set()) | names
    return layout


YOSO_LAYOUT_MODULES = _bert_like(attention__self={"conv"})
LUKE_LAYOUT_MODULES = _bert_like(attention__self={"w2e_query", "e2w_query", "e2e_query"})
NYSTROMFORMER_LAYOUT_MODULES = _bert_like(attention__self={"conv"})
CONVBERT_LAYOUT_MODULES = _bert_like(attention__self={"key_conv_attn_layer", "conv_kernel_layer", "conv_out_layer",
                                                      "unfold"},
                                     attention__self__key_conv_attn_layer={"depthwise", "pointwise"})
XMOD_LAYOUT_MODULES = _bert_like(output={"adapter_modules", "adapter_layer_norm"})
IBERT_LAYOUT_MODULES = {
    "": {"attention", "intermediate", "output", "pre_intermediate_act", "pre_output_act"},
    "attention": {"self", "output"},
    "attention.self": {"query", "key", "value", "query_activation", "key_activation", "value_activation",
                       "output_activation", "dropout", "softmax"},
    "attention.output": {"dense", "ln_input_act", "LayerNorm", "output_activation", "dropout"},
}
SQUEEZEBERT_LAYOUT_MODULES = {
    "": {"attention", "post_attention", "intermediate", "output"},
    "attention": {"query", "key", "value", "dropout", "softmax", "matmul_qk", "matmul_qkv"},
    "post_attention": {"conv1d", "layernorm", "dropout"},
}
ESMC_LAYOUT_MODULES = {
    "": {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"},
    "self_attn": {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"},
}
"""The child modules each family's block may have (by parent path); anything else is refused."""


def _dropout(att: nn.Module) -> float:
    return att.dropout.p if att.training else 0.0


def _heads_at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, heads, T, d) at ``index`` (B, n) -> (B, n, heads * d)."""
    rows = select_rows(x.transpose(1, 2), index)
    return rows.reshape(*rows.shape[:2], -1)


def _bert_tail(block: nn.Module, context: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``attention.output`` (dense, dropout, residual, LayerNorm) and ``feed_forward_chunk`` at the selected rows."""
    return block.feed_forward_chunk(block.attention.output(context, rows))


def _softmax_attention(block: nn.Module, hidden: torch.Tensor, call: dict, index: torch.Tensor) -> torch.Tensor:
    """BERT's attention of the selected queries (``attention.self.{query,key,value}``) -> (B, n, heads * d)."""
    att = block.attention.self
    d = att.attention_head_size
    query = split_heads(att.query(select_rows(hidden, index)), d)
    key, value = split_heads(att.key(hidden), d), split_heads(att.value(hidden), d)
    return attend(query, key, value, mask_rows(call.get("attention_mask"), index), d ** -0.5, _dropout(att))


def luke_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """LUKE's ``LukeLayer`` on words (``word_hidden_states``); entity inputs are refused."""
    if call.get("entity_hidden_states") is not None:
        raise SparseTrainingError("LUKE got entity inputs (entity_ids): the sparse last block runs the words only "
                                  "and would leave out the entity positions' queries and the entity loss; train "
                                  "without entity inputs or with block=False")
    _check_layout(block, LUKE_LAYOUT_MODULES, "LUKE's")
    hidden = call["word_hidden_states"]
    return _bert_tail(block, _softmax_attention(block, hidden, call, index), select_rows(hidden, index))


def xmod_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """X-MOD's post-norm ``XmodLayer``: attention, ``attention.output.LayerNorm``, FFN, the language adapter of
    each sequence (``lang_ids`` (B,)) inside ``output``, and ``output.LayerNorm`` again, at the selected rows."""
    _no_cross_attention(call)
    if block.pre_norm:
        raise SparseTrainingError("X-MOD with pre_norm=True normalises with the encoder's LayerNorm after the last "
                                  "block, which the sparse last block does not run: train with block=False")
    _check_layout(block, XMOD_LAYOUT_MODULES, "X-MOD's")
    hidden = call["hidden_states"]
    rows = select_rows(hidden, index)
    attention = block.attention.output.LayerNorm(block.attention.output(_softmax_attention(block, hidden, call,
                                                                                           index), rows))
    return block.output.LayerNorm(block.output(block.feed_forward_chunk(attention), attention, call["lang_ids"]))


def yoso_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """YOSO's ``YosoLayer`` with ``use_expectation=True``: normalised queries and keys, YOSO's expected-LSH
    cumulation (its own autograd function) with the masks YOSO derives from ``attention_mask`` (B, T),
    the normalised result plus the value convolution (``conv_window``) at the selected rows."""
    att = block.attention.self
    if not att.use_expectation:
        raise SparseTrainingError("YOSO with use_expectation=False samples LSH hashes in CUDA kernels (a new random "
                                  "draw per forward), so the sparse block could not reproduce the dense one; set "
                                  "config.use_expectation=True or train with block=False")
    _check_layout(block, YOSO_LAYOUT_MODULES, "YOSO's")
    hidden, mask = call["hidden_states"], call["attention_mask"]
    heads, d = att.num_attention_heads, att.attention_head_size
    (batch, n), length = index.shape, hidden.shape[1]
    rows = select_rows(hidden, index)
    query = split_heads(att.query(rows), d)
    key, value = split_heads(att.key(hidden), d), split_heads(att.value(hidden), d)
    conv = att.conv(value * mask[:, None, :, None]) if att.use_conv else None

    def per_head(m: torch.Tensor) -> torch.Tensor:  # YOSO's (B, T) mask as it builds it -> (B * heads, T) int
        return (1.0 + m / 10000.0).unsqueeze(1).repeat_interleave(heads, dim=1).reshape(batch * heads, -1).int()

    query, key = F.normalize(query.reshape(batch * heads, n, d), p=2, dim=-1), \
        F.normalize(key.reshape(batch * heads, length, d), p=2, dim=-1)
    cumulation = sys.modules[type(att).__module__].YosoCumulation.apply
    context = cumulation(per_head(select_rows(mask, index)), per_head(mask), query, key,
                         value.reshape(batch * heads, length, d), att.lsh_config)
    context = F.normalize(context, p=2, dim=-1).reshape(batch, heads, n, d)
    context = context.transpose(1, 2).reshape(batch, n, heads * d)
    if conv is not None:
        context = context + _heads_at(conv, index)
    return _bert_tail(block, context, rows)


def nystromformer_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """Nystromformer's exact softmax attention (queries and keys each divided by ``d ** 0.25``, no attention
    dropout, as its forward does) plus the value convolution (``conv_kernel_size``) at the selected rows."""
    att = block.attention.self
    if att.num_landmarks != att.seq_len:
        raise SparseTrainingError(f"Nystromformer with num_landmarks={att.num_landmarks} < segment_means_seq_len="
                                  f"{att.seq_len} forms landmark queries as segment means of every position's "
                                  "query, so a loss position's output reads other positions' queries: train with "
                                  "block=False")
    _check_layout(block, NYSTROMFORMER_LAYOUT_MODULES, "Nystromformer's")
    hidden = call["hidden_states"]
    d = att.attention_head_size
    root = d ** 0.25
    rows = select_rows(hidden, index)
    query = split_heads(att.query(rows), d) / root
    key, value = split_heads(att.key(hidden), d) / root, split_heads(att.value(hidden), d)
    context = attend(query, key, value, mask_rows(call.get("attention_mask"), index), 1.0, 0.0)
    if att.conv_kernel_size is not None:
        context = context + _heads_at(att.conv(value), index)
    return _bert_tail(block, context, rows)


def convbert_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """ConvBERT's mixed attention: softmax heads, and span-based dynamic convolution heads whose kernel at
    position i comes from i's query and the depthwise convolution of i's neighbouring hidden states."""
    _no_cross_attention(call)
    _check_layout(block, CONVBERT_LAYOUT_MODULES, "ConvBERT's")
    att = block.attention.self
    hidden = call["hidden_states"]
    heads, d, width = att.num_attention_heads, att.attention_head_size, att.conv_kernel_size
    batch, n = index.shape
    rows = select_rows(hidden, index)
    separable = att.key_conv_attn_layer  # SeparableConv1D: depthwise (reads neighbours), pointwise, bias
    depthwise = select_rows(separable.depthwise(hidden.transpose(1, 2)).transpose(1, 2), index)
    key_conv = separable.pointwise(depthwise.transpose(1, 2))
    key_conv = (key_conv + separable.bias).transpose(1, 2)
    mixed_query = att.query(rows)
    kernel = att.conv_kernel_layer(key_conv * mixed_query).reshape(-1, width, 1).softmax(dim=1)
    spans = att.conv_out_layer(hidden)  # (B, T, A): position i reads rows i - pad .. i + pad (zero outside)
    pad = (width - 1) // 2
    offsets = index[:, :, None] + torch.arange(width, device=index.device)  # in the zero-padded sequence
    window = select_rows(F.pad(spans, (0, 0, pad, pad)), offsets.reshape(batch, n * width))
    window = window.reshape(batch, n, width, -1).transpose(2, 3).reshape(-1, d, width)
    conv_out = torch.matmul(window, kernel).reshape(batch, n, heads, d)
    key, value = split_heads(att.key(hidden), d), split_heads(att.value(hidden), d)
    context = attend(split_heads(mixed_query, d), key, value, mask_rows(call.get("attention_mask"), index),
                     d ** -0.5, _dropout(att))
    context = torch.cat([context.reshape(batch, n, heads, d), conv_out], dim=2).reshape(batch, n, -1)
    return _bert_tail(block, context, rows)


def ibert_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """I-BERT's ``IBertLayer`` with ``quant_mode=False``: every QuantLinear, QuantAct, IntSoftmax and
    IntLayerNorm called as its forward calls it, with no scaling factors (None, as the float model passes)."""
    if block.quant_mode or call.get("hidden_states_scaling_factor") is not None:
        raise SparseTrainingError("I-BERT with quant_mode=True computes in integers with straight-through "
                                  "gradients: the sparse last block is for the float model (quant_mode=False)")
    _check_layout(block, IBERT_LAYOUT_MODULES, "I-BERT's")
    att = block.attention.self
    hidden = call["hidden_states"]
    d = att.attention_head_size
    rows = select_rows(hidden, index)
    query = split_heads(att.query_activation(att.query(rows)[0])[0], d)
    key = split_heads(att.key_activation(att.key(hidden)[0])[0], d)
    value = split_heads(att.value_activation(att.value(hidden)[0])[0], d)
    context = attend(query, key, value, mask_rows(call.get("attention_mask"), index), d ** -0.5, _dropout(att))
    context = att.output_activation(context)[0]
    attention = block.attention.output(context, None, rows, None)[0]
    return block.feed_forward_chunk(attention, None)[0]


def squeezebert_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """SqueezeBERT's ``SqueezeBertModule`` on (B, C, T) hidden states: pointwise grouped Conv1d query at the
    selected columns, keys and values at every column; returns (B, n, C) (the encoder's final layout)."""
    _check_layout(block, SQUEEZEBERT_LAYOUT_MODULES, "SqueezeBERT's")
    att = block.attention
    hidden = call["hidden_states"]
    columns = select_rows(hidden.transpose(1, 2), index).transpose(1, 2)  # (B, C, n)
    query = att.transpose_for_scores(att.query(columns))
    key, value = att.transpose_for_scores(att.key(hidden)), att.transpose_for_scores(att.value(hidden))
    d = att.attention_head_size
    context = attend(query, key, value, mask_rows(call.get("attention_mask"), index), d ** -0.5, _dropout(att))
    attention = block.post_attention(context.transpose(1, 2), columns)
    return block.output(block.intermediate(attention), attention).transpose(1, 2)


def esmc_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """ESMC's ``EsmcLayer``: ``input_layernorm`` and ``k_norm`` at every position, ``q_norm`` and rotary positions
    at the selected rows, each residual branch divided by ``block.scaling_factor``."""
    _check_layout(block, ESMC_LAYOUT_MODULES, "ESMC's")
    hidden = call["hidden_states"]
    att = block.self_attn
    normed = block.input_layernorm(hidden)
    d = att.head_dim
    query = split_heads(att.q_norm(att.q_proj(select_rows(normed, index))).to(normed.dtype), d)
    key = split_heads(att.k_norm(att.k_proj(normed)).to(normed.dtype), d)
    value = split_heads(att.v_proj(normed), d)
    query, key = rotary_rows(att, query, key, call["position_embeddings"], index)
    groups = att.num_key_value_groups
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    dropout = att.attention_dropout if att.training else 0.0
    context = attend(query, key, value, mask_rows(call.get("attention_mask"), index), att.scaling, dropout)
    attention = select_rows(hidden, index) + att.o_proj(context) / block.scaling_factor
    return attention + block.mlp(block.post_attention_layernorm(attention)) / block.scaling_factor


__all__ = ["CONVBERT_LAYOUT_MODULES", "ESMC_LAYOUT_MODULES", "IBERT_LAYOUT_MODULES", "LUKE_LAYOUT_MODULES",
           "NYSTROMFORMER_LAYOUT_MODULES", "SQUEEZEBERT_LAYOUT_MODULES", "XMOD_LAYOUT_MODULES", "YOSO_LAYOUT_MODULES",
           "convbert_subset", "esmc_subset", "ibert_subset", "luke_subset", "nystromformer_subset",
           "squeezebert_subset", "xmod_subset", "yoso_subset"]
