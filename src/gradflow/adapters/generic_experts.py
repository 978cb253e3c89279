"""The generic adapter's view of mixtures of experts: experts and routers found during its probe forward.

In a discovered block (:mod:`gradflow.adapters.generic`) two kinds of module hold experts:

- a module holding 3-D parameters with one leading experts dimension E > 1 (:func:`leading_experts`): split when it
  holds ``gate_up_proj`` and ``down_proj`` and every probe call passed the routing (hidden rows (N, H), integer top-k
  indices (N, k), float top-k weights (N, k)); otherwise it is reported as not split, with the reason, and recording
  its split is refused (``ExpertsSpec.unsplittable``);
- an ``nn.ModuleList`` of at least two modules of one class holding Linears, each called on fewer rows than the
  block has positions (a gather of the rows routed to it): split, the Linears named by their path in one expert.

A router is a module the block calls once on its (B * T, H) rows (a ``flat`` sublayer): an ``nn.Linear``, or a
module without submodules whose only parameter is a 2-D ``weight`` and whose first output is ``F.linear`` of its
input (checked on the probe call, bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from gradflow.adapters.experts import FUSED_PARAMS, ExpertsSpec, leading_experts


def router_like(module: nn.Module) -> bool:
    """A module without submodules whose only direct parameter is a 2-D ``weight`` (not a Linear or Embedding)."""
    if isinstance(module, (nn.Linear, nn.Embedding)) or next(module.children(), None) is not None:
        return False
    params = dict(module.named_parameters(recurse=False))
    return set(params) == {"weight"} and params["weight"].dim() == 2


def computes_linear(module: nn.Module, x: torch.Tensor, output: object) -> bool:
    """Whether ``output`` (or its first element) is ``F.linear(x, module.weight)`` exactly."""
    out = output[0] if isinstance(output, (tuple, list)) and output else output
    weight = getattr(module, "weight", None)
    if not isinstance(out, torch.Tensor) or not isinstance(weight, torch.Tensor) or x.shape[-1] != weight.shape[-1]:
        return False
    expected = F.linear(x, weight)
    return out.shape == expected.shape and torch.equal(out, expected)


def _routed(args: tuple, kwargs: dict) -> bool:
    values = [*args, *kwargs.values()]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if len(tensors) < 3:
        return False
    hidden, index, weights = tensors[:3]
    return (hidden.dim() == 2 and not index.is_floating_point() and weights.is_floating_point()
            and index.shape == weights.shape and index.dim() == 2 and index.shape[0] == hidden.shape[0])


@dataclass
class ExpertProbe:
    """Hooks of the probe forward on every experts candidate of ``base``: per module, whether each call passed the
    routing (fused) or how many rows each expert received (list)."""

    fused: dict[int, list[bool]] = field(default_factory=dict)
    lists: dict[int, list[int]] = field(default_factory=dict)

    def install(self, base: nn.Module) -> list:
        handles = []
        for module in base.modules():
            if leading_experts(module) is not None:
                self.fused[id(module)] = []
                handles.append(module.register_forward_pre_hook(self._fused_call, with_kwargs=True))
            elif isinstance(module, nn.ModuleList) and _expert_list(module):
                self.lists[id(module)] = []
                for child in module:
                    handles.append(child.register_forward_pre_hook(self._list_call(id(module)), with_kwargs=True))
        return handles

    def _fused_call(self, module, args, kwargs) -> None:
        self.fused[id(module)].append(_routed(args, kwargs))

    def _list_call(self, key: int):
        def hook(module, args, kwargs) -> None:
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            self.lists[key].append(int(x.reshape(-1, x.shape[-1]).shape[0]) if x is not None else -1)
        return hook


def _expert_list(module: nn.ModuleList) -> bool:
    children = list(module)
    return (len(children) >= 2 and len({type(c) for c in children}) == 1
            and any(isinstance(m, nn.Linear) for m in children[0].modules()))


def find_experts(block: nn.Module, probe: ExpertProbe, positions: int
                 ) -> tuple[dict[str, ExpertsSpec], list[str]]:
    """(experts name -> spec, 'path (Class): why' of expert modules not split) of one block; ``positions``: the
    probe's B * T. An experts name is the module's path in the block."""
    found: dict[str, ExpertsSpec] = {}
    refused: list[str] = []
    for path, module in block.named_modules():
        calls = probe.fused.get(id(module))
        if calls is not None:
            params = [getattr(module, name, None) for name in FUSED_PARAMS]
            fused = all(isinstance(p, torch.Tensor) and p.dim() == 3 for p in params)
            if fused and calls and all(calls) and not getattr(module, "has_bias", False):
                found[path] = ExpertsSpec(path, transposed=bool(getattr(module, "is_transposed", False)))
                continue
            why = ("its forward does not receive the routing (hidden rows, top-k indices, top-k weights), so which "
                   "rows each expert got is not visible" if fused else
                   f"its 3-D parameters are not the fused layout ({' and '.join(FUSED_PARAMS)} without biases)")
            reason = f"the experts module {path!r} ({type(module).__name__}) cannot be split by role: {why}"
            found[path] = ExpertsSpec(path, unsplittable=reason)
            refused.append(f"{path} ({type(module).__name__}: {why})")
            continue
        rows = probe.lists.get(id(module))
        if rows and all(0 <= r < positions for r in rows):
            first = next(iter(module))
            linears = tuple(name for name, m in first.named_modules() if isinstance(m, nn.Linear))
            found[path] = ExpertsSpec(path, layout="list", linears=linears)
    return found, refused


def inside(path: str, experts: dict[str, ExpertsSpec]) -> bool:
    """Whether the module at ``path`` (in a block) is one of the experts or inside them."""
    return any(path == name or path.startswith(name + ".") for name in experts)


__all__ = ["ExpertProbe", "computes_linear", "find_experts", "inside", "router_like"]
