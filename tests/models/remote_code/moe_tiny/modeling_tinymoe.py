"""A tiny remote-code mixture-of-experts masked diffusion LM (LLaDA-MoE-shaped), for gradflow's tests.

``TinyMoeModel`` (registered for ``AutoModel`` only) holds ``model`` (``embed_tokens``, ``layers``, ``norm``) and
``lm_head``; each layer: residual + bidirectional attention (``self_attn.{q,k,v,o}_proj``, rotary positions) after
``input_layernorm``, then residual + ``mlp`` after ``post_attention_layernorm``. ``mlp`` is a sparse MoE block: a
router ``gate`` (a ``weight`` (E, H) applied as a Linear to the (B * T, H) rows, softmax, top-k, renormalised) and
``experts`` in the config's ``experts_layout``. It returns ``MaskedLMOutput(logits)``. Test code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput

from .configuration_tinymoe import TinyMoeConfig


class TinyMoeRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate(x: torch.Tensor, position: torch.Tensor, theta: float) -> torch.Tensor:
    dim = x.shape[-1]
    freqs = position[:, None].float() / theta ** (torch.arange(0, dim, 2, device=x.device).float() / dim)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


class TinyMoeAttention(nn.Module):
    def __init__(self, config: TinyMoeConfig):
        super().__init__()
        h, self.heads, self.theta = config.hidden_size, config.num_attention_heads, config.rope_theta
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(h, h, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, h = x.shape
        position = torch.arange(t, device=x.device)
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = _rotate(q, position, self.theta), _rotate(k, position, self.theta)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, h))


class TinyMoeRouter(nn.Module):
    def __init__(self, config: TinyMoeConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(rows, self.weight)
        weights, index = torch.topk(logits.softmax(dim=-1), self.top_k, dim=-1)
        return logits, weights / weights.sum(dim=-1, keepdim=True), index


class TinyMoeFusedExperts(nn.Module):
    def __init__(self, config: TinyMoeConfig):
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, rows: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(rows)
        for e in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == e)
            gate, up = F.linear(rows[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            routed = F.linear(self.act_fn(gate) * up, self.down_proj[e]) * top_k_weights[token, slot, None]
            out = out.index_add(0, token, routed)
        return out


class TinyMoeInternalExperts(TinyMoeFusedExperts):
    """3-D experts that route inside their own forward (from the rows alone): the routing is not visible."""

    def __init__(self, config: TinyMoeConfig):
        super().__init__(config)
        self.router = TinyMoeRouter(config)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        _, weights, index = self.router(rows)
        return super().forward(rows, index, weights)


class TinyMoeMLP(nn.Module):
    def __init__(self, config: TinyMoeConfig):
        super().__init__()
        h, i = config.hidden_size, config.moe_intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class TinyMoeSparseBlock(nn.Module):
    def __init__(self, config: TinyMoeConfig):
        super().__init__()
        self.layout = config.experts_layout
        if self.layout == "internal":
            self.experts = TinyMoeInternalExperts(config)
            return
        self.gate = TinyMoeRouter(config)
        self.experts = (TinyMoeFusedExperts(config) if self.layout == "fused"
                        else nn.ModuleList(TinyMoeMLP(config) for _ in range(config.num_experts)))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, t, h = hidden.shape
        rows = hidden.reshape(-1, h)
        if self.layout == "internal":
            return self.experts(rows).view(b, t, h)
        _, weights, index = self.gate(rows)
        if self.layout == "fused":
            return self.experts(rows, index, weights).view(b, t, h)
        out = torch.zeros_like(rows)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(index == e)
            out = out.index_add(0, token, expert(rows[token]) * weights[token, slot, None])
        return out.view(b, t, h)


class TinyMoeLayer(nn.Module):
    def __init__(self, config: TinyMoeConfig):
        super().__init__()
        self.input_layernorm = TinyMoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = TinyMoeAttention(config)
        self.post_attention_layernorm = TinyMoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = TinyMoeSparseBlock(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyMoePreTrainedModel(PreTrainedModel):
    config_class = TinyMoeConfig
    base_model_prefix = "model"

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, TinyMoeFusedExperts):
            nn.init.normal_(module.gate_up_proj, std=std)
            nn.init.normal_(module.down_proj, std=std)
        elif isinstance(module, TinyMoeRouter):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, TinyMoeRMSNorm):
            nn.init.ones_(module.weight)


class TinyMoeBaseModel(TinyMoePreTrainedModel):
    def __init__(self, config: TinyMoeConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TinyMoeLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = TinyMoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                **kwargs) -> BaseModelOutput:
        hidden = self.embed_tokens(input_ids)
        mask = None if attention_mask is None else attention_mask[:, None, None, :].bool()
        for layer in self.layers:
            hidden = layer(hidden, mask)
        return BaseModelOutput(last_hidden_state=self.norm(hidden))


class TinyMoeModel(TinyMoePreTrainedModel):
    def __init__(self, config: TinyMoeConfig):
        super().__init__(config)
        self.model = TinyMoeBaseModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                **kwargs) -> MaskedLMOutput:
        return MaskedLMOutput(logits=self.lm_head(self.model(input_ids, attention_mask).last_hidden_state))
