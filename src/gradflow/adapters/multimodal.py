"""Vision-language encoders recorded on text alone: ModernVBERT and UltraVBERT.

Both wrap a text encoder gradflow already supports (``model.text_model``: a ModernBERT, an
UltraBERT) and a SigLIP vision tower whose patches, after a connector, replace the embeddings of
image placeholder tokens. Without ``pixel_values`` the forward is the text encoder's own: the
outer model looks up the token embeddings and calls ``text_model(inputs_embeds=...)``, which is
what the text encoder does with ``input_ids`` (ModernBERT's embedding norm still runs inside
``text_model.embeddings``). So gradflow's text-only masked batches record the text path exactly,
with the text encoder's zero pattern; the vision tower and connector get no gradient and are not
recorded. The MLM head is the wrapper's own: ``projection_head`` then ``lm_head``.

NeoMME (the third masked-LM vision-language encoder of transformers) has its own text blocks (every
layer re-reads the embedding output, value embeddings added in two layers, exclusive self-attention,
an output gate): it is refused (see :mod:`gradflow.adapters.refusals`).
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from gradflow.adapters.base import HeadSpec
from gradflow.adapters.llamalike import ULTRABERT
from gradflow.adapters.others import MODERNBERT


def cut_text_config(model: nn.Module, before: int, after: int) -> str:
    """After the last blocks of ``text_model`` were dropped: the text config's depth and layer types follow."""
    text = model.config.text_config
    text.num_hidden_layers = after
    if isinstance(getattr(text, "layer_types", None), (list, tuple)):
        text.layer_types = list(text.layer_types[:after])
    return f"text_config.num_hidden_layers {before} -> {after}"


_TEXT_ONLY = ("text only (no pixel_values): the forward is the {text} text encoder's own (text_model), the "
              "vision tower and connector get no gradient and are not recorded; head projection_head -> lm_head")

MODERNVBERT = replace(
    MODERNBERT, family="modernvbert", model_types=("modernvbert",),
    embeddings="text_model.embeddings", blocks="text_model.layers", final_norm="text_model.final_norm",
    head=HeadSpec(("projection_head", "lm_head")), per_layer_config=(), drop_extras=cut_text_config,
    notes=MODERNBERT.notes + "; " + _TEXT_ONLY.format(text="ModernBERT"),
)

ULTRAVBERT = replace(
    ULTRABERT, family="ultravbert", model_types=("ultravbert",),
    embeddings="text_model.embed_tokens", blocks="text_model.layers", final_norm="text_model.norm",
    head=HeadSpec(("projection_head", "lm_head")), per_layer_config=(), drop_extras=cut_text_config,
    notes=ULTRABERT.notes + "; " + _TEXT_ONLY.format(text="UltraBERT"),
)
