"""The GTE layout: post-LN blocks with ``self_attn``/``mlp`` and two norms, rotary positions.

GTE (Alibaba's new-impl encoders), NomicBERT and Jina-Embeddings-v3 share it: residual, attention,
``post_attention_layernorm``, residual, MLP, ``post_mlp_layernorm``. GTE and NomicBERT gate their MLP
(``down(act(gate(x)) * up(x))``); Jina-Embeddings-v3's is plain (``fc2(act(fc1(x)))``).
"""

from dataclasses import replace

from gradflow.adapters.base import LM_HEAD, Adapter, HeadSpec, SublayerSpec
from gradflow.adapters.subset import gte_subset

_ATTN = {
    "attn.q": SublayerSpec("self_attn.q_proj"),
    "attn.k": SublayerSpec("self_attn.k_proj"),
    "attn.v": SublayerSpec("self_attn.v_proj"),
    "attn.out": SublayerSpec("self_attn.o_proj"),
    "attn.norm": SublayerSpec("post_attention_layernorm"),
    "ffn.norm": SublayerSpec("post_mlp_layernorm"),
}

GTE = Adapter(
    family="gte",
    model_types=("gte",),
    embeddings="embeddings",
    blocks="layers",
    mid=("post_attention_layernorm", "output"),
    sublayers={**_ATTN, "ffn.in": SublayerSpec("mlp.up_proj"), "ffn.gate": SublayerSpec("mlp.gate_proj"),
               "ffn.out": SublayerSpec("mlp.down_proj")},
    attn_norm="post",
    head=LM_HEAD,
    notes="post-LN, rotary positions, gated FFN",
    subset_block=gte_subset,
)

NOMIC_BERT = replace(GTE, family="nomic_bert", model_types=("nomic_bert",), head=HeadSpec(("cls",)))

JINA_EMBEDDINGS_V3 = replace(
    GTE, family="jina_embeddings_v3", model_types=("jina_embeddings_v3",),
    sublayers={**_ATTN, "ffn.in": SublayerSpec("mlp.fc1"), "ffn.out": SublayerSpec("mlp.fc2")},
    notes="post-LN, rotary positions, plain FFN",
)
