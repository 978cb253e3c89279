"""Mixture-of-experts facts: where a block's experts are and how they are called (:class:`ExpertsSpec`).

An MoE block routes each position's row to ``k`` of ``E`` experts. An expert's weight gradient is a sum over
the rows routed to it, so it splits by the role of the position each row came from. Two layouts:

- ``"fused"`` (transformers 5.x: OLMoE, Mixtral, Qwen2-MoE, Qwen3-MoE, ...): one module holding 3-D parameters
  with a leading experts dimension, ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I) (``transposed``:
  (E, H, 2I) and (E, I, H)), called as ``experts(hidden (N, H), top_k_index (N, k), top_k_weights (N, k))``; the
  routing is read from the call, whichever experts implementation (eager loop, ``batched_mm``, ``grouped_mm``)
  runs inside;
- ``"list"``: an ``nn.ModuleList`` of expert modules, each called on the rows routed to it (a gather of the MoE
  block's input rows) and holding Linears (``linears``: their paths inside one expert).

The router (a Linear, or a module computing one: transformers 5's ``TopKRouter``) reads the MoE block's
(B * T, H) rows: it is an ordinary sublayer with ``SublayerSpec(..., acts_as="linear", flat=True)``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import nn

FUSED_PARAMS = ("gate_up_proj", "down_proj")
"""The fused layout's parameters, in call order."""


@dataclass(frozen=True)
class ExpertsSpec:
    """One block's experts: ``path`` (in the block) of the experts module and its ``layout`` (module docstring).

    ``linears``: with ``layout="list"``, the paths of the Linears inside one expert (``("w1", "w2", "w3")``);
    ``transposed``: with ``layout="fused"``, the parameters are stored (E, D_in, D_out); ``own_forward``: see the
    field; ``unsplittable``: why the module cannot be split (the generic adapter found expert parameters it cannot
    track the routing of): recording its split is refused with this reason (sites only with ``--norms-only``).
    """

    path: str
    layout: str = "fused"
    linears: tuple[str, ...] = ()
    transposed: bool = False
    unsplittable: str | None = None
    own_forward: bool = True
    """With ``layout="fused"``: gradflow may run the experts itself while a capture runs (the weight gradients as the
    sum of the per-role products: no extra product; :mod:`gradflow.hooks.split_experts`); False: the module's own
    implementation runs and the split recomputes the products it needs from the call and its output gradient."""

    def names(self, name: str) -> tuple[str, ...]:
        """The recorded sublayer names of the experts served as ``name`` (``ffn.experts``): one per parameter
        (fused: ``ffn.experts.gate_up_proj``, ``ffn.experts.down_proj``) or per Linear of an expert (list)."""
        parts = FUSED_PARAMS if self.layout == "fused" else self.linears
        return tuple(f"{name}.{part}" for part in parts)


@dataclass(frozen=True)
class RouterAuxSpec:
    """How a mixture-of-experts model computes its auxiliary router loss, read from the model's own code.

    transformers 5.x (5.25: OLMoE, Mixtral, Qwen3-MoE, Qwen2-MoE; no router z-loss in any of them): with
    ``output_router_logits=True`` the base model returns ``router_logits`` (one (B * T, E) tensor per block: the
    router's logits, the very tensor the router outputs), the causal LM computes the Switch Transformer
    load-balancing loss ``load_balancing_loss_func(router_logits, E, k, attention_mask)`` of its modeling module and
    adds ``router_aux_loss_coef * aux_loss`` to its loss. ``function``: that function's name in the module defining
    the model's class; ``coef``, ``top_k``: config attributes; ``experts``: the config attributes that may hold E
    (the first present); ``router``: the recorded name of the router sublayer whose logits the loss reads.
    """

    function: str = "load_balancing_loss_func"
    coef: str = "router_aux_loss_coef"
    experts: tuple[str, ...] = ("num_experts", "num_local_experts")
    top_k: str = "num_experts_per_tok"
    logits_kwarg: str = "output_router_logits"
    logits_field: str = "router_logits"
    router: str = "ffn.router"

    def coefficient(self, config) -> float:
        """The model's own coefficient of the auxiliary loss in its training loss."""
        return float(getattr(config, self.coef))

    def loss(self, model: nn.Module, router_logits: tuple[torch.Tensor, ...],
             attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The auxiliary loss (without its coefficient) as the model's own code computes it from ``router_logits``."""
        function = getattr(importlib.import_module(type(model).__module__), self.function)
        config = model.config
        experts = next(getattr(config, name) for name in self.experts if getattr(config, name, None) is not None)
        return function(tuple(router_logits), experts, getattr(config, self.top_k), attention_mask)


LOAD_BALANCING = RouterAuxSpec()
"""transformers 5.x's load-balancing loss (OLMoE, Mixtral, Qwen3-MoE, Qwen2-MoE)."""


def leading_experts(module: nn.Module) -> int | None:
    """E when ``module`` (no convolution) holds directly at least two 3-D parameters (an expert's input and output
    projections), all with the same leading dimension E > 1 (an experts dimension); else None."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return None
    shapes = [p.shape for p in module.parameters(recurse=False) if p.dim() == 3]
    sizes = {int(shape[0]) for shape in shapes}
    if len(shapes) < 2 or len(sizes) != 1:
        return None
    experts = sizes.pop()
    return experts if experts > 1 else None


__all__ = ["FUSED_PARAMS", "LOAD_BALANCING", "ExpertsSpec", "RouterAuxSpec", "leading_experts"]
