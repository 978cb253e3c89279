"""The refused masked-LM model types, each with its reason.

``REFUSED`` maps each masked-LM ``model_type`` without an adapter to the reason: either why the
per-position channel picture does not hold for it ("does not hold: ...") or what gradflow lacks to
record it ("not supported yet: ..."). :func:`adapter_for` raises with the reason.
``docs/mlm-coverage.md`` is generated from this table and the registry
(``python -m analyses.maintenance.make_mlm_coverage``); a test checks that every type transformers maps is in one of
them, so a transformers release that adds one fails that test until it is decided.
"""

from __future__ import annotations

_SEQ2SEQ = ("does not hold: an encoder-decoder denoiser ({cls}); its loss is on the decoder's predictions of "
            "the whole target sequence from shifted targets, not on the masked input positions, so input "
            "positions are not the loss's positions and there is no last encoder block whose context "
            "channels are cut off from the loss")
_EXTRA_INPUTS = ("not supported yet: {cls} also reads {what}, which gradflow's masked batches do not carry; "
                 "without them the model embeds {default} at every position, so a recording would not be of "
                 "the input the model was trained on")
_MULTIMODAL = ("not supported yet: a vision-language encoder ({cls}); image patches join the token sequence "
               "through a connector, and gradflow builds text-only masked batches and has no adapter for it")

REFUSED: dict[str, str] = {
    "bart": _SEQ2SEQ.format(cls="BartForConditionalGeneration"),
    "mbart": _SEQ2SEQ.format(cls="MBartForConditionalGeneration"),
    "mvp": _SEQ2SEQ.format(cls="MvpForConditionalGeneration"),
    "deberta": ("not supported yet: DeBERTa (v1) fuses Q, K and V in one in_proj Linear whose output rows "
                "are interleaved per head (q, k, v of head 0, then of head 1, ...), which SublayerSpec's "
                "contiguous row chunks cannot split"),
    "flaubert": ("not supported yet: FlaubertModel has no block module: attentions, layer_norm1, ffns and "
                 "layer_norm2 are parallel ModuleLists applied in a loop by FlaubertModel.forward (with "
                 "layerdrop and an optional pre-norm), and the recorder hooks one module per block"),
    "xlm": ("not supported yet: XLMModel has no block module: attentions, layer_norm1, ffns and layer_norm2 "
            "are parallel ModuleLists applied in a loop by XLMModel.forward, and the recorder hooks one "
            "module per block"),
    "fnet": ("not supported yet: FNet mixes positions with a parameter-free Fourier transform, so its blocks "
             "have no attention projections (attn.q/k/v/out) for the recorder's standard attention "
             "sublayers; the family tests that certify an adapter assume them"),
    "funnel": ("does not hold: the Funnel encoder pools the sequence between block groups (the length "
               "halves), so the positions of later blocks are not the batch's positions, and the decoder "
               "upsamples and adds the first group's output back"),
    "ibert": ("not supported yet: I-BERT's sublayers are QuantLinear and IntLayerNorm modules that pass "
              "(output, scaling factor) pairs, and the recorder's sublayer statistics read nn.Linear and "
              "nn.LayerNorm outputs only"),
    "layoutlm": _EXTRA_INPUTS.format(cls="LayoutLMForMaskedLM", what="bbox (a 2-D layout box per token, from "
                                     "OCR)", default="the box (0, 0, 0, 0)"),
    "tapas": _EXTRA_INPUTS.format(cls="TapasForMaskedLM", what="token_type_ids with 7 table channels (segment, "
                                  "column, row, ranks, ...)", default="table coordinates 0"),
    "roc_bert": _EXTRA_INPUTS.format(cls="RoCBertForMaskedLM", what="input_shape_ids and input_pronunciation_ids "
                                     "(glyph and pinyin ids from its tokenizer)", default="shape and "
                                     "pronunciation id 0"),
    "longformer": ("not supported yet: LongformerModel pads the input to a multiple of attention_window "
                   "before the embeddings, so its hidden states have more positions than the batch's roles "
                   "whenever the length is not such a multiple"),
    "mobilebert": ("not supported yet: MobileBERT blocks have input and output bottleneck projections, "
                   "num_feedforward_networks stacked FFNs and NoNorm (elementwise affine without "
                   "normalisation) instead of LayerNorm; they do not map onto the standard sublayers"),
    "mra": ("not supported yet: without its custom CUDA kernel MraSelfAttention returns zeros (no attention "
            "at all), and with it the multi-resolution approximation averages queries over blocks of "
            "positions, so the last block's attn.q would get context gradient; neither is checked"),
    "nystromformer": ("not supported yet: Nyström attention forms landmark queries and keys as segment means "
                      "over positions, so the last block's attn.q gets context gradient, and the input must "
                      "have exactly segment_means_seq_len positions; the recorder's zero set is not declared "
                      "for that"),
    "perceiver": ("does not hold: PerceiverForMaskedLM cross-attends the tokens into a fixed set of latent "
                  "vectors, processes the latents, and decodes positions back by cross-attention, so no "
                  "hidden state belongs to one input position between input and output"),
    "reformer": ("not supported yet: Reformer blocks are reversible (two residual streams, hidden 2H, and a "
                 "custom autograd function that recomputes activations in the backward pass, which tensor "
                 "hooks cannot follow), with LSH attention and chunked feed-forward"),
    "squeezebert": ("not supported yet: SqueezeBERT's projections are grouped Conv1d modules on (B, C, T) "
                    "tensors, and the recorder's sublayer statistics read nn.Linear and nn.LayerNorm on "
                    "(..., T, H) inputs only"),
    "xmod": ("not supported yet: with adapter_reuse_layer_norm (the default) output.LayerNorm runs twice per "
             "block (before the language adapter and after the residual), and the recorder attributes only "
             "a module's first call in a block to the batch's positions; X-MOD also needs lang_ids or a "
             "default language"),
    "modernvbert": _MULTIMODAL.format(cls="ModernVBertForMaskedLM"),
    "ultravbert": _MULTIMODAL.format(cls="UltraVBertForMaskedLM"),
    "neomme": _MULTIMODAL.format(cls="NeoMMEForMaskedLM"),
}


def masked_lm_model_types() -> dict[str, str]:
    """``model_type`` -> masked-LM class name, as the installed transformers maps them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return dict(MODEL_FOR_MASKED_LM_MAPPING_NAMES)


def refusal(model_type: object) -> str | None:
    """Why ``model_type`` is refused, or None."""
    return REFUSED.get(model_type) if isinstance(model_type, str) else None
