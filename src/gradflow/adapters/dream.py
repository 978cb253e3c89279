"""Dream (Dream-org/Dream-v0-Base-7B, remote code ``modeling_dream.py``, model_type ``Dream``): a masked diffusion LM
with a shifted head.

Loaded with ``--trust-remote-code`` through ``AutoModel`` (its ``auto_map`` maps no masked-LM class):
``DreamModel`` holds ``model``, a ``DreamBaseModel`` (``embed_tokens``, ``layers``, ``norm``) and ``lm_head``.
Each layer is Qwen2's pre-norm block with bidirectional attention: ``input_layernorm`` (RMSNorm) feeding
``self_attn.{q,k,v}_proj`` (with biases; rotary positions, grouped-query attention), ``self_attn.o_proj``,
residual; ``post_attention_layernorm``, gated MLP ``down_proj(act(gate_proj(x)) * up_proj(x))``, residual.

Dream was trained with a shifted head (``shifted_head``): its loss shifts the logits right by one, so the logits
at position p - 1 predict the token at p. Under the matching shifted objective the loss positions are those
whose successor is masked, whatever their own input, and the last block's exact zero holds at every other
position (also at a masked input whose successor is not masked).

``DreamModel.forward`` turns the (B, T) attention mask into the (B, 1, T, T) boolean mask (or ``"full"``) its
base model takes, so the base model cannot be called with the batch's mask alone: ``run_whole_model`` states
that, and the recorder runs the whole model (the same loss and gradients). The head is still position-wise:
``head`` and ``final_norm`` map the last block's output to the logits (the logit lens), and sparse training
stops the whole model's forward at the last block (:func:`gradflow.adapters.subset_diffusion.dream_subset`).
"""

from __future__ import annotations

from dataclasses import replace

from gradflow.adapters.llamalike import EUROBERT
from gradflow.adapters.subset_diffusion import dream_subset

DREAM = replace(
    EUROBERT,  # the same module paths: Qwen2's and Llama's blocks name their parts alike
    family="dream",
    model_types=("Dream", "dream"),
    run_whole_model="DreamBaseModel takes the (B, 1, T, T) attention mask DreamModel.forward builds from the (B, T) "
                    "one",
    subset_block=dream_subset,
    shifted_head=True,
    notes="masked diffusion LM (remote code, loaded with --trust-remote-code through AutoModel) with a shifted head "
          "(the logits at p predict the token at p + 1): Qwen2 pre-norm blocks with q/k/v biases, RMSNorm gains "
          "split by role exactly, rotary positions, grouped-query attention, bidirectional attention; the whole "
          "model runs to record; sparse last block",
)
