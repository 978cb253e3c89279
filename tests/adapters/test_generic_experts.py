"""The generic adapter (``adapter="auto"``) on mixtures of experts (:mod:`gradflow.adapters.generic_experts`).

It finds fused 3-D experts and ModuleLists of experts in layouts it has no adapter for, names the router and the
shared expert (modules run on the (B * T, H) rows) as flat sublayers, and the split it records sums to autograd with
exact zeros at the last block. Experts whose routing it cannot see are named, with the reason, in one sentence of its
notice, and recording their split is refused with an ExpertLayoutError (sites only with ``sublayers=False``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradflow import GradFlowRecorder, RecorderConfig
from gradflow.adapters.experts import ExpertsSpec
from gradflow.adapters.generic import discover_adapter
from gradflow.errors import ExpertLayoutError
from gradflow.losses import get_loss
from gradflow.roles import Role
from tiny import list_moe_model, tiny_batch, tiny_moe_model

NON_LOSS = (Role.CONTEXT, Role.SPECIAL, Role.PAD)


def _record_and_autograd(model: nn.Module):
    batch = tiny_batch()
    with GradFlowRecorder(model, RecorderConfig(materialize=True), adapter="auto") as rec:
        record = rec.record(batch)
    model.zero_grad()
    get_loss("mlm", "batch")(model(**batch.model_inputs()).logits, batch).backward()
    return rec.adapter, record


def _total(record, depth: int, name: str, param: str = "weight") -> torch.Tensor:
    return torch.stack([m for (d, n, p, _), m in record.matrices.items() if (d, n, p) == (depth, name, param)]).sum(0)


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
def test_auto_finds_fused_experts_and_router(family, capsys):
    model = tiny_moe_model(family)
    adapter, record = _record_and_autograd(model)
    assert adapter.experts == {"mlp.experts": ExpertsSpec("mlp.experts")}
    assert adapter.sublayers["mlp.gate"].flat and adapter.sublayers["mlp.gate"].acts_as == "linear"
    notice = capsys.readouterr().err
    assert "mlp.experts.gate_up_proj, mlp.experts.down_proj. Not split: nothing." in notice
    for depth, layer in enumerate(model.model.layers):
        params = {"mlp.experts.gate_up_proj": layer.mlp.experts.gate_up_proj,
                  "mlp.experts.down_proj": layer.mlp.experts.down_proj, "mlp.gate": layer.mlp.gate.weight}
        if family == "qwen2_moe":
            params.update({f"mlp.shared_expert.{n}": getattr(layer.mlp.shared_expert, n).weight
                           for n in ("gate_proj", "up_proj", "down_proj")})
            params["mlp.shared_expert_gate"] = layer.mlp.shared_expert_gate.weight
        for name, param in params.items():
            error = float((_total(record, depth, name) - param.grad).norm())
            assert error <= 1e-5 * float(param.grad.norm()), (depth, name, error)
    last = [s for s in record.sublayers if s.depth == 1 and s.sublayer.startswith("mlp.")]
    assert len(last) == len(params)
    for s in last:
        for role in NON_LOSS:
            assert s.contribution_norm[int(role)].item() == 0.0, (s.sublayer, role)


def test_auto_finds_a_module_list_of_experts(capsys):
    model = list_moe_model()
    adapter, record = _record_and_autograd(model)
    assert adapter.experts == {"mlp.experts": ExpertsSpec("mlp.experts", layout="list", linears=("w1", "w3", "w2"))}
    assert adapter.sublayers["mlp.gate"].flat and adapter.sublayers["mlp.gate"].acts_as is None
    assert "Not split: nothing." in capsys.readouterr().err
    for depth, layer in enumerate(model.model.layers):
        expected = torch.stack([e.w2.weight.grad if e.w2.weight.grad is not None else torch.zeros_like(e.w2.weight)
                                for e in layer.mlp.experts])
        error = float((_total(record, depth, "mlp.experts.w2") - expected).norm())
        assert error <= 1e-5 * float(expected.norm())
    assert record.expert_counts[(1, "mlp.experts")].sum() == tiny_batch().roles.numel() * 2


class InternalMoe(nn.Module):
    """Fused 3-D experts that route inside their own forward: the rows each expert gets are not visible."""

    def __init__(self, fused: nn.Module):
        super().__init__()
        self.router = nn.Parameter(fused.gate.weight.detach().clone())
        self.gate_up_proj = nn.Parameter(fused.experts.gate_up_proj.detach().clone())
        self.down_proj = nn.Parameter(fused.experts.down_proj.detach().clone())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, t, h = hidden.shape
        x = hidden.reshape(-1, h)
        weights, index = torch.topk(torch.softmax(x @ self.router.T, dim=-1), 2, dim=-1)
        out = torch.zeros_like(x)
        for slot in range(2):
            gate, up = torch.einsum("nh,noh->no", x, self.gate_up_proj[index[:, slot]]).chunk(2, dim=-1)
            inner = torch.nn.functional.silu(gate) * up
            out = out + weights[:, slot, None] * torch.einsum("ni,nhi->nh", inner, self.down_proj[index[:, slot]])
        return out.view(b, t, h)


def internal_moe_model() -> nn.Module:
    model = tiny_moe_model("olmoe")
    for layer in model.model.layers:
        layer.mlp = InternalMoe(layer.mlp)
    return model


def test_auto_names_experts_it_cannot_split_and_recording_refuses(capsys):
    model = internal_moe_model()
    adapter = discover_adapter(model)
    notice = capsys.readouterr().err
    assert "Not split: mlp (InternalMoe: its forward does not receive the routing (hidden rows, top-k indices, " \
           "top-k weights), so which rows each expert got is not visible)" in notice
    assert adapter.experts["mlp"].unsplittable is not None
    with pytest.raises(ExpertLayoutError, match=r"^the experts module 'mlp' \(InternalMoe\) cannot be split by role: "
                                                r".*record with --norms-only"):
        GradFlowRecorder(model, adapter=adapter).__enter__()
    with GradFlowRecorder(model, RecorderConfig(sublayers=False), adapter=adapter) as rec:  # sites only: records
        record = rec.record(tiny_batch())
    assert record.sublayers == [] and record.grad_norm.shape[0] == 3


def test_coverage_lists_the_tested_moe_families():
    from gradflow.adapters.coverage import MOE_FAMILIES as LISTED
    from tiny import MOE_FAMILIES

    assert LISTED == MOE_FAMILIES


def test_router_names_registered_generic_and_dense():
    """``Adapter.router_names``: the registered MoE adapters' ``ffn.router``, the generic adapter's router by module
    path (found by its one output per expert), nothing for a dense model."""
    from gradflow.adapters import adapter_for
    from tests.tiny import tiny_model, tiny_moe_model

    assert adapter_for(tiny_moe_model("olmoe")).router_names() == ("ffn.router",)
    assert adapter_for(tiny_model("bert")).router_names() == ()
