"""The last block run with queries at a subset of positions: the adapters' ``subset_block`` functions.

Sparse MLM training (:mod:`gradflow.training`) runs the last block only where the loss is: keys and
values at every position (a selected query still attends to every position), the query, the
attention output, the FFN and the norms after attention at the selected positions only. In the
last block nothing else depends on the other positions' outputs, so the loss and every gradient
are the dense model's.

A subset function is ``(block, call, index) -> (B, n, H)``: ``call`` holds the arguments of the
block's own call by name (``hidden_states`` (B, T, H), ``attention_mask`` as the encoder built it:
None, or (B or 1, 1 or heads, T or 1, T), additive float or boolean (True: attend), and extras such
as RoFormer's ``sinusoidal_pos``); ``index`` (B, n) long: the positions of each row to compute
(rows with fewer positions repeat one, the caller drops the copies). The functions call the
block's own submodules (projections, output sublayers with their dropout and norms, FFN), so a
block computes what its ``forward`` computes at those positions.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gradflow.adapters.base import get_module
from gradflow.errors import SparseTrainingError

SubsetBlock = Callable[[nn.Module, dict, torch.Tensor], torch.Tensor]


def select_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` (B, T, ...) at ``index`` (B, n) of each row -> (B, n, ...)."""
    shape = (*index.shape, *([1] * (x.dim() - 2)))
    return x.gather(1, index.view(shape).expand(-1, -1, *x.shape[2:]))


def mask_rows(mask: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    """The rows of a 4-d attention mask that the selected queries use: (B, 1 or heads, n, T)."""
    if mask is None or mask.shape[-2] == 1:
        return mask
    if mask.dim() != 4:
        raise SparseTrainingError(f"the last block got an attention mask of shape {tuple(mask.shape)}; the sparse "
                                  "last block reads 4-d masks (B, heads, T, T) only: train with block=False")
    mask = mask.expand(index.shape[0], -1, -1, -1)
    rows = index[:, None, :, None].expand(-1, mask.shape[1], -1, mask.shape[-1])
    return mask.gather(2, rows)


def split_heads(x: torch.Tensor, head_size: int) -> torch.Tensor:
    """(B, n, heads * d) -> (B, heads, n, d)."""
    return x.view(*x.shape[:2], -1, head_size).transpose(1, 2)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           scale: float, dropout: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for (B, heads, n, d) queries over (B, heads, T, d) keys -> (B, n, heads * d)."""
    if mask is not None and mask.is_floating_point() and mask.dtype != query.dtype:  # autocast: bfloat16 queries
        mask = mask.to(query.dtype)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


def _no_cross_attention(call: dict) -> None:
    if call.get("encoder_hidden_states") is not None:
        raise SparseTrainingError("the last block attends to encoder states (cross-attention): the sparse last "
                                  "block is for encoder-only masked LMs")


def _rotary(att: nn.Module, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """RoFormer's rotary positions ((1 or B, 1, n, d) sin|cos table) applied to ``x`` (B, heads, n, d)."""
    return att.apply_rotary_position_embeddings(positions, x, x)[0]


BERT_LAYOUT_MODULES = {
    "": {"attention", "intermediate", "output", "ln", "LayerNorm"},
    "attention": {"self", "output", "ln", "LayerNorm", "self_attn_layer_norm"},
    "attention.self": {"query", "key", "value", "dropout"},
    "attention.output": {"dense", "LayerNorm", "dropout"},
    "output": {"dense", "LayerNorm", "dropout"},
}
"""The child modules a BERT-layout block may have (by parent path): anything else (a convolution over
the values, a language adapter after the FFN) is computation :func:`bert_layout` would leave out."""


def check_bert_layout(block: nn.Module) -> None:
    """Refuse a block that has modules beyond the BERT layout's (a variant that reuses the BERT adapter)."""
    _check_layout(block, BERT_LAYOUT_MODULES, "BERT's")


def _check_layout(block: nn.Module, layout: dict[str, set[str]], name: str) -> None:
    for parent, allowed in layout.items():
        extra = sorted({name for name, _ in get_module(block, parent).named_children()} - allowed)
        if extra:
            where = f"{parent}." if parent else ""
            names = ", ".join(where + e for e in extra)
            raise SparseTrainingError(f"the last block ({type(block).__name__}) has {names} "
                                      f"beyond {name} layout, which the sparse last block would leave out: not "
                                      "implemented for this family yet; train with block=False (the sparse head)")


def bert_layout(pre_norm: str | None = None) -> SubsetBlock:
    """The BERT layer layout: ``attention.self.{query,key,value}``, ``attention.output(context, residual)``,
    ``feed_forward_chunk``. ``pre_norm``: path of the norm that feeds Q, K and V (pre-LN variants);
    RoFormer's rotary positions (``sinusoidal_pos``) are applied to the selected queries' rows."""

    def subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
        _no_cross_attention(call)
        hidden = call["hidden_states"]
        check_bert_layout(block)
        att = block.attention.self
        normed = get_module(block, pre_norm)(hidden) if pre_norm else hidden
        d = att.attention_head_size
        query = split_heads(att.query(select_rows(normed, index)), d)
        key, value = split_heads(att.key(normed), d), split_heads(att.value(normed), d)
        rotary = call.get("sinusoidal_pos")
        if rotary is not None:
            query = _rotary(att, select_rows(rotary.expand(hidden.shape[0], -1, -1, -1).transpose(1, 2),
                                             index).transpose(1, 2), query)
            key = _rotary(att, rotary, key)
            if getattr(att, "rotary_value", False):
                value = _rotary(att, rotary, value)
        dropout = att.dropout.p if att.training else 0.0
        context = attend(query, key, value, mask_rows(call.get("attention_mask"), index), d ** -0.5, dropout)
        attention = block.attention.output(context, select_rows(hidden, index))
        return block.feed_forward_chunk(attention)

    return subset


def distilbert_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """DistilBERT's ``TransformerBlock``: ``attention.{q,k,v,out}_lin``, ``sa_layer_norm``, ``ffn``,
    ``output_layer_norm``."""
    hidden = call["hidden_states"]
    att = block.attention
    d = att.attention_head_size
    rows = select_rows(hidden, index)
    query = split_heads(att.q_lin(rows), d)
    key, value = split_heads(att.k_lin(hidden), d), split_heads(att.v_lin(hidden), d)
    dropout = att.dropout.p if att.training else 0.0
    context = attend(query, key, value, mask_rows(call.get("attention_mask"), index), att.scaling, dropout)
    attention = block.sa_layer_norm(att.out_lin(context) + rows)
    return block.output_layer_norm(block.ffn(attention) + attention)


def mpnet_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """MPNet's ``MPNetLayer``: ``attention.attn.{q,k,v,o}`` with the relative-position bias the encoder
    passes (``position_bias``, (B, heads, T, T): the selected queries' rows), ``attention.LayerNorm``, FFN."""
    hidden = call["hidden_states"]
    att = block.attention.attn
    d = att.attention_head_size
    rows = select_rows(hidden, index)
    query = split_heads(att.q(rows), d)
    key, value = split_heads(att.k(hidden), d), split_heads(att.v(hidden), d)
    bias = mask_rows(call.get("position_bias"), index)
    mask = mask_rows(call.get("attention_mask"), index)
    if mask is not None and not mask.is_floating_point():  # a boolean mask (True: attend) as an additive one
        blocked = ~mask
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device)
        mask = mask.masked_fill(blocked, torch.finfo(query.dtype).min)
    bias = mask if bias is None else bias if mask is None else bias + mask
    dropout = att.dropout.p if att.training else 0.0
    context = attend(query, key, value, bias, d ** -0.5, dropout)
    attention = block.attention.LayerNorm(block.attention.dropout(att.o(context)) + rows)
    return block.output(block.intermediate(attention), attention)


def rotary_rows(att: nn.Module, query: torch.Tensor, key: torch.Tensor, position_embeddings: tuple,
                index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary positions (``position_embeddings`` = (cos, sin), (B or 1, T, d)) with the modeling module's own
    ``apply_rotary_pos_emb``: the selected rows for the (B, heads, n, d) queries, every position for the keys."""
    cos, sin = position_embeddings
    rotate = sys.modules[type(att).__module__].apply_rotary_pos_emb
    batch = key.shape[0]
    query = rotate(query, query, select_rows(cos.expand(batch, -1, -1), index),
                   select_rows(sin.expand(batch, -1, -1), index))[0]
    return query, rotate(key, key, cos, sin)[1]


ESM_LAYOUT_MODULES = {
    "": {"attention", "intermediate", "output", "LayerNorm"},
    "attention": {"self", "output", "LayerNorm"},
    "attention.self": {"query", "key", "value"},
}
"""The child modules of ESM's pre-LN block (``attention.LayerNorm`` feeds Q, K and V; ``LayerNorm`` the FFN)."""


def esm_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """ESM's ``EsmLayer``: the attention norm at every position, the query scaled by ``d ** -0.5`` before the
    rotary positions (``position_embeddings`` = (cos, sin)) as ESM does, at the selected queries' rows."""
    _no_cross_attention(call)
    _check_layout(block, ESM_LAYOUT_MODULES, "ESM's")
    hidden = call["hidden_states"]
    att = block.attention.self
    d = att.attention_head_size
    normed = block.attention.LayerNorm(hidden)
    query = split_heads(att.query(select_rows(normed, index)), d) * d ** -0.5
    key, value = split_heads(att.key(normed), d), split_heads(att.value(normed), d)
    if att.position_embedding_type == "rotary":
        query, key = rotary_rows(att, query, key, call["position_embeddings"], index)
    dropout = att.dropout if att.training else 0.0
    context = attend(query, key, value, mask_rows(call.get("attention_mask"), index), att.scaling, dropout)
    attention = block.attention.output(context, select_rows(hidden, index))
    return block.feed_forward_chunk(attention)


LLAMA_LAYOUT_MODULES = {
    "": {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"},
    "self_attn": {"q_proj", "k_proj", "v_proj", "o_proj"},
}
"""The child modules a Llama-style encoder block may have (ESMC's query/key norms are refused)."""


def _rotary_context(att: nn.Module, normed: torch.Tensor, call: dict, index: torch.Tensor) -> torch.Tensor:
    """Attention of the selected queries over every position for ``self_attn.{q,k,v}_proj`` blocks with rotary
    positions (``position_embeddings`` = (cos, sin), (B or 1, T, d), applied with the modeling module's own
    ``apply_rotary_pos_emb``) and grouped-query attention -> (B, n, heads * d), before ``o_proj``."""
    d = att.head_dim
    query = split_heads(att.q_proj(select_rows(normed, index)), d)
    key, value = split_heads(att.k_proj(normed), d), split_heads(att.v_proj(normed), d)
    query, key = rotary_rows(att, query, key, call["position_embeddings"], index)
    groups = getattr(att, "num_key_value_groups", 1)
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    dropout = att.attention_dropout if att.training else 0.0
    return attend(query, key, value, mask_rows(call.get("attention_mask"), index), att.scaling, dropout)


def llama_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """The Llama-style pre-norm block (EuroBERT, UltraBERT): ``input_layernorm`` at every position (keys and
    values need it), rotary positions at the selected queries' rows, grouped-query attention."""
    _check_layout(block, LLAMA_LAYOUT_MODULES, "Llama-style")
    hidden = call["hidden_states"]
    context = _rotary_context(block.self_attn, block.input_layernorm(hidden), call, index)
    attention = select_rows(hidden, index) + block.self_attn.o_proj(context)
    return attention + block.mlp(block.post_attention_layernorm(attention))


GTE_LAYOUT_MODULES = {
    "": {"self_attn", "mlp", "post_attention_layernorm", "post_mlp_layernorm", "post_attention_dropout",
         "post_mlp_dropout"},
    "self_attn": {"q_proj", "k_proj", "v_proj", "o_proj"},
}
"""The child modules of the GTE layout's post-LN block (GTE, NomicBERT, Jina-Embeddings-v3)."""


def gte_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """The GTE layout (post-LN, rotary positions): attention, ``post_attention_layernorm``, MLP,
    ``post_mlp_layernorm``, each with its dropout, at the selected positions."""
    _check_layout(block, GTE_LAYOUT_MODULES, "the GTE")
    hidden = call["hidden_states"]
    context = _rotary_context(block.self_attn, hidden, call, index)
    rows = select_rows(hidden, index)
    attention = block.post_attention_layernorm(rows + block.post_attention_dropout(block.self_attn.o_proj(context)))
    return block.post_mlp_layernorm(attention + block.post_mlp_dropout(block.mlp(attention)))


def albert_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """ALBERT's ``AlbertLayer`` (its last application: the earlier ones run densely, as they must)."""
    hidden = call["hidden_states"]
    att = block.attention
    d = att.attention_head_size
    rows = select_rows(hidden, index)
    query = split_heads(att.query(rows), d)
    key, value = split_heads(att.key(hidden), d), split_heads(att.value(hidden), d)
    dropout = att.attention_dropout.p if att.training else 0.0
    context = attend(query, key, value, mask_rows(call.get("attention_mask"), index), att.scaling, dropout)
    attention = att.LayerNorm(rows + att.output_dropout(att.dense(context)))
    return block.full_layer_layer_norm(block.ff_chunk(attention) + attention)


__all__ = ["BERT_LAYOUT_MODULES", "ESM_LAYOUT_MODULES", "GTE_LAYOUT_MODULES", "LLAMA_LAYOUT_MODULES", "SubsetBlock",
           "albert_subset", "attend", "bert_layout", "check_bert_layout", "distilbert_subset", "esm_subset",
           "gte_subset", "llama_subset", "mask_rows", "mpnet_subset", "rotary_rows", "select_rows", "split_heads"]
