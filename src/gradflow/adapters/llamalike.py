"""The Llama-style encoder layout: EuroBERT and UltraBERT.

Pre-norm blocks (``model.layers``): residual, ``input_layernorm`` (RMSNorm) feeding
``self_attn.{q,k,v}_proj`` (rotary positions on queries and keys, grouped-query attention allowed),
``self_attn.o_proj``, residual; ``post_attention_layernorm`` (RMSNorm), gated MLP
``down_proj(act(gate_proj(x)) * up_proj(x))``, residual; a final RMSNorm ``model.norm`` before the
head. The RMSNorm gains are split by role exactly (:mod:`gradflow.adapters.norms`: ``y = xhat * weight``).

UltraBERT differs only outside the block's standard sublayers: most layers attend within a
sliding window (``config.layer_types``; the mask only narrows which keys a query sees, so the
last block's exact zero is unchanged), and its MLM head is two bias-free Linears with GELU before
the decoder (``head``), all position-wise.
"""

from dataclasses import replace

from gradflow.adapters.base import LM_HEAD, Adapter, HeadSpec, SublayerSpec
from gradflow.adapters.subset import llama_subset

EUROBERT = Adapter(
    family="eurobert",
    model_types=("eurobert",),
    embeddings="embed_tokens",
    blocks="layers",
    mid=("post_attention_layernorm", "input"),
    sublayers={
        "attn.q": SublayerSpec("self_attn.q_proj"),
        "attn.k": SublayerSpec("self_attn.k_proj"),
        "attn.v": SublayerSpec("self_attn.v_proj"),
        "attn.out": SublayerSpec("self_attn.o_proj"),
        "attn.norm": SublayerSpec("input_layernorm"),
        "ffn.in": SublayerSpec("mlp.up_proj"),
        "ffn.gate": SublayerSpec("mlp.gate_proj"),
        "ffn.out": SublayerSpec("mlp.down_proj"),
        "ffn.norm": SublayerSpec("post_attention_layernorm"),
    },
    attn_norm="pre",
    head=LM_HEAD,
    final_norm="norm",
    notes="pre-norm with RMSNorm gains (split by role exactly), rotary positions, grouped-query attention, "
          "gated FFN",
    subset_block=llama_subset,
)

ULTRABERT = replace(
    EUROBERT,
    family="ultrabert",
    model_types=("ultrabert",),
    head=HeadSpec(("head", "decoder")),
    per_layer_config=("layer_types",),
    notes="pre-norm with RMSNorm gains (split by role exactly), rotary positions, grouped-query attention, "
          "gated FFN; sliding-window attention in the layers config.layer_types marks (it narrows which "
          "keys a query sees and leaves the last block's exact zero as stated)",
)
