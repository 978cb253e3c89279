"""LLaDA (GSAI-ML/LLaDA-8B-Base, remote code ``modeling_llada.py``, model_type ``llada``): a masked diffusion LM.

Loaded with ``--trust-remote-code`` through ``AutoModel`` (its ``auto_map`` maps no masked-LM class):
``LLaDAModelLM`` holds ``model``, an ``LLaDAModel`` (the base model, a plain ``nn.Module``) whose ``transformer``
``ModuleDict`` holds ``wte`` (embeddings), ``blocks`` (``LLaDALlamaBlock``), ``ln_f`` (final RMS norm) and
``ff_out`` (the output layer; with ``weight_tying`` the logits are ``wte``'s transpose instead).

Each block is Llama's pre-norm layout under other names: ``attn_norm`` (RMS norm) feeding ``q_proj``, ``k_proj``,
``v_proj`` (rotary positions), bidirectional attention, ``attn_out``, residual; ``ff_norm``, the gated FFN
``ff_out(act(ff_proj(x)) * up_proj(x))`` (``ff_proj`` is the gate, ``up_proj`` the input), residual. The block
returns ``(x, cache)``. The loss is unshifted: the logits at p predict the token at p (the masked positions).

The base model applies ``ln_f`` and the output layer itself and returns logits, no ``last_hidden_state``, so it
cannot be called alone for the last hidden state: ``run_whole_model`` states that, and the recorder runs the
whole model (the same loss and gradients). The head is still position-wise: ``head`` and ``final_norm`` map the
last block's output to the logits (the logit lens), and sparse training stops the forward at the last block
(:func:`gradflow.adapters.subset_diffusion.llada_subset`) and runs ``ln_f`` and the head at the loss positions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gradflow.adapters.base import Adapter, HeadSpec, SublayerSpec
from gradflow.adapters.subset_diffusion import llada_subset


def llada_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """LLaDA's output layer on ``hidden`` (after ``ln_f``): ``ff_out``, or ``wte`` transposed with ``weight_tying``;
    scaled by ``1 / sqrt(d_model)`` with ``scale_logits``, as ``LLaDAModel.forward`` does."""
    config = model.config
    transformer = model.base_model.transformer
    logits = F.linear(hidden, transformer.wte.weight) if config.weight_tying else transformer.ff_out(hidden)
    return logits * (1 / math.sqrt(config.d_model)) if getattr(config, "scale_logits", False) else logits


LLADA = Adapter(
    family="llada",
    model_types=("llada",),
    embeddings="transformer.wte",
    blocks="transformer.blocks",
    mid=("ff_norm", "input"),
    sublayers={
        "attn.q": SublayerSpec("q_proj"),
        "attn.k": SublayerSpec("k_proj"),
        "attn.v": SublayerSpec("v_proj"),
        "attn.out": SublayerSpec("attn_out"),
        "attn.norm": SublayerSpec("attn_norm"),
        "ffn.in": SublayerSpec("up_proj"),
        "ffn.gate": SublayerSpec("ff_proj"),
        "ffn.out": SublayerSpec("ff_out"),
        "ffn.norm": SublayerSpec("ff_norm"),
    },
    attn_norm="pre",
    head=HeadSpec(call=llada_head, in_base_model=("model.transformer.ff_out",)),
    final_norm="transformer.ln_f",
    run_whole_model="LLaDAModel applies ln_f and the output layer itself and returns logits, no last_hidden_state",
    subset_block=llada_subset,
    notes="masked diffusion LM (remote code, loaded with --trust-remote-code through AutoModel): Llama-style "
          "pre-norm blocks under LLaDA's names (attn_norm, q/k/v_proj, attn_out, ff_norm, ff_proj gate, up_proj, "
          "ff_out), RMS norm gains split by role exactly, rotary positions, bidirectional attention, unshifted "
          "head; the whole model runs to record (the base model returns logits); sparse last block",
)
