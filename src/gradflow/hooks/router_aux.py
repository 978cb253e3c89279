"""Auxiliary router losses: the term a mixture-of-experts model's training adds to its loss, and its measured share.

transformers 5.x's MoE families add ``router_aux_loss_coef * load_balancing_loss`` to their loss, computed from the
router logits of every position (pad excluded by the attention mask). Its gradient reaches every position's router
logits, so the last block's router gets gradient from positions without a loss: with the term included
(``RecorderConfig(router_aux_loss=...)``, ``gradflow record --router-aux-loss``) the exact zero of the last block's
router holds no longer, while its experts keep it (nothing the aux loss reads comes after them).

Attribution: the term's gradient at a row of router logits belongs to the position the row came from, like every
other gradient the split sees (the per-role split is of the whole backward's gradient), so the roles still sum to
autograd's gradient of ``loss + coef * aux``. How much of each router's and experts' gradient is the term's is
measured apart (:func:`aux_norms`): the norm of each weight's gradient from the term alone and from the loss alone,
by two ``torch.autograd.grad`` calls on a forward of its own (outside the capture: the recorder's hooks are idle).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from gradflow.adapters import Adapter, get_module
from gradflow.adapters.experts import FUSED_PARAMS, RouterAuxSpec
from gradflow.errors import RouterAuxLossError

AuxKey = tuple[int, str, str]
"""(depth, sublayer, param): a router's or an experts weight's measured gradient."""


def router_aux_spec(adapter: Adapter, model: nn.Module) -> RouterAuxSpec:
    """The adapter's auxiliary-loss facts, or :class:`RouterAuxLossError` (one sentence) when it has none."""
    spec = adapter.router_aux
    if spec is None:
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise RouterAuxLossError(
            f"--router-aux-loss needs a mixture-of-experts model whose auxiliary router loss gradflow knows (OLMoE, "
            f"Mixtral, Qwen3-MoE, Qwen2-MoE), and {model_type!r} (adapter {adapter.family}) has none: drop the option")
    return spec


def aux_coefficient(spec: RouterAuxSpec, model: nn.Module, override: float | str) -> float:
    """``override`` as a float, or the model's own coefficient where it is ``"model"``."""
    return spec.coefficient(model.config) if override == "model" else float(override)


def forward_with_aux(call: Callable[[dict], tuple[torch.Tensor, object]], spec: RouterAuxSpec | None,
                     model: nn.Module, inputs: dict, coef: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``call(extra_kwargs) -> (loss, model output)`` run with the router logits asked for when ``spec`` is given;
    returns the loss and ``coef * aux`` (None without ``spec``)."""
    if spec is None:
        return call({})[0], None
    value, output = call({spec.logits_kwarg: True})
    aux = spec.loss(model, getattr(output, spec.logits_field), inputs.get("attention_mask"))
    return value, coef * aux.to(value.device)


def measured_weights(adapter: Adapter, blocks: Sequence[nn.Module], spec: RouterAuxSpec) -> dict[AuxKey, list]:
    """Per distinct block (its first depth): the router's parameters and every experts weight, by recorded name."""
    found: dict[AuxKey, list] = {}
    seen: set[int] = set()
    for depth, block in enumerate(blocks):
        if id(block) in seen:
            continue
        seen.add(id(block))
        router = adapter.sublayers.get(spec.router)
        if router is not None:
            for param, tensor in get_module(block, router.path).named_parameters():
                found[(depth, spec.router, param)] = [tensor]
        for name, experts in adapter.experts.items():
            try:
                module = get_module(block, experts.path)
            except LookupError:
                continue
            if experts.layout == "fused":
                for part, recorded in zip(FUSED_PARAMS, experts.names(name)):
                    found[(depth, recorded, "weight")] = [getattr(module, part)]
            else:
                for part, recorded in zip(experts.linears, experts.names(name)):
                    found[(depth, recorded, "weight")] = [get_module(expert, part).weight for expert in module]
    return {key: tensors for key, tensors in found.items() if all(t.requires_grad for t in tensors)}


def aux_norms(value: torch.Tensor, aux: torch.Tensor, weights: dict[AuxKey, list]) -> dict[AuxKey, tuple[float, float]]:
    """(depth, sublayer, param) -> (norm of the weight's gradient from ``value`` alone, from ``aux`` alone): two
    backward passes through one graph (the Frobenius norm over an experts weight's every expert, in float64)."""
    keys = list(weights)
    flat = [t for key in keys for t in weights[key]]
    from_aux = torch.autograd.grad(aux, flat, retain_graph=True, allow_unused=True)
    from_loss = torch.autograd.grad(value, flat, allow_unused=True)
    norms: dict[AuxKey, tuple[float, float]] = {}
    start = 0
    for key in keys:
        stop = start + len(weights[key])
        norms[key] = (_norm(from_loss[start:stop]), _norm(from_aux[start:stop]))
        start = stop
    return norms


def _norm(grads: Sequence[torch.Tensor | None]) -> float:
    total = sum(float(g.detach().double().pow(2).sum()) for g in grads if g is not None)
    return total ** 0.5


__all__ = ["AuxKey", "aux_coefficient", "aux_norms", "forward_with_aux", "measured_weights", "router_aux_spec"]
