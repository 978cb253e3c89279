"""Auxiliary router losses (issue 61, part 2): ``RecorderConfig(router_aux_loss=...)`` adds the model's own
load-balancing term to the loss on the tiny OLMoE, Mixtral, Qwen3-MoE and Qwen2-MoE models.

Checked against autograd: the term is the one the model's forward returns (``aux_loss``, times its
``router_aux_loss_coef``); the roles of every router and experts weight sum to autograd's gradient of
``loss + coef * aux`` (float32: 1e-5 of its norm, the MoE family tests' tolerance); the last block's router then gets
gradient from context positions (and exactly 0.0 without the option), its experts still exactly 0.0 (nothing the
term reads comes after them); the measured norms equal an aux-only and a loss-only backward.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn
from transformers import AutoConfig

from gradflow import GradFlowRecorder, RecorderConfig
from gradflow.adapters import adapter_for
from gradflow.errors import GradflowError, RouterAuxLossError
from gradflow.losses import get_loss
from gradflow.roles import Role
from tiny import MOE_FAMILIES, tiny_batch, tiny_model, tiny_moe_model

FUSED = ("ffn.experts.gate_up_proj", "ffn.experts.down_proj")
NON_LOSS = ("context", "special", "pad")
MODES = ("gradflow-forward", "recompute")


def _adapter(family: str, mode: str):
    if mode == "gradflow-forward":
        return None
    registered = adapter_for(AutoConfig.for_model(family))
    return replace(registered, experts={n: replace(e, own_forward=False) for n, e in registered.experts.items()})


def _weights(model: nn.Module, depth: int) -> dict[str, torch.Tensor]:
    mlp = model.model.layers[depth].mlp
    return {"ffn.router": mlp.gate.weight, "ffn.experts.gate_up_proj": mlp.experts.gate_up_proj,
            "ffn.experts.down_proj": mlp.experts.down_proj}


def _losses(model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(the MLM loss, coef * the model's own aux loss) from one forward of the model itself."""
    out = model(**batch.model_inputs(), output_router_logits=True)
    return get_loss("mlm", "batch")(out.logits, batch), model.config.router_aux_loss_coef * out.aux_loss


def _record(model, batch, aux="model", mode="gradflow-forward", family="olmoe"):
    config = RecorderConfig(materialize=True, router_aux_loss=aux)
    with GradFlowRecorder(model, config, adapter=_adapter(family, mode)) as rec:
        return rec.record(batch)


def _total(record, depth: int, name: str) -> torch.Tensor:
    parts = [m for (d, n, p, _), m in record.matrices.items() if (d, n, p) == (depth, name, "weight")]
    return torch.stack(parts).sum(0)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_term_is_the_models_own(family):
    model = tiny_moe_model(family)
    batch = tiny_batch()
    record = _record(model, batch)
    with torch.no_grad():
        loss, aux = _losses(model, batch)
    assert model.config.router_aux_loss_coef > 0 and float(aux) > 0
    assert record.aux_loss == pytest.approx(float(aux), rel=1e-6)
    assert record.loss == pytest.approx(float(loss), rel=1e-6)  # the loss recorded is the MLM loss alone


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_roles_sum_to_autograd_with_the_term(family, mode):
    """The term's gradient at a router row is attributed to the row's position: the roles sum to autograd's
    gradient of loss + coef * aux; the last block's router gets context gradient, its experts none."""
    model = tiny_moe_model(family)
    batch = tiny_batch()
    record = _record(model, batch, mode=mode, family=family)
    model.zero_grad()
    loss, aux = _losses(model, batch)
    (loss + aux).backward()
    for depth in range(2):
        for name, param in _weights(model, depth).items():
            error = float((_total(record, depth, name) - param.grad).norm())
            assert error <= 1e-5 * float(param.grad.norm()), (family, mode, depth, name, error)
    last = {s.sublayer: s for s in record.sublayers if s.depth == 1}
    assert last["ffn.router"].contribution_norm[int(Role.CONTEXT)].item() > 0
    assert last["ffn.router"].contribution_norm[int(Role.SPECIAL)].item() > 0
    assert torch.count_nonzero(record.matrices[(1, "ffn.router", "weight", "pad")]) == 0  # masked out of the term
    for name in FUSED:
        for role in NON_LOSS:
            assert torch.count_nonzero(record.matrices[(1, name, "weight", role)]) == 0, (name, role)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_without_the_option_the_last_router_is_exactly_zero_off_loss(family):
    model = tiny_moe_model(family)
    batch = tiny_batch()
    with GradFlowRecorder(model, RecorderConfig(materialize=True)) as rec:
        record = rec.record(batch)
    assert record.aux_loss is None and record.router_aux == {}
    router = next(s for s in record.sublayers if (s.depth, s.sublayer) == (1, "ffn.router"))
    for role in NON_LOSS:
        assert router.contribution_norm[int(Role[role.upper()])].item() == 0.0
        assert torch.count_nonzero(record.matrices[(1, "ffn.router", "weight", role)]) == 0
    assert router.contribution_norm[int(Role.MASKED)].item() > 0


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_measured_norms_equal_an_aux_only_and_a_loss_only_backward(family):
    model = tiny_moe_model(family)
    batch = tiny_batch()
    record = _record(model, batch)
    loss, aux = _losses(model, batch)
    params = [p for depth in range(2) for p in _weights(model, depth).values()]
    from_aux = torch.autograd.grad(aux, params, retain_graph=True, allow_unused=True)
    from_loss = torch.autograd.grad(loss, params)
    keys = [(depth, name, "weight") for depth in range(2) for name in _weights(model, depth)]
    assert set(record.router_aux) == set(keys)
    for key, g_aux, g_loss in zip(keys, from_aux, from_loss):
        norm_loss, norm_aux = record.router_aux[key]
        assert norm_loss == pytest.approx(float(g_loss.norm()), rel=1e-5), key
        if key[0] == 1 and key[1] in FUSED:  # the last block's experts: nothing the term reads comes after them
            assert g_aux is None or torch.count_nonzero(g_aux) == 0
            assert norm_aux == 0.0, key
        else:
            assert norm_aux == pytest.approx(float(g_aux.norm()), rel=1e-5), key
            assert norm_aux > 0, key


def test_a_coefficient_overrides_the_models():
    model = tiny_moe_model("olmoe")
    batch = tiny_batch()
    own, doubled = _record(model, batch), _record(model, batch, aux=2 * model.config.router_aux_loss_coef)
    assert doubled.aux_loss == pytest.approx(2 * own.aux_loss, rel=1e-6)
    for key, (norm_loss, norm_aux) in own.router_aux.items():
        assert doubled.router_aux[key][0] == pytest.approx(norm_loss, rel=1e-6)
        assert doubled.router_aux[key][1] == pytest.approx(2 * norm_aux, rel=1e-5, abs=0.0)
    zero = _record(model, batch, aux=0.0)
    assert zero.aux_loss == 0.0 and all(norm_aux == 0.0 for _, norm_aux in zero.router_aux.values())
    router = next(s for s in zero.sublayers if (s.depth, s.sublayer) == (1, "ffn.router"))
    assert router.contribution_norm[int(Role.CONTEXT)].item() == 0.0


def test_a_model_without_a_router_is_refused_in_one_sentence():
    with pytest.raises(RouterAuxLossError) as caught:
        GradFlowRecorder(tiny_model("bert"), RecorderConfig(router_aux_loss="model"))
    message = str(caught.value)
    assert isinstance(caught.value, GradflowError) and "\n" not in message and message.count(". ") == 0
    assert "'bert'" in message and message.endswith("drop the option")
