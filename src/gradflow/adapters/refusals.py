"""The refused masked-LM model types, each with its reason.

``REFUSED`` maps each masked-LM ``model_type`` without an adapter to the reason: either why the
per-position channel picture does not hold for it ("does not hold: ...") or what gradflow lacks to
record it ("not supported yet: ..."). :func:`adapter_for` raises with the reason. ``REFUSED_BEYOND_MLM`` does the
same for model types transformers maps to no masked-LM class (masked-diffusion models; none at present: DiffusionGemma,
once refused here, is supported through :mod:`gradflow.adapters.diffusion_gemma`).
``docs/mlm-coverage.md`` is generated from this table and the registry
(``python -m analyses.maintenance.make_mlm_coverage``); a test checks that every type transformers maps is in one of
them, so a transformers release that adds one fails that test until it is decided.
"""

from __future__ import annotations

_SEQ2SEQ = ("does not hold: an encoder-decoder denoiser ({cls}); its loss is on the decoder's predictions of "
            "the whole target sequence from shifted targets, not on the masked input positions, so input "
            "positions are not the loss's positions and there is no last encoder block whose context "
            "channels are cut off from the loss")

REFUSED: dict[str, str] = {
    "bart": _SEQ2SEQ.format(cls="BartForConditionalGeneration"),
    "mbart": _SEQ2SEQ.format(cls="MBartForConditionalGeneration"),
    "mvp": _SEQ2SEQ.format(cls="MvpForConditionalGeneration"),
    "funnel": ("does not hold: the Funnel encoder pools the sequence between block groups (the length "
               "halves), so the positions of later blocks are not the batch's positions, and the decoder "
               "upsamples and adds the first group's output back"),
    "layoutlm": ("not supported yet: LayoutLMForMaskedLM also reads bbox, a 2-D box per token (0-1000 page "
                 "coordinates) that it was pre-trained with from OCR on scanned pages, every word its own box; "
                 "plain text has no boxes and there is no neutral box (the model's default (0, 0, 0, 0) at every "
                 "position, or one whole-page box, is an input it never saw). It takes a corpus with word boxes: a "
                 "jsonl field of per-word boxes, given to each word piece through the tokenizer's word_ids, cut "
                 "into windows with the tokens, and carried into MaskedBatch.extra_inputs['bbox'] (the recorder "
                 "and the attribution objective already pass extra_inputs to the model)"),
    "mra": ("does not hold: in approx_mode 'full' (the config default) MRA attention adds a low-resolution term "
            "built from block means of the queries (32 positions a block), so a loss position's output reads "
            "the queries of the context positions in its block and the last block's attn.q gets context "
            "gradient; without the CUDA kernel (fetched from the model hub with the kernels package) "
            "MraSelfAttention returns zeros, no position mixes with another and the model is not MRA at all "
            "(both in tests/adapters/test_families_extra_inputs.py); approx_mode 'sparse' (high-resolution blocks only) "
            "would keep per-position query rows but runs only with that kernel, which is not checked here"),
    "perceiver": ("does not hold: PerceiverForMaskedLM cross-attends the tokens into a fixed set of latent "
                  "vectors, processes the latents, and decodes positions back by cross-attention, so no "
                  "hidden state belongs to one input position between input and output"),
    "reformer": ("does not hold: LSH self-attention (the default last layer) uses one query_key projection for "
                 "queries and keys, so the context positions' queries are the keys every loss position attends "
                 "to and the last block's attn.q gets context gradient (measured non-zero on a tiny model; a local "
                 "last layer keeps the zero); its reversible blocks (two streams, hidden 2H, backward by "
                 "recomputation that asserts training mode) are no standard blocks either "
                 "(tests/adapters/test_families_extra_inputs.py)"),
    "neomme": ("not supported yet: NeoMME (a vision-language encoder; text-only input is its text path) has "
               "text blocks of its own, no supported family: each layer mixes its input with the embedding "
               "output (lambdas), the first and last full-attention layers add value_embeddings looked up from "
               "input_ids to V, attention removes each position's own value direction (exclusive self-attention, "
               "alpha), a sigmoid gate from the layer input scales the output projection, and its RMSNorms have no "
               "gain. Measured on a tiny model: in the last block q_proj, gate_proj, o_proj and the MLP get exactly "
               "zero gradient from context positions, k_proj, v_proj and the value embeddings do not "
               "(tests/adapters/test_families_extra_inputs.py). It takes an adapter naming gate_proj (zero, like attn.q) "
               "and value_embeddings (a model-level Embedding read by two layers) beyond the standard sublayers, "
               "family tests that allow pre-norm blocks without norm gains, and a tiny config built through "
               "NeoMMEConfig (its layer_types, per-layer windows and rope parameters are derived at construction)"),
}


REFUSED_BEYOND_MLM: dict[str, tuple[str, str]] = {}
"""Refused types that transformers maps to no masked-LM class (masked-diffusion models under other auto classes):
``model_type`` -> (model class, reason). ``docs/mlm-coverage.md`` lists them after the masked-LM table's count."""


def masked_lm_model_types() -> dict[str, str]:
    """``model_type`` -> masked-LM class name, as the installed transformers maps them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return dict(MODEL_FOR_MASKED_LM_MAPPING_NAMES)


def refusal(model_type: object) -> str | None:
    """Why ``model_type`` is refused, or None."""
    if not isinstance(model_type, str):
        return None
    return REFUSED.get(model_type) or REFUSED_BEYOND_MLM.get(model_type, (None, None))[1]
