"""The sparse last block of DeBERTa (v1), DeBERTa-v2/v3 and ModernBERT (ModernVBERT's text encoder too).

Each computes, at the selected query positions only, what the block's ``forward`` computes there; keys
and values (and the relative-position projections, which map ``rel_embeddings``, not positions of the
batch) are computed in full. Exactness: a query row of the last block influences only its own output.

- **DeBERTa's disentangled attention**: the content-to-position term (``c2p``) of query i reads its own
  query against the relative-position keys at ``relative_pos[i, j]``: the selected rows of
  ``relative_pos``; the position-to-content term (``p2c``) of query i reads every key j against the
  relative-position queries at ``relative_pos[j, i]``: the selected *columns*. The scale, the masking
  (``masked_fill`` with the dtype's minimum, as DeBERTa does: a fully masked row stays finite), the
  softmax and the dropouts are DeBERTa's. DeBERTa-v2's convolution after the first layer (ConvLayer) is
  refused in a one-layer model, where the first layer is the last; the enhanced-mask-decoder call
  (``query_states``) is refused.
- **ModernBERT** (pre-LN, fused ``Wqkv``, rotary positions, global and local sliding-window layers):
  the sliding window is in the 4-d mask the model builds per layer type for the ``sdpa`` and ``eager``
  attention (its selected rows); ``flash_attention_*`` and ``flex_attention`` take the window as a
  kernel argument or a BlockMask, so they are refused.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from gradflow.adapters.subset import _check_layout, attend, mask_rows, select_rows, split_heads
from gradflow.errors import SparseTrainingError

DEBERTA_V2_LAYOUT_MODULES = {
    "": {"attention", "intermediate", "output"},
    "attention": {"self", "output"},
    "attention.self": {"query_proj", "key_proj", "value_proj", "pos_key_proj", "pos_query_proj", "pos_dropout",
                       "dropout"},
    "attention.output": {"dense", "LayerNorm", "dropout"},
    "intermediate": {"dense", "intermediate_act_fn"},
    "output": {"dense", "LayerNorm", "dropout"},
}
"""The child modules of DeBERTa-v2's ``DebertaV2Layer`` (relative-position key/query projections optional)."""

DEBERTA_LAYOUT_MODULES = {
    **DEBERTA_V2_LAYOUT_MODULES,
    "attention.self": {"in_proj", "pos_proj", "pos_q_proj", "pos_dropout", "head_logits_proj", "head_weights_proj",
                       "dropout"},
}
"""The child modules of DeBERTa's ``DebertaLayer`` (fused ``in_proj``; talking heads optional)."""

MODERNBERT_LAYOUT_MODULES = {
    "": {"attn_norm", "attn", "mlp_norm", "mlp"},
    "attn": {"Wqkv", "Wo", "out_drop"},
    "mlp": {"Wi", "act", "drop", "Wo"},
}
"""The child modules of ModernBERT's ``ModernBertEncoderLayer``."""

SUBSET_ATTENTION = ("sdpa", "eager")
"""ModernBERT attention implementations whose masks carry the sliding window (4-d, one row per query)."""


def _modeling(module: nn.Module) -> object:
    """The transformers modeling module that defines ``module``'s class (its own helper functions)."""
    return sys.modules[type(module).__module__]


def _no_query_states(call: dict) -> None:
    if call.get("query_states") is not None:
        raise SparseTrainingError("the last DeBERTa block got query_states (the enhanced mask decoder's call): the "
                                  "sparse last block is for the encoder's own forward; train with block=False")


def _relative_positions(att: nn.Module, call: dict, hidden: torch.Tensor) -> torch.Tensor:
    """``relative_pos`` as the attention reads it: (1 or B, 1 or heads, T, T) long (built as DeBERTa builds it
    when the encoder passed None)."""
    relative = call.get("relative_pos")
    if relative is None:
        build = _modeling(att).build_relative_position
        if hasattr(att, "position_buckets"):  # DeBERTa-v2: log buckets
            relative = build(hidden, hidden, bucket_size=att.position_buckets, max_position=att.max_relative_positions)
        else:
            relative = build(hidden, hidden)
    if relative.dim() == 2:
        relative = relative[None, None]
    elif relative.dim() == 3:
        relative = relative[:, None]
    elif relative.dim() != 4:
        raise SparseTrainingError(f"relative_pos has {relative.dim()} dimensions; DeBERTa reads 2, 3 or 4")
    return relative.to(device=hidden.device, dtype=torch.long)


def _query_columns(positions: torch.Tensor, index: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From (1 or B, 1 or heads, T, T) relative-position indices: the selected queries' rows (B, heads, n, T)
    (``c2p``: query i against key j) and columns (B, heads, T, n) (``p2c``: key j against query i)."""
    batch, n = index.shape
    length = positions.shape[-1]
    full = positions.expand(batch, heads, length, length)
    rows = full.gather(2, index[:, None, :, None].expand(-1, heads, -1, length))
    columns = full.gather(3, index[:, None, None, :].expand(-1, heads, length, -1))
    return rows, columns


def _disentangled_bias(query: torch.Tensor, key: torch.Tensor, pos_key: torch.Tensor | None,
                       pos_query: torch.Tensor | None, relative: torch.Tensor, index: torch.Tensor, span: int,
                       scale: torch.Tensor | None) -> torch.Tensor:
    """DeBERTa's c2p + p2c scores of the selected queries (B, heads, n, d) over every key (B, heads, T, d) ->
    (B, heads, n, T). ``pos_key``/``pos_query``: (1, heads, 2 * span, d) or None (term off); ``scale``: the
    divisor of each term (DeBERTa-v2), None when the inputs are already scaled (DeBERTa v1)."""
    rows, columns = _query_columns(relative, index, query.shape[1])
    score = torch.zeros((), dtype=query.dtype, device=query.device)
    if pos_key is not None:  # content -> position: row i at relative_pos[i, j]
        c2p = torch.matmul(query, pos_key.transpose(-1, -2))
        c2p = c2p.gather(-1, torch.clamp(rows + span, 0, span * 2 - 1))
        score = score + (c2p if scale is None else c2p / scale.to(dtype=c2p.dtype))
    if pos_query is not None:  # position -> content: key j against the position query at -relative_pos[j, i]
        p2c = torch.matmul(key, pos_query.transpose(-1, -2).to(dtype=key.dtype))
        p2c = p2c.gather(-1, torch.clamp(-columns + span, 0, span * 2 - 1)).transpose(-1, -2)
        score = score + (p2c if scale is None else p2c / scale.to(dtype=p2c.dtype))
    return score


def _attention_probabilities(scores: torch.Tensor, call: dict, index: torch.Tensor) -> torch.Tensor:
    """DeBERTa's masking of the selected rows: ``masked_fill`` of the blocked keys with the dtype's minimum."""
    mask = mask_rows(call["attention_mask"], index)
    scores = scores.masked_fill(~mask.bool(), torch.finfo(scores.dtype).min)
    return F.softmax(scores, dim=-1)


def _deberta_tail(block: nn.Module, context: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(B, heads, n, d) context -> the block's output at the selected rows: attention output, intermediate, output."""
    context = context.transpose(1, 2).reshape(context.shape[0], context.shape[2], -1)
    attention = block.attention.output(context, rows)
    return block.output(block.intermediate(attention), attention)


def _refuse_first_layer_conv(block: nn.Module) -> None:
    config = block.attention.config
    if getattr(config, "conv_kernel_size", 0) > 0 and config.num_hidden_layers == 1:
        raise SparseTrainingError("DeBERTa-v2 applies its convolution (ConvLayer) after the first layer, which is the "
                                  "last one in a one-layer model: the sparse last block would leave it out; train "
                                  "with block=False")


def deberta_v2_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """DeBERTa-v2/v3's ``DebertaV2Layer``: ``query_proj`` at the selected rows, ``key_proj``/``value_proj``
    everywhere, the disentangled c2p/p2c terms with log-bucketed relative positions (``share_att_key``: the
    relative embeddings through ``query_proj``/``key_proj``), each term divided by sqrt(d * factors)."""
    _check_layout(block, DEBERTA_V2_LAYOUT_MODULES, "DeBERTa-v2's")
    _no_query_states(call)
    _refuse_first_layer_conv(block)
    hidden = call["hidden_states"]
    att = block.attention.self
    d, rows = att.attention_head_size, select_rows(hidden, index)
    query = split_heads(att.query_proj(rows), d)
    key, value = split_heads(att.key_proj(hidden), d), split_heads(att.value_proj(hidden), d)
    factor = 1 + ("c2p" in att.pos_att_type) + ("p2c" in att.pos_att_type)
    scale = _modeling(att).scaled_size_sqrt(query, factor)
    scores = torch.matmul(query, key.transpose(-1, -2) / scale.to(dtype=query.dtype))
    if att.relative_attention:
        span = att.pos_ebd_size
        rel = att.pos_dropout(call["rel_embeddings"])[: span * 2].unsqueeze(0)
        shared = att.share_att_key
        pos_key = pos_query = None
        if "c2p" in att.pos_att_type:
            pos_key = split_heads((att.key_proj if shared else att.pos_key_proj)(rel), d)
        if "p2c" in att.pos_att_type:
            pos_query = split_heads((att.query_proj if shared else att.pos_query_proj)(rel), d)
        relative = _relative_positions(att, call, hidden)
        scores = scores + _disentangled_bias(query, key, pos_key, pos_query, relative, index, span, scale)
    probs = att.dropout(_attention_probabilities(scores, call, index))
    return _deberta_tail(block, torch.matmul(probs, value), rows)


def _in_proj_parts(att: nn.Module) -> list[torch.Tensor]:
    """DeBERTa's ``in_proj`` weight as its (q, k, v) weights, rows interleaved per head as DeBERTa splits them."""
    if att.in_proj.bias is not None or type(att.in_proj) is not nn.Linear:
        raise SparseTrainingError(f"DeBERTa's in_proj is a {type(att.in_proj).__name__} with bias "
                                  f"{att.in_proj.bias is not None}; the sparse last block reads a bias-free "
                                  "nn.Linear: train with block=False")
    heads = att.num_attention_heads
    pieces = att.in_proj.weight.chunk(heads * 3, dim=0)
    return [torch.cat([pieces[i * 3 + k] for i in range(heads)], dim=0) for k in range(3)]


def deberta_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """DeBERTa (v1)'s ``DebertaLayer``: the query rows of the fused ``in_proj`` at the selected positions (split
    as DeBERTa's own ``query_states`` path splits it), ``q_bias``/``v_bias``, the query scaled before the scores,
    c2p (``pos_proj``) and p2c (``pos_q_proj``, scaled) over the span min(T, max_relative_positions), talking
    heads when configured."""
    _check_layout(block, DEBERTA_LAYOUT_MODULES, "DeBERTa's")
    _no_query_states(call)
    hidden = call["hidden_states"]
    att = block.attention.self
    d, rows = att.attention_head_size, select_rows(hidden, index)
    w_query, w_key, w_value = _in_proj_parts(att)
    query = split_heads(F.linear(rows, w_query) + att.q_bias, d)
    key = split_heads(F.linear(hidden, w_key), d)
    value = split_heads(F.linear(hidden, w_value) + att.v_bias, d)
    factor = 1 + len(att.pos_att_type)
    modeling = _modeling(att)
    query = query / modeling.scaled_size_sqrt(query, factor).to(dtype=query.dtype)
    scores = torch.matmul(query, key.transpose(-1, -2))
    relative = call.get("relative_pos")
    if att.relative_attention and call.get("rel_embeddings") is not None and relative is not None:
        span = int(min(hidden.shape[1], att.max_relative_positions))  # compute_attention_span at T queries
        rel = att.pos_dropout(call["rel_embeddings"])
        rel = rel[att.max_relative_positions - span: att.max_relative_positions + span].unsqueeze(0)
        pos_key = split_heads(att.pos_proj(rel), d) if "c2p" in att.pos_att_type else None
        pos_query = None
        if "p2c" in att.pos_att_type:
            pos_query = split_heads(att.pos_q_proj(rel), d)
            pos_query = pos_query / modeling.scaled_size_sqrt(pos_query, factor)
        relative = _relative_positions(att, call, hidden)
        scores = scores + _disentangled_bias(query, key, pos_key, pos_query, relative, index, span, None)
    if att.head_logits_proj is not None:  # talking heads: a per-(query, key) map across heads
        scores = att.head_logits_proj(scores.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
    probs = att.dropout(_attention_probabilities(scores, call, index))
    if att.head_weights_proj is not None:
        probs = att.head_weights_proj(probs.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
    return _deberta_tail(block, torch.matmul(probs, value), rows)


def _fused_projection(linear: nn.Module, x: torch.Tensor, part: slice, parts: int) -> torch.Tensor:
    """The output rows ``part`` (in units of 1/``parts`` of the outputs) of a fused projection at ``x``: only
    those rows' weights for a plain ``nn.Linear``; any other module (a wrapper adding its own term) is called
    whole and its output cut, which computes what its forward computes."""
    if type(linear) is not nn.Linear or linear._forward_hooks or linear._forward_pre_hooks:
        out = linear(x)
        width = out.shape[-1] // parts
        return out.narrow(-1, part.start * width, (part.stop - part.start) * width)
    width = linear.out_features // parts
    rows = slice(part.start * width, part.stop * width)
    bias = None if linear.bias is None else linear.bias[rows]
    return F.linear(x, linear.weight[rows], bias)


def modernbert_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """ModernBERT's ``ModernBertEncoderLayer``: ``attn_norm`` everywhere (keys and values need it), the query
    rows of ``Wqkv`` at the selected positions and its key/value rows everywhere, rotary positions
    (``position_embeddings`` = (cos, sin) of the layer's type) at the selected rows, the layer type's mask
    (global, or the sliding window) at the selected rows, then ``Wo``, ``out_drop``, ``mlp_norm`` and the
    gated MLP there."""
    _check_layout(block, MODERNBERT_LAYOUT_MODULES, "ModernBERT's")
    att = block.attn
    implementation = att.config._attn_implementation
    if implementation not in SUBSET_ATTENTION:
        raise SparseTrainingError(f"ModernBERT with attn_implementation={implementation!r} takes the sliding window "
                                  "as a kernel argument or block mask, not as mask rows; load the model with "
                                  "attn_implementation='sdpa' (or 'eager') for the sparse last block, or train "
                                  "with block=False")
    hidden = call["hidden_states"]
    normed = block.attn_norm(hidden)
    d, rows, batch = att.head_dim, select_rows(hidden, index), hidden.shape[0]
    query = split_heads(_fused_projection(att.Wqkv, select_rows(normed, index), slice(0, 1), 3), d)
    key, value = _fused_projection(att.Wqkv, normed, slice(1, 3), 3).chunk(2, dim=-1)
    key, value = split_heads(key, d), split_heads(value, d)
    cos, sin = call["position_embeddings"]
    rotate = _modeling(att).apply_rotary_pos_emb
    query = rotate(query, query, select_rows(cos.expand(batch, -1, -1), index),
                   select_rows(sin.expand(batch, -1, -1), index))[0]
    key = rotate(key, key, cos, sin)[1]
    dropout = att.attention_dropout if att.training else 0.0
    context = attend(query, key, value, mask_rows(call.get("attention_mask"), index), d ** -0.5, dropout)
    attention = rows + att.out_drop(att.Wo(context))
    return attention + block.mlp(block.mlp_norm(attention))


__all__ = ["DEBERTA_LAYOUT_MODULES", "DEBERTA_V2_LAYOUT_MODULES", "MODERNBERT_LAYOUT_MODULES", "SUBSET_ATTENTION",
           "deberta_subset", "deberta_v2_subset", "modernbert_subset"]
