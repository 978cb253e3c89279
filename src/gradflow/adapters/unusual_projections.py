"""Families whose projections are not plain per-sublayer Linears: DeBERTa v1, SqueezeBERT, I-BERT.

- DeBERTa (v1) fuses Q, K and V in one bias-free ``in_proj`` whose output rows are interleaved per
  head (q, k, v of head 0, then of head 1, ...): split with ``chunk=(i, 3)`` and
  ``interleave="num_attention_heads"``. Its ``q_bias`` and ``v_bias`` are Parameters added to the q
  and v rows outside the Linear, so their gradient is the sum of those rows' output gradients: they
  are split by role as ``attn.q``'s and ``attn.v``'s ``bias``. The relative-position projections
  ``pos_proj`` (c2p) and ``pos_q_proj`` (p2c) map the relative-position embeddings, not positions of the
  batch: they are no standard sublayer, and ``gradflow check`` reports them with role ``relpos`` only.
- SqueezeBERT keeps hidden states as (B, H, T) and projects with grouped ``Conv1d`` modules of kernel
  size 1 (a per-position Linear map per group, a block-diagonal Linear): ``channels_first``.
- I-BERT's ``QuantLinear`` and ``IntLayerNorm`` return (output, scaling factor) pairs. With
  ``quant_mode=False`` (the default) they compute ``F.linear`` and a LayerNorm of their first input
  (``acts_as``); ``quant_mode=True`` is refused (see :func:`ibert_refusal`).

In all three the attention query of a position forms only that position's attention row (DeBERTa's
content-to-position term too: ``c2p`` reads the query of row i against relative-position keys), so
the last block's ``attn.q``, ``attn.out``, ``attn.norm`` and FFN get exactly zero gradient from
context positions, as in BERT; ``attn.k`` and ``attn.v`` (and DeBERTa's position-to-content term,
which reads every key) do not.
"""

from __future__ import annotations

from dataclasses import replace

from gradflow.adapters.base import LM_HEAD, Adapter, HeadSpec, SublayerSpec
from gradflow.adapters.bert import BERT_SUBLAYERS
from gradflow.adapters.others import deberta_head
from gradflow.adapters.subset_relative import deberta_subset
from gradflow.adapters.subset_variants import ibert_subset, squeezebert_subset


def _ibert_sublayers() -> dict[str, SublayerSpec]:
    kinds = {"attn.norm": "layer_norm", "ffn.norm": "layer_norm"}
    return {name: replace(spec, acts_as=kinds.get(name, "linear")) for name, spec in BERT_SUBLAYERS.items()}


def ibert_refusal(config: object) -> str | None:
    """Why an I-BERT config cannot be recorded (``quant_mode=True``), or None."""
    if not getattr(config, "quant_mode", False):
        return None
    return ("with quant_mode=True I-BERT computes in integers: QuantLinear quantises its weight and bias with a "
            "straight-through estimator, IntLayerNorm rounds (floor_ste, round_ste), adds its bias through "
            "bias.data (which gets no gradient) and returns its gain inside the output scaling factor, and the "
            "softmax and GELU are integer polynomials, so the parameter gradients autograd returns are "
            "straight-through estimates, not sums of per-position terms g_t x_t^T and g_t xhat_t that the "
            "recorder splits by role; set config.quant_mode = False (the float model, as the checkpoints "
            "ship) to record it")


_DEBERTA_ATTENTION = "attention.self."

DEBERTA = Adapter(
    family="deberta",
    model_types=("deberta",),
    embeddings="embeddings",
    blocks="encoder.layer",
    mid=("attention", "output"),
    sublayers={
        **BERT_SUBLAYERS,
        "attn.q": SublayerSpec(_DEBERTA_ATTENTION + "in_proj", chunk=(0, 3), interleave="num_attention_heads",
                               bias=_DEBERTA_ATTENTION + "q_bias"),
        "attn.k": SublayerSpec(_DEBERTA_ATTENTION + "in_proj", chunk=(1, 3), interleave="num_attention_heads"),
        "attn.v": SublayerSpec(_DEBERTA_ATTENTION + "in_proj", chunk=(2, 3), interleave="num_attention_heads",
                               bias=_DEBERTA_ATTENTION + "v_bias"),
    },
    attn_norm="post",
    notes="post-LN; Q, K and V from one bias-free in_proj with rows interleaved per head (q, k, v of head 0, "
          "then head 1, ...), split by row index; q_bias and v_bias (Parameters added outside the Linear) are "
          "attn.q's and attn.v's bias; the relative-position projections pos_proj (c2p) and pos_q_proj (p2c) "
          "map relative-position embeddings, so their whole gradient has role 'relpos' (gradflow check lists "
          "them as other modules); the last block's zeros are BERT's",
    head=HeadSpec((), call=deberta_head),
    subset_block=deberta_subset,
)

SQUEEZEBERT = Adapter(
    family="squeezebert",
    model_types=("squeezebert",),
    embeddings="embeddings",
    blocks="encoder.layers",
    mid=("post_attention", "output"),
    sublayers={
        "attn.q": SublayerSpec("attention.query"),
        "attn.k": SublayerSpec("attention.key"),
        "attn.v": SublayerSpec("attention.value"),
        "attn.out": SublayerSpec("post_attention.conv1d"),
        "attn.norm": SublayerSpec("post_attention.layernorm"),
        "ffn.in": SublayerSpec("intermediate.conv1d"),
        "ffn.out": SublayerSpec("output.conv1d"),
        "ffn.norm": SublayerSpec("output.layernorm"),
    },
    attn_norm="post",
    notes="post-LN; blocks carry (B, H, T) hidden states (transposed to (B, T, H) at the sites); every "
          "projection is a grouped Conv1d of kernel size 1, split exactly as a block-diagonal Linear (a "
          "position's magnitude is the norm of its block-diagonal contribution); the last block's zeros are BERT's",
    channels_first=True,
    block_entry="attention",  # SqueezeBertEncoder calls layer.forward(...): the block's own hooks never run
    block_exit="output",
    subset_block=squeezebert_subset,
)

IBERT = Adapter(
    family="ibert",
    model_types=("ibert",),
    embeddings="embeddings",
    blocks="encoder.layer",
    mid=("attention.output", "output"),
    sublayers=_ibert_sublayers(),
    attn_norm="post",
    notes="post-LN, RoBERTa layout; quant_mode=False only (QuantLinear and IntLayerNorm then compute a float "
          "Linear and LayerNorm and return (output, None)); quant_mode=True is refused: its gradients are "
          "straight-through estimates",
    head=LM_HEAD,
    positions_after_padding=True,
    refuse=ibert_refusal,
    subset_block=ibert_subset,
)
