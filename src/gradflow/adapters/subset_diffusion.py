"""The last block of the masked diffusion LMs with remote code (LLaDA, Dream) at a subset of query positions.

The functions follow :mod:`gradflow.adapters.subset`'s contract, ``(block, call, index) -> (B, n, H)``:
keys and values at every position, the query, the attention output and the FFN (with its norm) at the
selected positions only. Both blocks are Llama-style pre-norm blocks with rotary positions and
bidirectional attention, under their own names and call signatures:

- LLaDA's ``LLaDALlamaBlock.forward(x, attention_bias, layer_past, use_cache)``: ``attn_norm``,
  ``q_proj``/``k_proj``/``v_proj``, rotary positions by the block's ``rotary_emb(q, k)`` (which computes its
  table from the sequence length: the table is read from it with a probe, see :func:`llada_rotary_table`),
  ``attn_out``, ``ff_norm``, ``ff_out(act(ff_proj(x)) * up_proj(x))``; the additive ``attention_bias``
  (B or 1, 1, 1 or T, T) the model builds from the attention mask;
- Dream's ``DreamDecoderLayer.forward(hidden_states, attention_mask, position_ids, position_embeddings)``:
  Qwen2's block (``self_attn.{q,k,v}_proj`` with biases, ``o_proj``, grouped-query attention) with the
  (B, 1, T, T) boolean mask (or ``"full"``) that ``DreamModel.forward`` builds, and rotary (cos, sin) tables.

The sparse trainer reaches the block call through the whole model's forward (``Adapter.run_whole_model``):
LLaDA's base model applies ``ln_f`` and the output layer itself, Dream's needs the mask the whole model builds.
"""

from __future__ import annotations

import torch
from torch import nn

from gradflow.adapters.base import get_module
from gradflow.adapters.subset import attend, mask_rows, select_rows, split_heads
from gradflow.errors import SparseTrainingError

LLADA_LAYOUT_MODULES = {
    "": {"attn_norm", "q_proj", "k_proj", "v_proj", "attn_out", "ff_norm", "ff_proj", "up_proj", "ff_out",
         "rotary_emb", "act", "dropout"},
}
"""The child modules of LLaDA's Llama block (``attention_layer_norm``'s ``q_norm``/``k_norm`` are refused)."""

DREAM_LAYOUT_MODULES = {
    "": {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"},
    "self_attn": {"q_proj", "k_proj", "v_proj", "o_proj", "rotary_emb"},
}
"""The child modules of Dream's Qwen2 decoder layer."""


def check_layout(block: nn.Module, layout: dict[str, set[str]], name: str) -> None:
    """Refuse a block with modules beyond ``layout`` (by parent path), which the sparse block would leave out. (The
    head alone is no way out here, unlike :mod:`gradflow.adapters.subset`'s check: these base models give no last
    hidden state.)"""
    for parent, allowed in layout.items():
        extra = sorted({child for child, _ in get_module(block, parent).named_children()} - allowed)
        if extra:
            names = ", ".join(f"{parent}.{e}" if parent else e for e in extra)
            raise SparseTrainingError(f"the last block ({type(block).__name__}) has {names} beyond {name} layout, "
                                      "which the sparse last block would leave out: not implemented for this variant; "
                                      "train densely")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., d) -> cat(-x2, x1): the rotary convention of Llama, LLaDA and Dream."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def llada_rotary_table(rotary: nn.Module, length: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), (T, d) each, of LLaDA's ``rotary_emb(q, k)`` over ``length`` positions, read with one call: the
    query probe [1 | 0] rotates to [cos | sin] (the two halves of each table are equal); the key probe (seeded
    random numbers) must rotate to ``k cos + rotate_half(k) sin`` with them, which checks the rotate-half form this
    module reproduces (refused otherwise)."""
    d = like.shape[-1]
    half = (torch.arange(d, device=like.device) < d // 2).to(like.dtype)
    probe_q = half.expand(1, 1, length, d).contiguous()
    gen = torch.Generator().manual_seed(0)
    probe_k = torch.randn(1, 1, length, d, generator=gen).to(device=like.device, dtype=like.dtype)
    with torch.no_grad():
        q, k = rotary(probe_q, probe_k)
    cos, sin = (torch.cat((t, t), dim=-1) for t in (q[0, 0, :, : d // 2], q[0, 0, :, d // 2:]))
    want = probe_k * cos + rotate_half(probe_k) * sin
    if q.shape != probe_q.shape or not torch.allclose(k, want, rtol=1e-5, atol=1e-6):
        raise SparseTrainingError("the last block's rotary_emb is not the rotate-half rotation the sparse LLaDA block "
                                  "reproduces: not implemented for this variant; train densely")
    return cos.to(like.dtype), sin.to(like.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, n, d) rotated by cos, sin (B or 1, n, d)."""
    cos, sin = cos[:, None], sin[:, None]
    return ((x * cos) + (rotate_half(x) * sin)).to(x.dtype)


def _gqa(key: torch.Tensor, value: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    groups = heads // key.shape[1]
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)


def llada_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """LLaDA's ``LLaDALlamaBlock`` at the selected queries: ``attn_norm`` at every position (keys and values need
    it), rotary positions at the selected rows, grouped-query attention, the FFN at the selected rows."""
    check_layout(block, LLADA_LAYOUT_MODULES, "LLaDA's Llama-block")
    if call.get("layer_past") is not None or call.get("use_cache"):
        raise SparseTrainingError("the last LLaDA block got a key/value cache: the sparse last block is for training")
    config = block.config
    if getattr(config, "block_type", "llama") != "llama":
        raise SparseTrainingError(f"LLaDA's block_type={config.block_type!r}: the sparse last block implements the "
                                  "llama block only; train densely")
    x = call["x"]
    heads = config.n_heads
    d = config.d_model // heads
    normed = block.attn_norm(x)
    query = split_heads(block.q_proj(select_rows(normed, index)), d)
    key, value = split_heads(block.k_proj(normed), d), split_heads(block.v_proj(normed), d)
    clip = getattr(config, "clip_qkv", None)
    if clip is not None:
        query, key, value = (t.clamp(min=-clip, max=clip) for t in (query, key, value))
    if getattr(config, "rope", True):
        cos, sin = llada_rotary_table(block.rotary_emb, x.shape[1], query)
        batch = x.shape[0]
        query = _rotate(query, select_rows(cos.expand(batch, -1, -1), index), select_rows(sin.expand(batch, -1, -1),
                                                                                            index))
        key = _rotate(key, cos[None], sin[None])
    key, value = _gqa(key, value, heads)
    dropout = getattr(config, "attention_dropout", 0.0) if block.training else 0.0
    context = attend(query, key, value, mask_rows(call.get("attention_bias"), index), d ** -0.5, dropout)
    h = select_rows(x, index) + block.dropout(block.attn_out(context))
    normed = block.ff_norm(h)
    return h + block.dropout(block.ff_out(block.act(block.ff_proj(normed)) * block.up_proj(normed)))


def dream_subset(block: nn.Module, call: dict, index: torch.Tensor) -> torch.Tensor:
    """Dream's ``DreamDecoderLayer`` (Qwen2 with bidirectional attention) at the selected queries:
    ``input_layernorm`` at every position, rotary (cos, sin) rows of the selected queries, q/k/v biases,
    grouped-query attention under the boolean mask rows (``"full"``: no mask), the MLP at the selected rows."""
    check_layout(block, DREAM_LAYOUT_MODULES, "Dream's Qwen2-layer")
    hidden = call["hidden_states"]
    att = block.self_attn
    d = att.head_dim
    normed = block.input_layernorm(hidden)
    query = split_heads(att.q_proj(select_rows(normed, index)), d)
    key, value = split_heads(att.k_proj(normed), d), split_heads(att.v_proj(normed), d)
    cos, sin = call["position_embeddings"]
    batch = hidden.shape[0]
    query = _rotate(query, select_rows(cos.expand(batch, -1, -1), index), select_rows(sin.expand(batch, -1, -1), index))
    key = _rotate(key, cos, sin)
    key, value = _gqa(key, value, att.num_heads)
    mask = call.get("attention_mask")
    mask = mask_rows(mask, index) if isinstance(mask, torch.Tensor) else None
    dropout = att.attention_dropout if att.training else 0.0
    h = select_rows(hidden, index) + att.o_proj(attend(query, key, value, mask, d ** -0.5, dropout))
    return h + block.mlp(block.post_attention_layernorm(h))


__all__ = ["DREAM_LAYOUT_MODULES", "LLADA_LAYOUT_MODULES", "check_layout", "dream_subset", "llada_rotary_table",
           "llada_subset", "rotate_half"]
