"""A tiny imitation of Dream's remote-code model (Dream-org/Dream-v0-Base-7B, modeling_dream.py), for gradflow's tests.

The module tree and call pattern are Dream's (Qwen2 blocks with bidirectional attention):

- ``DreamModel`` (``base_model_prefix = "model"``) holds ``model``: ``DreamBaseModel`` (``embed_tokens``, ``layers``:
  a ``ModuleList`` of ``DreamDecoderLayer``, ``norm``: the final RMSNorm, ``rotary_emb``) and ``lm_head`` (a
  bias-free Linear). ``DreamModel.forward`` turns a (B, T) attention mask into a (B, 1, T, T) boolean mask (key and
  query both real) or ``"full"`` when nothing is padding, before it calls the base model: the base model takes
  that converted mask, not the (B, T) one. It returns ``MaskedLMOutput(logits)``;
- ``DreamDecoderLayer``: residual; ``input_layernorm``; ``self_attn`` (``q_proj``, ``k_proj``, ``v_proj`` with
  biases, rotary positions, grouped-query attention, SDPA with ``is_causal=False``, ``o_proj`` without bias);
  residual; ``post_attention_layernorm``; ``mlp`` (``down_proj(act(gate_proj(x)) * up_proj(x))``); it returns a
  tuple ``(hidden_states,)``;
- ``DreamRMSNorm``: Qwen2's RMSNorm, ``weight * x / rms(x)`` computed in float32.

Dream is trained with a shifted head: the logits at position i - 1 predict the token at i (its loss shifts the
logits right by one). Simplifications (test code, not Dream's): no KV cache, no generation mixin.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput

from .configuration_dream import DreamConfig, mark_ran

mark_ran("modeling_dream imported")


class DreamRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class DreamRotaryEmbedding(nn.Module):
    def __init__(self, config: DreamConfig):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        self.register_buffer("inv_freq", 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).float() / dim)),
                             persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :].to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DreamMLP(nn.Module):
    def __init__(self, config: DreamConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(hidden_state)) * self.up_proj(hidden_state))


class DreamSdpaAttention(nn.Module):
    def __init__(self, config: DreamConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.attention_dropout = config.attention_dropout
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | str | None = None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                **kwargs) -> tuple[torch.Tensor, None, None]:
        bsz, q_len, _ = hidden_states.size()
        query = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        query, key = (query * cos) + (rotate_half(query) * sin), (key * cos) + (rotate_half(key) * sin)
        groups = self.num_heads // self.num_key_value_heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask if isinstance(attention_mask, torch.Tensor) else None,
            dropout_p=self.attention_dropout if self.training else 0.0, is_causal=False)  # hard coded
        out = out.transpose(1, 2).contiguous().view(bsz, q_len, -1)
        return self.o_proj(out), None, None


class DreamDecoderLayer(nn.Module):
    def __init__(self, config: DreamConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DreamSdpaAttention(config, layer_idx)
        self.mlp = DreamMLP(config)
        self.input_layernorm = DreamRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DreamRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | str | None = None,
                position_ids: torch.Tensor | None = None, position_embeddings=None, **kwargs) -> tuple[torch.Tensor]:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                             position_embeddings=position_embeddings)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return (residual + hidden_states,)


class DreamPreTrainedModel(PreTrainedModel):
    config_class = DreamConfig
    base_model_prefix = "model"
    _no_split_modules: ClassVar[list[str]] = ["DreamDecoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, DreamRMSNorm):
            nn.init.ones_(module.weight)


class DreamBaseModel(DreamPreTrainedModel):
    def __init__(self, config: DreamConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(DreamDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DreamRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DreamRotaryEmbedding(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def forward(self, input_ids: torch.LongTensor = None, attention_mask: torch.Tensor | str | None = None,
                position_ids: torch.LongTensor | None = None, inputs_embeds: torch.FloatTensor | None = None,
                output_hidden_states: bool | None = None, **kwargs) -> BaseModelOutput:
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        all_hidden_states = () if output_hidden_states else None
        for decoder_layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            hidden_states = decoder_layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                          position_embeddings=position_embeddings)[0]
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        return BaseModelOutput(last_hidden_state=hidden_states, hidden_states=all_hidden_states)


class DreamModel(DreamPreTrainedModel):
    def __init__(self, config: DreamConfig):
        super().__init__(config)
        mark_ran("DreamModel.__init__")
        self.model = DreamBaseModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.LongTensor = None, attention_mask: torch.Tensor | str | None = None,
                position_ids: torch.LongTensor | None = None, inputs_embeds: torch.FloatTensor | None = None,
                labels: torch.LongTensor | None = None, output_hidden_states: bool | None = None,
                **kwargs) -> MaskedLMOutput:
        if isinstance(attention_mask, str) and attention_mask == "full" or attention_mask is None:
            pass
        elif isinstance(attention_mask, torch.Tensor):
            if not torch.any(attention_mask == 0.0):
                attention_mask = "full"
            elif attention_mask.dim() == 2:  # [B, L] -> [B, 1, L, L]
                attention_mask = torch.logical_and(attention_mask.unsqueeze(1).unsqueeze(-2),
                                                   attention_mask.unsqueeze(1).unsqueeze(-1)).to(torch.bool)
            elif attention_mask.dim() in (3, 4):
                attention_mask = attention_mask.to(torch.bool)
            else:
                raise ValueError(f"Unexpected attention_mask shape: {attention_mask.shape}")
        else:
            raise TypeError(f"Unsupported attention_mask type: {type(attention_mask)}")
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             inputs_embeds=inputs_embeds, output_hidden_states=output_hidden_states)
        logits = self.lm_head(outputs.last_hidden_state)
        return MaskedLMOutput(logits=logits, hidden_states=outputs.hidden_states)
