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

from dataclasses import dataclass

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


__all__ = ["FUSED_PARAMS", "ExpertsSpec", "leading_experts"]
