"""More families with BERT's post-LN block layout: RemBERT, YOSO, BigBird, LUKE (words only), ConvBERT.

Their blocks have BERT's module paths (``attention.self.query`` ... ``output.LayerNorm``); they
differ in attention, head and position ids, which the notes state. The attention query of a
position only forms that position's own attention row in each of them (YOSO's expected-LSH
kernel, BigBird's sparse blocks, ConvBERT's span kernel too), so the last block's
``attn.q``, ``attn.out``, ``attn.norm`` and FFN get exactly zero gradient from context positions,
as in BERT.
"""

from dataclasses import replace

from gradflow.adapters.base import LM_HEAD, HeadSpec
from gradflow.adapters.bert import BERT
from gradflow.adapters.subset_variants import convbert_subset, luke_subset, yoso_subset

REMBERT = replace(BERT, family="rembert", model_types=("rembert",),
                  notes="post-LN; encoder.embedding_hidden_mapping_in (outside the blocks) maps the "
                        "input-embedding width to the hidden width, so embeddings.out has the embedding width")

YOSO = replace(BERT, family="yoso", model_types=("yoso",), positions_after_padding=True, subset_block=yoso_subset,
               notes="post-LN; position ids start at 2 (pad_token_id + 1 for YOSO's pad id 1); with "
                     "use_expectation=True (the default, tested) attention is the expected-LSH kernel computed "
                     "in PyTorch and forms each position's row from its own query; use_expectation=False "
                     "samples hashes with YOSO's CUDA kernels and is not checked")

BIG_BIRD = replace(BERT, family="big_bird", model_types=("big_bird",),
                   notes="post-LN; original_full and block_sparse attention alike (block_sparse falls "
                         "back to full attention on short inputs); block-sparse attention still forms each "
                         "position's row from its own query, so the exact zeros are BERT's")

LUKE = replace(BERT, family="luke", model_types=("luke",), head=LM_HEAD, positions_after_padding=True,
               subset_block=luke_subset,
               notes="post-LN; words only: with entity inputs the sublayers also run on entity positions, "
                     "which are not positions of the batch (gradflow passes no entity_ids)")

CONVBERT = replace(
    BERT, family="convbert", model_types=("convbert",), subset_block=convbert_subset,
    head=HeadSpec(("generator_predictions", "generator_lm_head")),
    notes="post-LN; mixed attention: half the heads are span-based dynamic convolution, in two modules "
          "outside the standard sublayers. attention.self.conv_out_layer (a per-position Linear whose output "
          "is unfolded over the conv_kernel_size (default 9) neighbouring positions) gets context gradient in the last block, like "
          "attn.v. attention.self.conv_kernel_layer and attention.self.key_conv_attn_layer get exactly zero "
          "gradient at context positions' outputs (they form a position's own span kernel, like attn.q), but "
          "the depthwise convolution inside key_conv_attn_layer reads conv_kernel_size neighbouring positions, so, like "
          "attn.k, it passes loss positions' gradient into context positions' hidden states",
)
