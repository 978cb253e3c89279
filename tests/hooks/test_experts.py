"""Mixture-of-experts weights split by role (:mod:`gradflow.hooks.experts`).

On tiny MoE models of transformers 5.x (fused 3-D experts; the eager loop, ``batched_mm`` and ``grouped_mm``
implementations) and on a hand-built ModuleList of Linear experts: the roles' contributions sum to autograd's
gradient (float64 models: to far inside the float32 rounding bound of the sum over routed rows; float32 models:
within the float32 rounding bound of the recomputed chain), the last block's experts and router get exactly 0.0 from
positions without a loss, the per-expert role counts equal a hand count of the routing, and no hook survives.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig

from gradflow import GradFlowRecorder, RecorderConfig
from gradflow.adapters import adapter_for
from gradflow.adapters.base import SublayerSpec
from gradflow.adapters.experts import ExpertsSpec
from gradflow.adapters.moe import OLMOE
from gradflow.errors import ExpertLayoutError
from gradflow.hooks.batch_state import BatchState
from gradflow.hooks.experts import finish_experts, fused_stats, gram_cheaper
from gradflow.losses import get_loss
from gradflow.roles import ALL_ROLES, Role
from rounding import gamma
from tiny import EXPERTS_IMPLEMENTATIONS, MOE_FAMILIES, list_moe_model, tiny_batch, tiny_moe_model

NON_LOSS = ("context", "special", "pad")
MODES = ("gradflow-forward", "recompute")  # gradflow runs the fused experts itself, or the model's implementation


def _adapter(family: str, mode: str):
    """None (the registered adapter: gradflow runs the experts) or the same with ``own_forward=False``."""
    if mode == "gradflow-forward":
        return None
    registered = adapter_for(AutoConfig.for_model(family))
    return replace(registered, experts={n: replace(e, own_forward=False) for n, e in registered.experts.items()})
FUSED = ("ffn.experts.gate_up_proj", "ffn.experts.down_proj")


def _autograd(model: nn.Module, batch) -> None:
    model.zero_grad()
    get_loss("mlm", "batch")(model(**batch.model_inputs()).logits, batch).backward()


def _routing(model: nn.Module, batch) -> dict[int, torch.Tensor]:
    """depth -> the (B * T, k) top-k expert indices each block's experts received (a forward of its own)."""
    seen: dict[int, torch.Tensor] = {}
    handles = [layer.mlp.experts.register_forward_hook(
        lambda mod, args, out, depth=depth: seen.__setitem__(depth, args[1].detach().clone()))
        for depth, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(**batch.model_inputs())
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _hand_count(index: torch.Tensor, roles: torch.Tensor, experts: int) -> torch.Tensor:
    counts = torch.zeros(experts, len(ALL_ROLES), dtype=torch.long)
    flat = roles.reshape(-1).tolist()
    for position, row in enumerate(index.tolist()):
        for expert in row:
            counts[expert, flat[position]] += 1
    return counts


def _total(record, depth: int, name: str, param: str = "weight") -> torch.Tensor:
    parts = [m for (d, n, p, _), m in record.matrices.items() if (d, n, p) == (depth, name, param)]
    assert parts, (depth, name, param)
    return torch.stack(parts).sum(0)


def _expert_params(model: nn.Module, depth: int) -> dict[str, torch.Tensor]:
    mlp = model.model.layers[depth].mlp
    return {"ffn.experts.gate_up_proj": mlp.experts.gate_up_proj, "ffn.experts.down_proj": mlp.experts.down_proj,
            "ffn.router": mlp.gate.weight}


def _split_float64(model: nn.Module, batch) -> dict:
    """The fused experts' split of a float64 model (the recorder records float32 and low precision: this drives
    :func:`fused_stats` from hooks of its own), with autograd's gradients left in ``.grad``."""
    state = BatchState.start(RecorderConfig(materialize=True), batch.roles, None, 1)
    spec = ExpertsSpec("mlp.experts")

    def hook(mod, args, out, depth):
        hidden, index, weights = (a.detach() for a in args)
        out.register_hook(lambda g: fused_stats(state, depth, "ffn.experts", spec, mod, hidden, index, weights, g))

    handles = [layer.mlp.experts.register_forward_hook(lambda m, a, o, d=d: hook(m, a, o, d))
               for d, layer in enumerate(model.model.layers)]
    try:
        _autograd(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    finish_experts(state)
    return state.matrices


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])  # torch's grouped matmul has no float64 kernel
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_fused_experts_split_sums_to_autograd_float64(family, implementation):
    """In float64 the recomputed products are autograd's to ~1e-16 relative: the split's sum is within float32's
    rounding bound of the sum over the routed rows (2 gamma_n max |grad|, n = B * T * k), by a wide margin."""
    model = tiny_moe_model(family, experts_implementation=implementation, dtype=torch.float64)
    assert model.model.layers[0].mlp.experts.config._experts_implementation == implementation
    batch = tiny_batch()
    matrices = _split_float64(model, batch)
    n = int(batch.roles.numel()) * 2
    for depth, layer in enumerate(model.model.layers):
        for name in FUSED:
            param = getattr(layer.mlp.experts, name.rsplit(".", 1)[1])
            parts = [m for (d, s, p, _), m in matrices.items() if (d, s) == (depth, name)]
            total = torch.stack(parts).sum(0)
            assert float(param.grad.abs().max()) > 0
            assert float((total - param.grad).abs().max()) <= 2 * gamma(n) * float(param.grad.abs().max()), \
                (family, implementation, depth, name)
            if depth == 1:  # the last block: nothing from positions without a loss
                for role in NON_LOSS:
                    assert torch.count_nonzero(matrices[(depth, name, "weight", role)]) == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("implementation", EXPERTS_IMPLEMENTATIONS)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_recorded_split_sums_to_autograd_float32(family, implementation, mode):
    """The recorder on a float32 model (experts recomputed in float32, the router split by the Linear machinery):
    the roles' sum is autograd's gradient to the family tests' tolerance (1e-5 of its norm: float32 products whose
    upstream gradients ``rec.record()``'s sparse head computes on other rows)."""
    model = tiny_moe_model(family, experts_implementation=implementation)
    batch = tiny_batch()
    with GradFlowRecorder(model, RecorderConfig(materialize=True), adapter=_adapter(family, mode)) as rec:
        record = rec.record(batch)
    _autograd(model, batch)
    for depth in range(2):
        for name, param in _expert_params(model, depth).items():
            error = float((_total(record, depth, name) - param.grad).norm())
            assert error <= 1e-5 * float(param.grad.norm()), (family, implementation, depth, name, error)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("implementation", EXPERTS_IMPLEMENTATIONS)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_last_block_experts_and_router_exactly_zero_off_loss(family, implementation, mode):
    model = tiny_moe_model(family, experts_implementation=implementation)
    batch = tiny_batch()
    with GradFlowRecorder(model, RecorderConfig(materialize=True), adapter=_adapter(family, mode)) as rec:
        record = rec.record(batch)
    last = [s for s in record.sublayers if s.depth == 1]
    names = {s.sublayer for s in last}
    assert {*FUSED, "ffn.router"} <= names
    after = set(rec.adapter.after_mixing())
    assert {*FUSED, "ffn.router"} <= after
    for s in last:
        if s.sublayer not in after:
            continue
        for role in NON_LOSS:
            code = int(Role[role.upper()])
            assert s.contribution_norm[code].item() == 0.0, (s.sublayer, role)
            assert s.n_nonzero[code].item() == 0.0, (s.sublayer, role)
            assert torch.count_nonzero(record.matrices[(1, s.sublayer, s.param, role)]) == 0
        assert s.contribution_norm[int(Role.MASKED)].item() > 0, s.sublayer
    first = {s.sublayer: s for s in record.sublayers if s.depth == 0}
    for name in FUSED:  # earlier blocks: context positions do send gradient to the experts
        assert first[name].contribution_norm[int(Role.CONTEXT)].item() > 0


@pytest.mark.parametrize("model_fn", [tiny_moe_model, list_moe_model], ids=["fused", "list"])
def test_gram_norms_equal_materialised_norms(model_fn):  # fused: the recompute mode (Gram norms are its own)
    """Without materialised matrices a role's norm comes from its Gram matrices where cheaper: the same norms (1e-4
    relative, as the family tests), the same exact zeros."""
    model = model_fn("olmoe") if model_fn is tiny_moe_model else model_fn()
    adapter = LIST_ADAPTER if model_fn is list_moe_model else _adapter("olmoe", "recompute")
    batch = tiny_batch()
    frames = []
    for materialize in (True, False):
        with GradFlowRecorder(model, RecorderConfig(materialize=materialize), adapter=adapter) as rec:
            frames.append(rec.record(batch).sublayer_frame().set_index(["layer", "sublayer", "param", "role"]))
    a, b = frames
    assert a.index.equals(b.index) and any("experts" in name for name in a.index.get_level_values("sublayer"))
    torch.testing.assert_close(torch.tensor(b.contribution_norm.values), torch.tensor(a.contribution_norm.values),
                               rtol=1e-4, atol=1e-12)
    assert ((a.contribution_norm == 0) == (b.contribution_norm == 0)).all()
    torch.testing.assert_close(torch.tensor(b.magnitude_sum.values), torch.tensor(a.magnitude_sum.values))


def test_gram_is_cheaper_for_few_rows():
    assert gram_cheaper(10, 64, 32) and not gram_cheaper(100, 64, 32)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("implementation", EXPERTS_IMPLEMENTATIONS)
def test_per_expert_role_counts_equal_a_hand_count(implementation, mode):
    model = tiny_moe_model("olmoe", experts_implementation=implementation)
    batch = tiny_batch()
    routing = _routing(model, batch)
    with GradFlowRecorder(model, adapter=_adapter("olmoe", mode)) as rec:
        record = rec.record(batch)
    assert set(record.expert_counts) == {(0, "ffn.experts"), (1, "ffn.experts")}
    for depth, index in routing.items():
        expected = _hand_count(index, batch.roles, 4)
        assert torch.equal(record.expert_counts[(depth, "ffn.experts")], expected), depth
        assert int(expected.sum()) == batch.roles.numel() * 2


@pytest.mark.parametrize("mode", MODES)
def test_grouped_mm_runs_on_this_cpu(monkeypatch, mode):
    """The grouped implementation calls torch's grouped matmul here (torch >= 2.10 has a CPU kernel), so the tests
    above cover it, not a fallback, where the model's implementation runs (``own_forward=False``); when gradflow runs
    the experts itself during the capture, it does not run (and runs again after the capture)."""
    calls = []
    grouped = F.grouped_mm

    def spy(*args, **kwargs):
        calls.append(1)
        return grouped(*args, **kwargs)

    monkeypatch.setattr(F, "grouped_mm", spy)
    model = tiny_moe_model("olmoe", experts_implementation="grouped_mm")
    with GradFlowRecorder(model, adapter=_adapter("olmoe", mode)) as rec:
        rec.record(tiny_batch())
        assert len(calls) == (2 * 2 if mode == "recompute" else 0)  # gate/up and down, in each of 2 blocks
    with torch.no_grad():
        model(**tiny_batch().model_inputs())
    assert len(calls) == (2 * 2 if mode == "recompute" else 0) + 2 * 2


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_hooks_removed_after_recording_experts(family):
    model = tiny_moe_model(family)

    def count() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    before = count()
    with GradFlowRecorder(model) as rec:
        assert count() > before
        rec.record(tiny_batch())
    assert count() == before
    with pytest.raises(RuntimeError):
        with GradFlowRecorder(model):
            raise RuntimeError("injected")
    assert count() == before


# ---------------------------------------------------------------------------------------------- ModuleList experts

LIST_ADAPTER = replace(
    OLMOE, family="list-moe",
    sublayers={**{n: s for n, s in OLMOE.sublayers.items() if n != "ffn.router"},
               "ffn.router": SublayerSpec("mlp.gate", flat=True)},
    experts={"ffn.experts": ExpertsSpec("mlp.experts", layout="list", linears=("w1", "w3", "w2"))},
)


def _list_routing(model: nn.Module, batch) -> dict[int, torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}

    def hook(mod, args, out, depth):
        x = args[0].reshape(-1, args[0].shape[-1])
        seen[depth] = torch.topk(F.softmax(mod.gate(x), dim=-1), mod.k, dim=-1)[1]

    handles = [layer.mlp.register_forward_hook(lambda m, a, o, d=d: hook(m, a, o, d))
               for d, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(**batch.model_inputs())
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _grad(param: torch.Tensor) -> torch.Tensor:
    """``param.grad``; zeros for an expert no row was routed to (autograd leaves its gradient None)."""
    return param.grad if param.grad is not None else torch.zeros_like(param)


def test_list_experts_split_sums_to_autograd():
    """Each expert Linear's terms are its own input and output-gradient rows: the roles' sums add up to autograd's
    gradient to the family tests' tolerance (1e-5 of its norm; the recorder's sparse head computes the upstream
    gradient on other rows)."""
    model = list_moe_model()
    batch = tiny_batch()
    with GradFlowRecorder(model, RecorderConfig(materialize=True), adapter=LIST_ADAPTER) as rec:
        record = rec.record(batch)
    _autograd(model, batch)
    for depth, layer in enumerate(model.model.layers):
        pairs = [(f"ffn.experts.{path}", "weight", torch.stack([_grad(getattr(e, path).weight) for e in layer.mlp.experts]))
                 for path in ("w1", "w3", "w2")]
        pairs += [("ffn.experts.w2", "bias", torch.stack([_grad(e.w2.bias) for e in layer.mlp.experts])),
                  ("ffn.router", "weight", layer.mlp.gate.weight.grad)]
        for name, param, expected in pairs:
            error = float((_total(record, depth, name, param) - expected).norm())
            assert error <= 1e-5 * float(expected.norm()), (depth, name, param, error)
            assert float(expected.norm()) > 0


def test_list_experts_last_block_zero_and_counts():
    model = list_moe_model()
    batch = tiny_batch()
    routing = _list_routing(model, batch)
    with GradFlowRecorder(model, RecorderConfig(materialize=True), adapter=LIST_ADAPTER) as rec:
        record = rec.record(batch)
    last = {(s.sublayer, s.param): s for s in record.sublayers if s.depth == 1}
    for key in [("ffn.experts.w1", "weight"), ("ffn.experts.w3", "weight"), ("ffn.experts.w2", "weight"),
                ("ffn.experts.w2", "bias"), ("ffn.router", "weight")]:
        for role in NON_LOSS:
            assert last[key].contribution_norm[int(Role[role.upper()])].item() == 0.0, (key, role)
        assert last[key].contribution_norm[int(Role.MASKED)].item() > 0, key
    for depth, index in routing.items():
        assert torch.equal(record.expert_counts[(depth, "ffn.experts")], _hand_count(index, batch.roles, 4))


def test_fused_experts_without_routing_arguments_refused():
    """Experts called with the hidden rows only (routing inside): one ExpertLayoutError sentence, no traceback."""
    model = tiny_moe_model("olmoe")
    adapter = replace(OLMOE, experts={"ffn.experts": ExpertsSpec("mlp")})  # the MoE block: called with hidden only
    with GradFlowRecorder(model, adapter=adapter) as rec:
        with pytest.raises(ExpertLayoutError, match="was not called with the routing"):
            rec.record(tiny_batch())


@pytest.mark.parametrize("model_fn", [tiny_moe_model, list_moe_model], ids=["fused", "list"])
def test_split_under_loss_backward_sums_to_the_same_backwards_gradient(model_fn):
    """Under ``rec.capture`` and ``loss.backward()`` (the Linear router's weight gradient computed in the split
    products of :mod:`gradflow.hooks.split_linear`): the roles sum to the ``.grad`` of that very backward."""
    model = model_fn("olmoe") if model_fn is tiny_moe_model else model_fn()
    adapter = LIST_ADAPTER if model_fn is list_moe_model else None
    batch = tiny_batch()
    model.zero_grad(set_to_none=True)
    with GradFlowRecorder(model, RecorderConfig(materialize=True), adapter=adapter) as rec:
        with rec.capture(batch.roles):
            get_loss("mlm", "batch")(model(**batch.model_inputs()).logits, batch).backward()
        record = rec.result()
    for depth, layer in enumerate(model.model.layers):
        if model_fn is tiny_moe_model:
            params = {"ffn.router": layer.mlp.gate.weight, **{f"ffn.experts.{n}": getattr(layer.mlp.experts, n)
                                                              for n in ("gate_up_proj", "down_proj")}}
        else:
            params = {"ffn.router": layer.mlp.gate.weight}
            params.update({f"ffn.experts.{p}": torch.stack([_grad(getattr(e, p).weight) for e in layer.mlp.experts])
                           for p in ("w1", "w3", "w2")})
        for name, param in params.items():
            grad = param.grad if isinstance(param, nn.Parameter) else param
            error = float((_total(record, depth, name) - grad).norm())
            assert error <= 1e-5 * float(grad.norm()), (depth, name, error)
