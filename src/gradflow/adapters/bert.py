"""BERT and the families that share its module layout (post-LN)."""

from gradflow.adapters.base import Adapter, SublayerSpec

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
    model_types=("bert", "roberta", "xlm-roberta", "camembert", "electra", "ernie", "roformer",
                 "data2vec-text"),
    embeddings="embeddings",
    blocks="encoder.layer",
    mid=("attention", "output"),
    sublayers=BERT_SUBLAYERS,
    attn_norm="post",
    notes="post-LN; ELECTRA means its ForMaskedLM generator",
)
