"""A tiny remote-code mixture-of-experts masked diffusion LM's config (LLaDA-MoE-shaped), for gradflow's tests.

Model type ``tinymoe`` (gradflow has no adapter for it: recorded with ``--adapter auto``): Qwen2-style names plus
``num_experts``, ``num_experts_per_tok`` and ``moe_intermediate_size``; ``experts_layout`` picks the experts' form:
``"fused"`` (3-D ``gate_up_proj``/``down_proj`` called with the routing, as transformers 5.x ships them), ``"list"``
(a ModuleList of gated MLPs, each called on the rows routed to it, as OLMoE's and LLaDA-MoE's older code) or
``"internal"`` (3-D parameters routed inside the experts' own forward: not splittable). Test code.
"""

from __future__ import annotations

from transformers import PretrainedConfig


class TinyMoeConfig(PretrainedConfig):
    model_type = "tinymoe"

    def __init__(self, vocab_size: int = 300, hidden_size: int = 32, num_hidden_layers: int = 2,
                 num_attention_heads: int = 2, num_experts: int = 4, num_experts_per_tok: int = 2,
                 moe_intermediate_size: int = 24, experts_layout: str = "fused", hidden_act: str = "silu",
                 max_position_embeddings: int = 64, initializer_range: float = 0.02, rms_norm_eps: float = 1e-6,
                 rope_theta: float = 10000.0, tie_word_embeddings: bool = False, mask_token_id: int | None = None,
                 **kwargs):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.num_experts, self.num_experts_per_tok = (num_attention_heads, num_experts,
                                                                                num_experts_per_tok)
        self.moe_intermediate_size, self.experts_layout, self.hidden_act = (moe_intermediate_size, experts_layout,
                                                                            hidden_act)
        self.max_position_embeddings, self.initializer_range = max_position_embeddings, initializer_range
        self.rms_norm_eps, self.rope_theta, self.mask_token_id = rms_norm_eps, rope_theta, mask_token_id
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
