"""Families whose blocks depart from BERT's in one special way: MobileBERT, Longformer, FNet.

- **MobileBERT** (bottlenecks, stacked FFNs, NoNorm): the standard names cover the attention and
  the block's final FFN; the input/output bottlenecks and the ``num_feedforward_networks - 1``
  stacked FFNs are named by their own module paths. NoNorm (``x * weight + bias``) is split like a
  LayerNorm (:mod:`gradflow.adapters.norms`: its unit-gain output is ``x``, so the gain's
  per-position contribution is ``g_t * x_t``). Of the non-standard modules only the shared
  query/key bottleneck (``bottleneck.attention``) feeds the keys; every other one reads or writes
  only its own position after the attention mixing, so in the last block it gets exactly zero
  gradient from context (``after_mixing_extra``).
- **Longformer** (sliding-window attention, padding inside the model): BERT's module paths; the
  positions the model appends to reach a multiple of ``attention_window`` get role ``pad``
  (``appends_padding``).
- **FNet** (parameter-free Fourier mixing): no attention projections; every parameter of a block
  (the mixing's output LayerNorm, the FFN) sits after the mixing.
"""

from __future__ import annotations

from gradflow.adapters.base import LM_HEAD, Adapter, SublayerSpec
from gradflow.adapters.bert import BERT_SUBLAYERS
from gradflow.adapters.subset_blocks import fnet_subset, longformer_subset, mobilebert_subset

# ---------------------------------------------------------------------------------------------- MobileBERT

MOBILEBERT_LAYOUT = {"use_bottleneck": True, "key_query_shared_bottleneck": True, "use_bottleneck_attention": False,
                     "num_feedforward_networks": 4}
"""The block layout of the published MobileBERT checkpoints (``google/mobilebert-uncased``), the one described."""

_STACKED = tuple(f"ffn.{i}.{part}" for i in range(MOBILEBERT_LAYOUT["num_feedforward_networks"] - 1)
                 for part in ("intermediate.dense", "output.dense", "output.LayerNorm"))
_BOTTLENECK_AFTER_MIXING = ("bottleneck.input.dense", "bottleneck.input.LayerNorm", "output.bottleneck.dense",
                            "output.bottleneck.LayerNorm")
_BOTTLENECK_KEYS = ("bottleneck.attention.dense", "bottleneck.attention.LayerNorm")


def mobilebert_refusal(config: object) -> str | None:
    """Why a MobileBERT config's block layout is not the described one, or None (an attribute it lacks
    counts as the described value: a stand-in config with only ``model_type``)."""
    wrong = [f"{key}={getattr(config, key)!r}" for key, value in MOBILEBERT_LAYOUT.items()
             if getattr(config, key, value) != value]
    if not wrong:
        return None
    expected = ", ".join(f"{key}={value!r}" for key, value in MOBILEBERT_LAYOUT.items())
    return (f"its block layout ({', '.join(wrong)}) differs from the published checkpoints' ({expected}), the only "
            "MobileBERT layout gradflow's adapter names the sublayers of")


MOBILEBERT = Adapter(
    family="mobilebert",
    model_types=("mobilebert",),
    embeddings="embeddings",
    blocks="encoder.layer",
    mid=("attention", "output"),
    sublayers={**BERT_SUBLAYERS, **{path: SublayerSpec(path)
                                    for path in (*_BOTTLENECK_KEYS, *_BOTTLENECK_AFTER_MIXING, *_STACKED)}},
    attn_norm="post",
    notes="post-norm (NoNorm: x * weight + bias, or LayerNorm); the published layout: an input bottleneck "
          "(bottleneck.input) maps the hidden width to intra_bottleneck_size for the attention's residual, a shared "
          "bottleneck (bottleneck.attention) feeds the query and the key, the value reads the block input; "
          "num_feedforward_networks - 1 stacked FFNs (ffn.<i>.*) run between the attention and the block's own FFN, "
          "and the output bottleneck (output.bottleneck) maps back to the hidden width with the block input as its "
          "residual; mid = the attention output (intra_bottleneck_size wide). In the last block attn.k, attn.v and "
          "bottleneck.attention get context gradient; attn.q, attn.out, attn.norm, the FFNs, the stacked FFNs, "
          "bottleneck.input and output.bottleneck get exactly zero",
    refuse=mobilebert_refusal,
    after_mixing_extra=(*_BOTTLENECK_AFTER_MIXING, *_STACKED),
    subset_block=mobilebert_subset,
)

# ---------------------------------------------------------------------------------------------- Longformer

LONGFORMER = Adapter(
    family="longformer",
    model_types=("longformer",),
    embeddings="embeddings",
    blocks="encoder.layer",
    mid=("attention", "output"),
    sublayers=dict(BERT_SUBLAYERS),
    attn_norm="post",
    notes="post-LN; RoBERTa head and padding-offset positions; the model pads each batch to a multiple of "
          "attention_window before the embeddings: those appended positions get role pad and the record keeps the "
          "batch's positions. Local attention (what gradflow records: LongformerForMaskedLM without a "
          "global_attention_mask, as Longformer's MLM was trained): a query forms only its own row, so the last "
          "block's zeros are BERT's. With a global_attention_mask (a forward of your own inside "
          "GradFlowRecorder.capture): a global position's row is formed by query_global against key_global and "
          "value_global at every position, and every local row also attends the global positions' key and value; "
          "in the last block attn.q, attn.out, attn.norm and the FFN still get exactly zero from context, attn.k "
          "and attn.v do not, and query_global, key_global and value_global get exactly zero from every position "
          "unless a global position is a loss position (they only form global positions' rows); not split by role "
          "(outside the standard sublayers; gradflow check lists them when they do not run)",
    head=LM_HEAD,
    positions_after_padding=True,
    appends_padding=True,
    per_layer_config=("attention_window",),
    sequence_first=("attn.q", "attn.k", "attn.v"),
    subset_block=longformer_subset,
)

# ---------------------------------------------------------------------------------------------- FNet

FNET = Adapter(
    family="fnet",
    model_types=("fnet",),
    embeddings="embeddings",
    blocks="encoder.layer",
    mid=("fourier", "output"),
    sublayers={
        "attn.norm": SublayerSpec("fourier.output.LayerNorm"),
        "ffn.in": SublayerSpec("intermediate.dense"),
        "ffn.out": SublayerSpec("output.dense"),
        "ffn.norm": SublayerSpec("output.LayerNorm"),
    },
    attn_norm="post",
    notes="post-LN; the mixing is the real part of a parameter-free 2-D Fourier transform over positions and "
          "hidden units (no attention projections, no attention mask: padding is mixed in as the model does); "
          "attn.norm is the mixing's output LayerNorm. Every block parameter comes after the mixing, so in the "
          "last block all of them (attn.norm, ffn.in, ffn.out, ffn.norm) get exactly zero gradient from context",
    subset_block=fnet_subset,
)

__all__ = ["FNET", "LONGFORMER", "MOBILEBERT", "MOBILEBERT_LAYOUT", "mobilebert_refusal"]
