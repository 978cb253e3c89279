"""The sparse last block (``subset_block``) of the special block layouts: MobileBERT, Longformer, FNet, XLM/FlauBERT.

Each function has the signature of :mod:`gradflow.adapters.subset` (``(block, call, index) -> (B, n, H)``) and calls
the block's own submodules as its ``forward`` does, with every part that mixes positions at every position:

- **MobileBERT**: the bottleneck feeding the keys (``bottleneck.attention``, or ``bottleneck.input`` when it feeds
  the values too) at every position; the input bottleneck of the residual, the query, the attention output, the
  stacked FFNs, the block's FFN and the output bottleneck at the selected positions;
- **Longformer**: the selected queries over every key with the model's band (``|i - j| <= attention_window / 2``
  in the sequence padded to a window multiple), the padding keys masked and the padding queries' rows zeroed as
  the model does; global attention (a ``global_attention_mask``): the global keys join every local row, and a
  selected global position's row is its ``query_global`` over ``key_global`` and ``value_global`` everywhere;
- **FNet**: the Fourier mixing (over positions and hidden units) at every position, the mixing's output norm and
  the FFN at the selected positions;
- **XLM/FlauBERT** (post-LN): ``call`` is the call of the depth's attention module (``input``, ``mask``), since
  their blocks are views over parallel lists that the model never calls as one module.

In each family a selected position's output reads the other positions only through the keys and values (or the
Fourier mixing), which stay dense, so the loss and every gradient are the dense model's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradflow.adapters.subset import _check_layout, attend, mask_rows, select_rows, split_heads
from gradflow.errors import SparseTrainingError

MOBILEBERT_LAYOUT_MODULES = {
    "": {"attention", "intermediate", "output", "bottleneck", "ffn"},
    "attention": {"self", "output"},
    "attention.self": {"query", "key", "value", "dropout"},
    "attention.output": {"dense", "LayerNorm", "dropout"},
    "output": {"dense", "LayerNorm", "dropout", "bottleneck"},
}
"""The child modules a MobileBERT block may have (``bottleneck`` and ``ffn`` per config)."""


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as an additive one (0 or the dtype's minimum); a float mask as is."""
    if mask.is_floating_point():
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def mobilebert_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """MobileBERT's ``MobileBertLayer`` at the selected positions: every bottleneck layout of its config."""
    bottlenecks = {"bottleneck": {"input", "attention"}} if block.use_bottleneck else {}
    _check_layout(block, {**MOBILEBERT_LAYOUT_MODULES, **bottlenecks}, "MobileBERT's")
    hidden = call["hidden_states"]
    rows = select_rows(hidden, index)
    shared, value, layer_input = hidden, hidden, rows  # no bottleneck: query, key, value and residual = the input
    if block.use_bottleneck:
        bottleneck = block.bottleneck
        if bottleneck.use_bottleneck_attention:  # the input bottleneck feeds query, key, value and the residual
            shared = value = bottleneck.input(hidden)
            layer_input = select_rows(shared, index)
        else:
            layer_input = bottleneck.input(rows)
            if bottleneck.key_query_shared_bottleneck:  # a second bottleneck feeds the query and the key
                shared = bottleneck.attention(hidden)
    att = block.attention.self
    d = att.attention_head_size  # of true_hidden_size (the bottleneck's width)
    query = split_heads(att.query(select_rows(shared, index)), d)
    key, value = split_heads(att.key(shared), d), split_heads(att.value(value), d)
    dropout = att.dropout.p if att.training else 0.0
    context = attend(query, key, value, mask_rows(call.get("attention_mask"), index), att.scaling, dropout)
    attention = block.attention.output(context, layer_input)
    for ffn in getattr(block, "ffn", ()) if block.num_feedforward_networks > 1 else ():
        attention = ffn(attention)
    return block.output(block.intermediate(attention), attention, rows)


LONGFORMER_LAYOUT_MODULES = {
    "": {"attention", "intermediate", "output"},
    "attention": {"self", "output"},
    "attention.self": {"query", "key", "value", "query_global", "key_global", "value_global"},
    "attention.output": {"dense", "LayerNorm", "dropout"},
    "output": {"dense", "LayerNorm", "dropout"},
}
"""The child modules of Longformer's ``LongformerLayer``."""


def _longformer_context(att: nn.Module, hidden: torch.Tensor, call: dict, index: torch.Tensor) -> torch.Tensor:
    """The selected rows of ``LongformerSelfAttention`` -> (B, n, H). ``call["attention_mask"]`` (B, T): 0 local,
    negative padding, positive global (the model's own encoding); T is already a multiple of the window."""
    mask = call["attention_mask"]
    if mask.dim() != 2 or not mask.is_floating_point():
        raise SparseTrainingError(f"Longformer's last block got an attention mask of shape {tuple(mask.shape)} and "
                                  f"dtype {mask.dtype}, not the (B, T) float mask its encoder builds: train with "
                                  "block=False")
    d = att.head_dim
    rows = select_rows(hidden, index)
    query = split_heads(att.query(rows), d)
    key, value = split_heads(att.key(hidden), d), split_heads(att.value(hidden), d)
    positions = torch.arange(hidden.shape[1], device=hidden.device)
    band = (positions[None, None, :] - index[:, :, None]).abs() <= att.one_sided_attn_window_size  # (B, n, T)
    minimum = torch.finfo(query.dtype).min
    removed = torch.where(mask != 0, minimum, 0.0).to(query.dtype)[:, None, :]  # padding and global keys: out of band
    bias = torch.where(band, removed, -torch.inf)
    is_global = call["is_index_global_attn"]
    if call["is_global_attn"]:  # every row also attends the global keys (with the local key and value)
        bias = torch.where(is_global[:, None, :], 0.0, bias)
    dropout = att.dropout if att.training else 0.0
    context = attend(query, key, value, bias[:, None], d ** -0.5, dropout)
    context = context.masked_fill(select_rows(call["is_index_masked"], index)[..., None], 0.0)
    selected_global = select_rows(is_global, index)
    if not bool(selected_global.any()):
        return context
    # a global position's row: its query_global over key_global and value_global at every non-padding position
    global_query = split_heads(att.query_global(rows), d)
    global_key, global_value = split_heads(att.key_global(hidden), d), split_heads(att.value_global(hidden), d)
    padding = torch.where(call["is_index_masked"], minimum, 0.0).to(query.dtype)[:, None, None, :]
    global_context = attend(global_query, global_key, global_value, padding, d ** -0.5, dropout)
    return torch.where(selected_global[..., None], global_context, context)


def longformer_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """Longformer's ``LongformerLayer`` at the selected positions (sliding-window and global attention). The n
    selected queries' scores are taken against all T keys and masked to the band: n * T products per head where the
    dense band takes T * (attention_window + 1), fewer while n <= attention_window."""
    _check_layout(block, LONGFORMER_LAYOUT_MODULES, "Longformer's")
    hidden = call["hidden_states"]
    context = _longformer_context(block.attention.self, hidden, call, index)
    attention = block.attention.output(context, select_rows(hidden, index))
    return block.ff_chunk(attention)


FNET_LAYOUT_MODULES = {
    "": {"fourier", "intermediate", "output"},
    "fourier": {"self", "output"},
    "fourier.output": {"LayerNorm"},
    "output": {"dense", "LayerNorm", "dropout"},
}
"""The child modules of FNet's ``FNetLayer`` (the mixing ``fourier.self`` has no parameters)."""


def fnet_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """FNet's ``FNetLayer``: the Fourier mixing at every position (it mixes them all), its output norm and the FFN
    at the selected positions."""
    _check_layout(block, FNET_LAYOUT_MODULES, "FNet's")
    hidden = call["hidden_states"]
    mixed = block.fourier.self(hidden)[0]
    mixing = block.fourier.output(select_rows(mixed, index), select_rows(hidden, index))
    return block.feed_forward_chunk(mixing)


XLM_LAYOUT_MODULES = {
    "": {"attentions", "layer_norm1", "ffns", "layer_norm2"},
    "attentions": {"q_lin", "k_lin", "v_lin", "out_lin"},
    "ffns": {"lin1", "lin2", "act"},
}
"""The parts of one XLM/FlauBERT depth (a view over the model's parallel lists)."""


def xlm_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """One XLM/FlauBERT depth (post-LN) at the selected positions. ``call``: the arguments of the depth's
    ``attentions`` call (``input`` (B, T, H), ``mask`` (B, T): 0 at padding), not of the block (never called).

    The model multiplies each depth's output by its padding mask, the attention's ``mask`` for an encoder."""
    _check_layout(block, XLM_LAYOUT_MODULES, "XLM's")
    att = block.attentions
    cache = call.get("cache")  # the model always passes one; the keys of earlier calls would join this call's
    if call.get("kv") is not None or (cache is not None and cache.get_seq_length(att.layer_id) > 0):
        raise SparseTrainingError("XLM's last attention got cached keys or encoder states (kv): the sparse last "
                                  "block is for a masked LM's encoder; train with block=False")
    mask = call["mask"]
    if mask.dim() != 2:
        raise SparseTrainingError(f"XLM's last attention got a mask of shape {tuple(mask.shape)} (a causal model): "
                                  "the sparse last block is for masked LMs (causal=False); train with block=False")
    hidden = call["input"]
    d = att.head_dim
    rows = select_rows(hidden, index)
    query = split_heads(att.q_lin(rows), d)
    key, value = split_heads(att.k_lin(hidden), d), split_heads(att.v_lin(hidden), d)
    bias = _additive(mask != 0, query.dtype)[:, None, None, :]
    context = attend(query, key, value, bias, d ** -0.5, att.dropout if att.training else 0.0)
    ffn = block.ffns
    attention = F.dropout(att.out_lin(context), p=ffn.dropout, training=ffn.training)  # the model's dropout
    tensor = block.layer_norm1(rows + attention)
    tensor = block.layer_norm2(tensor + ffn(tensor))
    return tensor * select_rows(mask, index)[..., None].to(tensor.dtype)


__all__ = ["FNET_LAYOUT_MODULES", "LONGFORMER_LAYOUT_MODULES", "MOBILEBERT_LAYOUT_MODULES", "XLM_LAYOUT_MODULES",
           "fnet_subset", "longformer_subset", "mobilebert_subset", "xlm_subset"]
