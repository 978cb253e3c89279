"""DiffusionGemma (``DiffusionGemmaForBlockDiffusion``, transformers): block diffusion, two passes of tied blocks.

The prompt runs through a causal encoder (``encoder.language_model.layers``) that caches its keys and values; the
canvas then runs through a decoder (``decoder.layers``, every block parameter the encoder's, depth by depth) with
bidirectional attention over the cached prompt and the canvas; the logits (softcapped ``lm_head``) cover the canvas
only. :class:`~gradflow.adapters.two_pass.TwoPassSpec` says how a (B, P + C) batch feeds the forward; the recorder
joins the encoder's and the decoder's call of each depth into one block record.

Each block (Gemma 4's): ``input_layernorm`` (RMSNorm, ``y = xhat * weight``) feeding ``self_attn.q_proj``,
``k_proj`` and ``v_proj`` (sliding-attention layers only: the full-attention layers use the keys as values, so
``attn.v`` is optional), ``q_norm``/``k_norm`` per head, ``o_proj``, then ``post_attention_layernorm`` before the
residual add (``attn.post_norm``); the FFN is a gated MLP (``pre_feedforward_layernorm``, ``mlp.*``,
``post_feedforward_layernorm_1``) beside a mixture of experts on the flattened (B * T, H) rows: a router
``router.proj`` (``ffn.router``) and fused 3-D experts ``experts`` (``ffn.experts.gate_up_proj``,
``ffn.experts.down_proj``) fed through ``pre_feedforward_layernorm_2`` (``ffn.experts_norm``) and normed after by
``post_feedforward_layernorm_2``; their sum goes through ``post_feedforward_layernorm`` (``ffn.post_norm``) to the
residual. Every module after attention reads only its own position: the last decoder block's get exactly zero from
canvas positions without loss, and the encoder's last layer gets gradient only on its key path (its keys and
values are what the canvas reads).
"""

from __future__ import annotations

import torch
from torch import nn

from gradflow.adapters.base import Adapter, HeadSpec, SublayerSpec
from gradflow.adapters.experts import ExpertsSpec
from gradflow.adapters.two_pass import TwoPassSpec


def softcapped_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The model's logits from the decoder's normed hidden states (..., H): ``lm_head`` then the tanh softcap."""
    cap = model.final_logit_softcapping
    logits = model.lm_head(hidden).float()
    return logits if cap is None else torch.tanh(logits / cap) * cap


DIFFUSION_GEMMA = Adapter(
    family="diffusion_gemma",
    model_types=("diffusion_gemma",),
    embeddings="",
    embeddings_at="blocks",
    blocks="decoder.layers",
    mid=("pre_feedforward_layernorm", "input"),
    sublayers={
        "attn.q": SublayerSpec("self_attn.q_proj"),
        "attn.k": SublayerSpec("self_attn.k_proj"),
        "attn.v": SublayerSpec("self_attn.v_proj", optional=True),
        "attn.out": SublayerSpec("self_attn.o_proj"),
        "attn.norm": SublayerSpec("input_layernorm"),
        "attn.post_norm": SublayerSpec("post_attention_layernorm"),
        "ffn.norm": SublayerSpec("pre_feedforward_layernorm"),
        "ffn.in": SublayerSpec("mlp.up_proj"),
        "ffn.gate": SublayerSpec("mlp.gate_proj"),
        "ffn.out": SublayerSpec("mlp.down_proj"),
        "ffn.router": SublayerSpec("router.proj", flat=True),
        "ffn.experts_norm": SublayerSpec("pre_feedforward_layernorm_2", flat=True),
        "ffn.post_norm": SublayerSpec("post_feedforward_layernorm"),
    },
    attn_norm="pre",
    head=HeadSpec(call=softcapped_head),
    final_norm="decoder.norm",
    per_layer_config=("layer_types",),
    run_whole_model="the logits cover the canvas only (the decoder's pass), after a prompt pass through the encoder",
    experts={"ffn.experts": ExpertsSpec("experts")},
    after_mixing_extra=("attn.post_norm", "ffn.router", "ffn.experts_norm", "ffn.post_norm", "ffn.experts"),
    two_pass=TwoPassSpec(first_blocks="encoder.language_model.layers", model_class="DiffusionGemmaForBlockDiffusion"),
    notes="block diffusion: a causal encoder over the prompt and a bidirectional decoder over the canvas share every "
          "block parameter; both passes of a depth recorded as one block (prompt positions: role prompt); pre-norm "
          "RMSNorm gains, a gated MLP beside a top-k router and fused 3-D experts split by the role of the rows routed "
          "to each expert",
)

__all__ = ["DIFFUSION_GEMMA", "softcapped_head"]
