"""A tiny imitation of LLaDA's remote-code model (GSAI-ML/LLaDA-8B-Base, modeling_llada.py), for gradflow's tests.

The module tree and call pattern are LLaDA's (``block_type="llama"``, ``activation_type="silu"``):

- ``LLaDAModelLM`` (a ``PreTrainedModel``, ``base_model_prefix = "model"``) holds ``model``: ``LLaDAModel``, a plain
  ``nn.Module`` whose ``transformer`` is an ``nn.ModuleDict`` of ``wte`` (embedding), ``emb_drop``, ``ln_f`` (the
  final RMS norm), ``blocks`` (a ``ModuleList`` of ``LLaDALlamaBlock``) and ``ff_out`` (the output Linear, absent
  when ``weight_tying``). ``LLaDAModel.forward`` runs the blocks, ``ln_f`` and the head itself and returns
  ``LLaDAOutput(logits, attn_key_values, hidden_states)``: the base model returns logits, no hidden state;
- ``LLaDALlamaBlock``: ``x_normed = attn_norm(x)``; ``q_proj``, ``k_proj``, ``v_proj``; rotary positions;
  bidirectional scaled-dot-product attention (``is_causal=False``); ``attn_out``; residual; ``ff_norm``;
  ``act(ff_proj(x)) * up_proj(x)``; ``ff_out``; residual; the block returns ``(x, cache)``;
- ``RMSLayerNorm``: ``weight * x / rms(x)`` computed in float32.

Simplifications (test code, not LLaDA's): no KV cache, no activation checkpointing, no alibi or flash attention;
the attention mask becomes an additive key-padding bias (B, 1, 1, T), bidirectional.
"""

from __future__ import annotations

import math
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_llada import LLaDAConfig, mark_ran

mark_ran("modeling_llada imported")


class RMSLayerNorm(nn.Module):
    def __init__(self, config: LLaDAConfig):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.weight = nn.Parameter(torch.ones(config.d_model))
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        og_dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(og_dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: LLaDAConfig):
        super().__init__()
        self.dim = config.d_model // config.n_heads
        self.theta = config.rope_theta

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq_len = q.shape[-2]
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, device=q.device, dtype=torch.float) / self.dim))
        freqs = torch.outer(torch.arange(seq_len, device=q.device, dtype=torch.float), inv_freq)
        positions = torch.cat((freqs, freqs), dim=-1)
        sin, cos = positions.sin()[None, None], positions.cos()[None, None]

        def rotate(t: torch.Tensor) -> torch.Tensor:
            x1, x2 = t.chunk(2, dim=-1)
            return ((t * cos) + (torch.cat((-x2, x1), dim=-1) * sin)).to(t.dtype)

        return rotate(q), rotate(k)


class LLaDALlamaBlock(nn.Module):
    def __init__(self, layer_id: int, config: LLaDAConfig):
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        head_dim = config.d_model // config.n_heads
        kv_dim = config.effective_n_kv_heads * head_dim
        qkv_bias = config.include_bias | config.include_qkv_bias
        self.dropout = nn.Dropout(0.0)
        self.act = nn.SiLU()
        self.attn_out = nn.Linear(config.d_model, config.d_model, bias=config.include_bias)
        self.ff_out = nn.Linear(config.mlp_hidden_size, config.d_model, bias=config.include_bias)
        self.rotary_emb = RotaryEmbedding(config)
        self.attn_norm = RMSLayerNorm(config)
        self.ff_norm = RMSLayerNorm(config)
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=qkv_bias)
        self.k_proj = nn.Linear(config.d_model, kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.d_model, kv_dim, bias=qkv_bias)
        self.ff_proj = nn.Linear(config.d_model, config.mlp_hidden_size, bias=config.include_bias)
        self.up_proj = nn.Linear(config.d_model, config.mlp_hidden_size, bias=config.include_bias)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  attention_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        b, t, c = q.shape
        heads, kv_heads = self.config.n_heads, self.config.effective_n_kv_heads
        q = q.view(b, t, heads, c // heads).transpose(1, 2)
        k = k.view(b, t, kv_heads, c // heads).transpose(1, 2)
        v = v.view(b, t, kv_heads, c // heads).transpose(1, 2)
        q, k = self.rotary_emb(q, k)
        if heads != kv_heads:
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
        # LLaDA: "MDM set causal to False"
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_bias, is_causal=False)
        return self.attn_out(att.transpose(1, 2).contiguous().view(b, t, c)), None

    def forward(self, x: torch.Tensor, attention_bias: torch.Tensor | None = None, layer_past=None,
                use_cache: bool = False) -> tuple[torch.Tensor, None]:
        x_normed = self.attn_norm(x)
        q = self.q_proj(x_normed)
        k = self.k_proj(x_normed)
        v = self.v_proj(x_normed)
        att, cache = self.attention(q, k, v, attention_bias)
        x = x + self.dropout(att)
        og_x = x
        x = self.ff_norm(x)
        x, x_up = self.ff_proj(x), self.up_proj(x)
        x = self.act(x)
        x = x * x_up
        x = self.ff_out(x)
        x = self.dropout(x)
        return og_x + x, cache


class LLaDAOutput(NamedTuple):
    logits: torch.FloatTensor
    attn_key_values: list | None
    hidden_states: tuple | None


class LLaDAModel(nn.Module):
    def __init__(self, config: LLaDAConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.embedding_size or config.vocab_size, config.d_model),
            "emb_drop": nn.Dropout(0.0),
            "ln_f": RMSLayerNorm(config),
        })
        self.transformer.update({"blocks": nn.ModuleList(LLaDALlamaBlock(i, config) for i in range(config.n_layers))})
        if not config.weight_tying:
            self.transformer.update({"ff_out": nn.Linear(config.d_model, config.embedding_size or config.vocab_size,
                                                         bias=config.include_bias)})

    def forward(self, input_ids: torch.LongTensor, input_embeddings: torch.FloatTensor | None = None,
                attention_mask: torch.Tensor | None = None, attention_bias: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False, last_logits_only: bool = False,
                output_hidden_states: bool | None = None) -> LLaDAOutput:
        assert past_key_values is None and not use_cache, "The kvcache is not suppotred for MDM."
        x = self.transformer.wte(input_ids) if input_embeddings is None else input_embeddings
        if self.config.input_emb_norm:
            x = x * (self.config.d_model ** 0.5)
        x = self.transformer.emb_drop(x)
        if attention_mask is not None and attention_bias is None:
            mask = attention_mask.to(dtype=x.dtype).view(x.shape[0], -1)[:, None, None, :]
            attention_bias = (1.0 - mask) * torch.finfo(x.dtype).min
        all_hidden_states = []
        for block in self.transformer.blocks:
            if output_hidden_states:
                all_hidden_states.append(x)
            x, _ = block(x, attention_bias=attention_bias)
        if last_logits_only:
            x = x[:, -1, :].unsqueeze(1)
        x = self.transformer.ln_f(x)
        if output_hidden_states:
            all_hidden_states.append(x)
        if self.config.weight_tying:
            logits = F.linear(x, self.transformer.wte.weight, None)
        else:
            logits = self.transformer.ff_out(x)
        if self.config.scale_logits:
            logits = logits * (1 / math.sqrt(self.config.d_model))
        return LLaDAOutput(logits=logits, attn_key_values=None,
                           hidden_states=tuple(all_hidden_states) if output_hidden_states else None)


class LLaDAModelLM(PreTrainedModel):
    config_class = LLaDAConfig
    base_model_prefix = "model"
    _no_split_modules: ClassVar[list[str]] = ["LLaDALlamaBlock"]

    def __init__(self, config: LLaDAConfig, model: LLaDAModel | None = None):
        super().__init__(config)
        mark_ran("LLaDAModelLM.__init__")
        self.model = model or LLaDAModel(config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, RMSLayerNorm):
            nn.init.ones_(module.weight)

    def forward(self, input_ids: torch.LongTensor = None, inputs_embeds: torch.FloatTensor | None = None,
                attention_mask: torch.Tensor | None = None, attention_bias: torch.Tensor | None = None,
                past_key_values=None, labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, **kwargs) -> CausalLMOutputWithPast:
        if output_attentions:
            raise ValueError("output_attentions is not yet supported in LLaDA")
        outputs = self.model.forward(input_ids=input_ids, input_embeddings=inputs_embeds,
                                     attention_mask=attention_mask, attention_bias=attention_bias,
                                     output_hidden_states=output_hidden_states)
        if labels is not None:
            import warnings
            warnings.warn("Note that for LLaDA, you cannot calculate the loss here.", UserWarning)
        return CausalLMOutputWithPast(logits=outputs.logits, hidden_states=outputs.hidden_states)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.transformer.wte

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.transformer.wte = value

    def get_output_embeddings(self) -> nn.Module:
        return self.model.transformer.wte if self.config.weight_tying else self.model.transformer.ff_out
