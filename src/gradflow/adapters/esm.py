"""ESM (protein language models): pre-LN blocks, a final norm, and a contact head sized by depth."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from gradflow.adapters.base import LM_HEAD, Adapter, SublayerSpec
from gradflow.adapters.llamalike import EUROBERT
from gradflow.adapters.subset import esm_subset
from gradflow.adapters.subset_variants import esmc_subset
from gradflow.errors import SurgeryError


def trim_contact_head(model: nn.Module, before: int, after: int) -> str:
    """Keep the contact head's regression columns of the kept layers' attention maps (layer-major).

    ESM's contact head regresses on every layer's attention maps, so its input width is
    ``layers * heads``; after dropping blocks only the first ``after * heads`` columns remain.
    """
    head = getattr(model.base_model, "contact_head", None)
    if head is None:
        return ""
    old = head.regression
    heads = old.in_features // before
    new = nn.Linear(after * heads, 1, bias=old.bias is not None).to(old.weight.device, old.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(old.weight[:, : after * heads])
        if old.bias is not None:
            new.bias.copy_(old.bias)
    head.regression = new
    head.in_features = after * heads
    return "ESM contact head: regression columns of the dropped layers' attention maps removed"


ESM = Adapter(
    family="esm",
    model_types=("esm",),
    embeddings="embeddings",
    blocks="encoder.layer",
    mid=("attention", "output"),
    sublayers={
        "attn.q": SublayerSpec("attention.self.query"),
        "attn.k": SublayerSpec("attention.self.key"),
        "attn.v": SublayerSpec("attention.self.value"),
        "attn.out": SublayerSpec("attention.output.dense"),
        "attn.norm": SublayerSpec("attention.LayerNorm"),
        "ffn.in": SublayerSpec("intermediate.dense"),
        "ffn.out": SublayerSpec("output.dense"),
        "ffn.norm": SublayerSpec("LayerNorm"),
    },
    attn_norm="pre",
    head=LM_HEAD,
    final_norm="encoder.emb_layer_norm_after",
    drop_extras=trim_contact_head,
    subset_block=esm_subset,
)

def esmc_drop(model: nn.Module, k: int) -> tuple[int, str]:
    """Refuse: ESMC scales every residual branch by ``sqrt(num_hidden_layers / 36)``."""
    raise SurgeryError("ESMC divides every residual branch by sqrt(num_hidden_layers / 36), so a model with "
                       f"{k} fewer block(s) computes a different function of the kept blocks' weights once "
                       "reloaded; gradflow does not drop ESMC blocks")


ESMC = replace(
    EUROBERT,  # the same Llama-style layout and sublayer paths
    family="esmc",
    model_types=("esmc",),
    drop_blocks=esmc_drop,
    subset_block=esmc_subset,
    notes="pre-LN, rotary positions, gated FFN, residual branches scaled by sqrt(num_hidden_layers / 36) (so blocks are not dropped); attention also normalises the "
          "projected queries and keys (self_attn.q_norm, self_attn.k_norm, outside the standard sublayers): "
          "in the last block q_norm gets exactly zero gradient from context positions, like attn.q, and "
          "k_norm does not, like attn.k",
)
