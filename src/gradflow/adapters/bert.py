"""BERT and the families that share its module layout (post-LN).

They differ only in their MLM head and position ids, so RoBERTa-style models and the ELECTRA
generator are variants of the BERT adapter (same ``family``, their own ``model_types``).
"""

from dataclasses import replace

from gradflow.adapters.base import LM_HEAD, Adapter, HeadSpec, SublayerSpec
from gradflow.adapters.subset import bert_layout

BERT_SUBLAYERS = {
    "attn.q": SublayerSpec("attention.self.query"),
    "attn.k": SublayerSpec("attention.self.key"),
    "attn.v": SublayerSpec("attention.self.value"),
    "attn.out": SublayerSpec("attention.output.dense"),
    "attn.norm": SublayerSpec("attention.output.LayerNorm"),
    "ffn.in": SublayerSpec("intermediate.dense"),
    "ffn.out": SublayerSpec("output.dense"),
    "ffn.norm": SublayerSpec("output.LayerNorm"),
}

BERT = Adapter(
    family="bert",
    model_types=("bert", "ernie", "roformer"),
    embeddings="embeddings",
    blocks="encoder.layer",
    mid=("attention", "output"),
    sublayers=BERT_SUBLAYERS,
    attn_norm="post",
    notes="post-LN",
    subset_block=bert_layout(),
)

ROBERTA = replace(BERT, model_types=("roberta", "xlm-roberta", "camembert", "data2vec-text"), head=LM_HEAD,
                  positions_after_padding=True, notes="post-LN; RoBERTa head and padding-offset positions")

ELECTRA = replace(BERT, model_types=("electra",), head=HeadSpec(("generator_predictions", "generator_lm_head")),
                  notes="post-LN; ELECTRA means its ForMaskedLM generator")
