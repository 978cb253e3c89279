"""Families with their own module layout: DistilBERT, DeBERTa-v2/v3, ModernBERT, MPNet (ESM: esm.py)."""

from __future__ import annotations

import torch
from torch import nn

from gradflow.adapters.base import LM_HEAD, Adapter, HeadSpec, SublayerSpec
from gradflow.adapters.subset import distilbert_subset, mpnet_subset
from gradflow.adapters.subset_relative import deberta_v2_subset, modernbert_subset


def deberta_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """DeBERTa-v2's MLM head: ``cls`` (legacy) or ``lm_predictions``, which also reads the word embeddings."""
    if model.legacy:
        return model.cls(hidden)
    return model.lm_predictions(hidden, model.base_model.embeddings.word_embeddings)


DISTILBERT = Adapter(
    family="distilbert",
    model_types=("distilbert",),
    embeddings="embeddings",
    blocks="transformer.layer",
    mid=("sa_layer_norm", "output"),
    sublayers={
        "attn.q": SublayerSpec("attention.q_lin"),
        "attn.k": SublayerSpec("attention.k_lin"),
        "attn.v": SublayerSpec("attention.v_lin"),
        "attn.out": SublayerSpec("attention.out_lin"),
        "attn.norm": SublayerSpec("sa_layer_norm"),
        "ffn.in": SublayerSpec("ffn.lin1"),
        "ffn.out": SublayerSpec("ffn.lin2"),
        "ffn.norm": SublayerSpec("output_layer_norm"),
    },
    attn_norm="post",
    head=HeadSpec(("vocab_transform", "activation", "vocab_layer_norm", "vocab_projector")),
    subset_block=distilbert_subset,
)

DEBERTA_V2 = Adapter(
    family="deberta-v2",
    model_types=("deberta-v2",),
    embeddings="embeddings",
    blocks="encoder.layer",
    mid=("attention", "output"),
    sublayers={
        "attn.q": SublayerSpec("attention.self.query_proj"),
        "attn.k": SublayerSpec("attention.self.key_proj"),
        "attn.v": SublayerSpec("attention.self.value_proj"),
        "attn.out": SublayerSpec("attention.output.dense"),
        "attn.norm": SublayerSpec("attention.output.LayerNorm"),
        "ffn.in": SublayerSpec("intermediate.dense"),
        "ffn.out": SublayerSpec("output.dense"),
        "ffn.norm": SublayerSpec("output.LayerNorm"),
    },
    attn_norm="post",
    notes="with share_att_key the Q/K projections also map the relative-position embeddings: "
          "that share of their weight gradient has role 'relpos'; encoder.LayerNorm normalises the "
          "relative-position embeddings and is no final norm",
    head=HeadSpec((), call=deberta_head),
    subset_block=deberta_v2_subset,
)

MODERNBERT = Adapter(
    family="modernbert",
    model_types=("modernbert",),
    embeddings="embeddings",
    blocks="layers",
    mid=("mlp_norm", "input"),
    sublayers={
        "attn.q": SublayerSpec("attn.Wqkv", chunk=(0, 3)),
        "attn.k": SublayerSpec("attn.Wqkv", chunk=(1, 3)),
        "attn.v": SublayerSpec("attn.Wqkv", chunk=(2, 3)),
        "attn.out": SublayerSpec("attn.Wo"),
        "attn.norm": SublayerSpec("attn_norm"),
        "ffn.in": SublayerSpec("mlp.Wi", chunk=(0, 2)),
        "ffn.gate": SublayerSpec("mlp.Wi", chunk=(1, 2)),
        "ffn.out": SublayerSpec("mlp.Wo"),
        "ffn.norm": SublayerSpec("mlp_norm"),
    },
    attn_norm="pre",
    notes="pre-LN, fused QKV and gated FFN split by rows; block 0 has no attention norm (Identity)",
    head=HeadSpec(("head", "decoder")),
    final_norm="final_norm",
    per_layer_config=("layer_types",),
    subset_block=modernbert_subset,
)

MPNET = Adapter(
    family="mpnet",
    model_types=("mpnet",),
    embeddings="embeddings",
    blocks="encoder.layer",
    mid=("attention", "output"),
    sublayers={
        "attn.q": SublayerSpec("attention.attn.q"),
        "attn.k": SublayerSpec("attention.attn.k"),
        "attn.v": SublayerSpec("attention.attn.v"),
        "attn.out": SublayerSpec("attention.attn.o"),
        "attn.norm": SublayerSpec("attention.LayerNorm"),
        "ffn.in": SublayerSpec("intermediate.dense"),
        "ffn.out": SublayerSpec("output.dense"),
        "ffn.norm": SublayerSpec("output.LayerNorm"),
    },
    attn_norm="post",
    head=LM_HEAD,
    subset_block=mpnet_subset,
)
