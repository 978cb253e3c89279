"""ESM (protein language models): pre-LN blocks, a final norm, and a contact head sized by depth."""

from __future__ import annotations

import torch
from torch import nn

from gradflow.adapters.base import LM_HEAD, Adapter, SublayerSpec


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
)
