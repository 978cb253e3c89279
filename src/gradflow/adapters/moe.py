"""Mixture-of-experts families of transformers 5.x: OLMoE, Mixtral, Qwen3-MoE and Qwen2-MoE.

Each block is Llama's pre-norm block with the gated MLP replaced by a sparse MoE block ``mlp``: a router
``mlp.gate`` (transformers 5's ``TopKRouter``: a ``weight`` (E, H) applied as a Linear to the (B * T, H) rows,
then softmax and top-k; recorded as ``ffn.router``) and fused experts ``mlp.experts`` (``gate_up_proj`` (E, 2I, H),
``down_proj`` (E, H, I), called with the rows, top-k indices and weights; recorded as ``ffn.experts.gate_up_proj``
and ``ffn.experts.down_proj``, each split by the role of the rows routed to each expert:
:mod:`gradflow.adapters.experts`). Qwen2-MoE adds a shared expert (a gated MLP on every row: ``ffn.in``,
``ffn.gate``, ``ffn.out``) scaled by a sigmoid gate ``mlp.shared_expert_gate`` (``ffn.shared_gate``).

Their training adds ``router_aux_loss_coef`` times a load-balancing loss over every position's router logits
(``router_aux``: :class:`~gradflow.adapters.experts.RouterAuxSpec`; ``gradflow record --router-aux-loss``).

These are causal LMs (``*ForCausalLM``, no masked-LM class): gradflow records them as they are, attention causal,
under the MLM loss on their ``lm_head`` at the masked positions (the objective is the user's choice; the last
block's exact zero holds all the same: its router, experts and MLP read only their own position after the mixing).
"""

from __future__ import annotations

from dataclasses import replace

from gradflow.adapters.base import SublayerSpec
from gradflow.adapters.experts import LOAD_BALANCING, ExpertsSpec
from gradflow.adapters.llamalike import EUROBERT

_ATTENTION = {name: spec for name, spec in EUROBERT.sublayers.items() if name.startswith("attn.") or name == "ffn.norm"}
_ROUTER = {"ffn.router": SublayerSpec("mlp.gate", acts_as="linear", flat=True)}
_EXPERTS = {"ffn.experts": ExpertsSpec("mlp.experts")}

OLMOE = replace(
    EUROBERT,
    family="olmoe",
    model_types=("olmoe",),
    sublayers={**_ATTENTION, **_ROUTER},
    experts=_EXPERTS,
    after_mixing_extra=("ffn.router", "ffn.experts"),
    router_aux=LOAD_BALANCING,
    subset_block=None,
    notes="mixture of experts: pre-norm blocks with RMSNorm gains, a top-k router (ffn.router) and fused 3-D experts "
          "(ffn.experts.gate_up_proj, ffn.experts.down_proj) split by the role of the rows routed to each expert; a "
          "causal LM recorded as is under the MLM loss",
)

MIXTRAL = replace(OLMOE, family="mixtral", model_types=("mixtral",))
QWEN3_MOE = replace(OLMOE, family="qwen3_moe", model_types=("qwen3_moe",))
QWEN2_MOE = replace(
    OLMOE,
    family="qwen2_moe",
    model_types=("qwen2_moe",),
    sublayers={**_ATTENTION, **_ROUTER,
               "ffn.in": SublayerSpec("mlp.shared_expert.up_proj", flat=True),
               "ffn.gate": SublayerSpec("mlp.shared_expert.gate_proj", flat=True),
               "ffn.out": SublayerSpec("mlp.shared_expert.down_proj", flat=True),
               "ffn.shared_gate": SublayerSpec("mlp.shared_expert_gate", flat=True)},
    after_mixing_extra=("ffn.router", "ffn.experts", "ffn.shared_gate"),
    notes=OLMOE.notes + "; a shared expert (ffn.in, ffn.gate, ffn.out) on every row, scaled by ffn.shared_gate",
)
