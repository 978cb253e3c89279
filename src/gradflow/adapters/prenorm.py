"""Pre-LN variants of the BERT layout: RoBERTa-PreLayerNorm, Megatron-BERT, XLM-RoBERTa-XL.

Each has a final norm between the last block and the MLM head.
"""

from gradflow.adapters.base import LM_HEAD, Adapter, SublayerSpec
from gradflow.adapters.subset import bert_layout

_ATTN = {
    "attn.q": SublayerSpec("attention.self.query"),
    "attn.k": SublayerSpec("attention.self.key"),
    "attn.v": SublayerSpec("attention.self.value"),
    "attn.out": SublayerSpec("attention.output.dense"),
    "ffn.in": SublayerSpec("intermediate.dense"),
    "ffn.out": SublayerSpec("output.dense"),
}

ROBERTA_PRELAYERNORM = Adapter(
    family="roberta-prelayernorm",
    model_types=("roberta-prelayernorm",),
    embeddings="embeddings",
    blocks="encoder.layer",
    mid=("attention", "output"),
    sublayers={**_ATTN, "attn.norm": SublayerSpec("attention.LayerNorm"),
               "ffn.norm": SublayerSpec("intermediate.LayerNorm")},
    attn_norm="pre",
    head=LM_HEAD,
    final_norm="LayerNorm",
    positions_after_padding=True,
    subset_block=bert_layout(pre_norm="attention.LayerNorm"),
)

MEGATRON_BERT = Adapter(
    family="megatron-bert",
    model_types=("megatron-bert",),
    embeddings="embeddings",
    blocks="encoder.layer",
    mid=("attention", "output"),
    sublayers={**_ATTN, "attn.norm": SublayerSpec("attention.ln"), "ffn.norm": SublayerSpec("ln")},
    attn_norm="pre",
    final_norm="encoder.ln",
    subset_block=bert_layout(pre_norm="attention.ln"),
)

XLM_ROBERTA_XL = Adapter(
    family="xlm-roberta-xl",
    model_types=("xlm-roberta-xl",),
    embeddings="embeddings",
    blocks="encoder.layer",
    mid=("attention", "output"),
    sublayers={**_ATTN, "attn.norm": SublayerSpec("attention.self_attn_layer_norm"),
               "ffn.norm": SublayerSpec("LayerNorm")},
    attn_norm="pre",
    head=LM_HEAD,
    final_norm="encoder.LayerNorm",
    positions_after_padding=True,
    subset_block=bert_layout(pre_norm="attention.self_attn_layer_norm"),
)
