"""The exact last-block zero and the exact decomposition, for every supported family."""

from __future__ import annotations

import pytest
import torch

from gradflow import GradFlowRecorder, RecorderConfig, mlm_loss
from gradflow.adapters import adapter_for, get_module
from gradflow.adapters.norms import splittable
from gradflow.hooks.sublayer_stats import split_by_role
from gradflow.roles import Role
from tiny import FAMILIES, PRE_LN, tiny_batch, tiny_model

NON_LOSS = (Role.CONTEXT, Role.SPECIAL, Role.PAD)


def _record(model, batch, loss="mlm", **config):
    with GradFlowRecorder(model, RecorderConfig(**config)) as rec:
        return rec.record(batch, loss=loss)


@pytest.fixture(scope="module", params=FAMILIES)
def family_run(request):
    model = tiny_model(request.param)
    batch = tiny_batch()
    record = _record(model, batch, materialize=True)
    return request.param, model, batch, record


def test_last_block_output_gradient_is_exactly_zero_off_loss(family_run):
    family, model, batch, record = family_run
    last = record.num_blocks - 1
    grad, _ = record.site(f"blocks.{last}.out")
    for role in NON_LOSS:
        assert torch.all(grad[batch.roles == role] == 0), (family, role)
    assert torch.all(grad[batch.roles == Role.MASKED] > 0)


def test_earlier_blocks_receive_context_gradient(family_run):
    family, model, batch, record = family_run
    context = batch.roles == Role.CONTEXT
    for depth in range(record.num_blocks - 1):
        for point in ("mid", "out"):
            grad, _ = record.site(f"blocks.{depth}.{point}")
            assert torch.all(grad[context] > 0), (family, depth, point)
    grad, _ = record.site("embeddings.out")
    assert torch.all(grad[context] > 0)


def test_last_block_context_contributions(family_run):
    family, model, batch, record = family_run
    adapter = adapter_for(model)
    frame = record.sublayer_frame()
    last = frame[(frame.layer == record.num_blocks) & (frame.role == "context")]
    zero = set(adapter.after_mixing())
    assert {"ffn.in", "ffn.out", "ffn.norm"} <= zero
    assert {"attn.q", "attn.out"} & set(adapter.sublayers) <= zero  # (FNet's mixing has no projections)
    assert ("attn.norm" in zero) == (family not in PRE_LN)
    for row in last.itertuples():
        if row.sublayer in zero:
            assert row.contribution_norm == 0.0 and row.magnitude_sum == 0.0 and row.n_nonzero == 0, (family, row)
    weights = last[last.param == "weight"].set_index("sublayer")
    for name in {"attn.k", "attn.v"} & set(adapter.sublayers):
        assert weights.loc[name, "contribution_norm"] > 0, (family, name)
        assert weights.loc[name, "n_nonzero"] > 0
    if family in PRE_LN:
        assert weights.loc["attn.norm", "contribution_norm"] > 0
    # the matrices themselves are exactly zero, not just small
    for (depth, name, param, role), matrix in record.matrices.items():
        if depth == record.num_blocks - 1 and role == "context" and name in zero:
            assert torch.count_nonzero(matrix) == 0


# pre-norm blocks with RMSNorm gains: input_layernorm feeds Q, K and V, post_attention_layernorm only the FFN
LLAMA_LIKE_ZERO = {"attn.q", "attn.out", "ffn.norm", "ffn.in", "ffn.gate", "ffn.out"}
LLAMA_LIKE_NONZERO = {"attn.k", "attn.v", "attn.norm"}


@pytest.mark.parametrize("family", ["eurobert", "ultrabert"])
def test_llama_like_last_block_zero_set(family):
    model = tiny_model(family)
    batch = tiny_batch()
    adapter = adapter_for(model)
    assert set(adapter.after_mixing()) == LLAMA_LIKE_ZERO
    assert set(adapter.sublayers) == LLAMA_LIKE_ZERO | LLAMA_LIKE_NONZERO
    last_block = GradFlowRecorder(model).blocks[-1]
    for name in ("attn.norm", "ffn.norm"):  # RMSNorm modules, split through the norm-like probe
        module = get_module(last_block, adapter.sublayers[name].path)
        assert not isinstance(module, torch.nn.LayerNorm) and splittable(module), (family, name)
    record = _record(model, batch, materialize=True)
    frame = record.sublayer_frame()
    last = frame[(frame.layer == record.num_blocks) & (frame.role == "context")].set_index(["sublayer", "param"])
    assert set(last.index) == {(name, "weight") for name in LLAMA_LIKE_ZERO | LLAMA_LIKE_NONZERO}  # no biases
    for name in LLAMA_LIKE_ZERO:
        row = last.loc[(name, "weight")]
        assert row.contribution_norm == 0.0 and row.magnitude_sum == 0.0 and row.n_nonzero == 0, (family, name)
        assert torch.count_nonzero(record.matrices[(record.num_blocks - 1, name, "weight", "context")]) == 0
    for name in LLAMA_LIKE_NONZERO:
        assert last.loc[(name, "weight"), "contribution_norm"] > 0, (family, name)


def test_earlier_blocks_context_share_positive(family_run):
    family, model, batch, record = family_run
    frame = record.sublayer_frame()
    early = frame[(frame.layer < record.num_blocks) & (frame.role == "context") & (frame.param == "weight")]
    assert (early.contribution_norm > 0).all(), family


def test_role_contributions_sum_to_autograd_grad(family_run):
    family, model, batch, record = family_run
    adapter = adapter_for(model)
    model.zero_grad(set_to_none=True)
    mlm_loss(model(**batch.model_inputs()).logits, batch).backward()
    blocks = GradFlowRecorder(model).blocks
    # the key bias's true gradient is 0 (softmax is shift-invariant): judge it against the model's scale
    floor = 1e-3 * max(float(p.grad.norm()) for p in model.parameters() if p.grad is not None)
    checked = 0
    for name, spec in adapter.sublayers.items():
        modules = {id(get_module(b, spec.path)): get_module(b, spec.path) for b in blocks}
        for module in modules.values():
            if not split_by_role(module, spec):  # Linear, LayerNorm, RMSNorm-like, pointwise Conv1d, acts_as
                continue
            depths = [d for d, b in enumerate(blocks) if get_module(b, spec.path) is module]
            for param in ("weight", "bias"):
                ref = getattr(module, param, None)  # RMSNorm has no bias attribute
                if ref is None:
                    continue
                ref = ref.grad
                if spec.chunk is not None:  # contiguous or interleaved rows (SublayerSpec.rows)
                    ref = ref[spec.rows(ref.shape[0], model.config)]
                # one module, one name per call (X-MOD's output.LayerNorm): the names' contributions add up
                names = {n for n, o in adapter.sublayers.items() if (o.path, o.chunk) == (spec.path, spec.chunk)}
                total = sum(m for (d, s, p, _), m in record.matrices.items()
                            if s in names and p == param and d in depths)
                scale = max(float(ref.norm()), floor)
                assert float((total - ref).norm()) <= 1e-5 * scale, (family, name, param)
                checked += 1
    assert checked >= 12


def test_gram_norms_equal_materialised_norms(family_run):
    family, model, batch, record = family_run
    plain = _record(model, batch)
    a = record.sublayer_frame().set_index(["layer", "sublayer", "param", "role"])
    b = plain.sublayer_frame().set_index(["layer", "sublayer", "param", "role"])
    assert a.index.equals(b.index)
    torch.testing.assert_close(torch.tensor(b.contribution_norm.values), torch.tensor(a.contribution_norm.values),
                               rtol=1e-4, atol=1e-12)
    torch.testing.assert_close(torch.tensor(b.magnitude_sum.values), torch.tensor(a.magnitude_sum.values))


def test_site_norms_match_hidden_states(family_run):
    family, model, batch, record = family_run
    blocks = []  # a model that appends positions (Longformer) cuts them from copies outside the loss's graph:
    appends = adapter_for(model).appends_padding  # then the gradient is taken at the blocks' own outputs
    handles = [block.register_forward_hook(lambda m, args, o: blocks.append(o[0] if isinstance(o, tuple) else o))
               for block in dict.fromkeys(GradFlowRecorder(model).blocks)] if appends else []
    try:
        out = model(**batch.model_inputs(), output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    hidden = out.hidden_states
    grads = torch.autograd.grad(mlm_loss(out.logits, batch), blocks[:-1] if appends else hidden[1:])
    grads = [g[:, :batch.roles.shape[1]] for g in grads]
    # HF's last hidden state is after the final norm in pre-LN models: compare the blocks before it
    for depth in range(record.num_blocks - 1):
        g, a = record.site(f"blocks.{depth}.out")
        torch.testing.assert_close(a, hidden[depth + 1].norm(dim=-1), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g, grads[depth].norm(dim=-1), rtol=1e-5, atol=1e-9)


def test_all_positions_loss_trains_last_block_on_context(family_run):
    family, model, batch, record = family_run
    allpos = _record(model, batch, loss="all-positions")
    last = record.num_blocks - 1
    grad, _ = allpos.site(f"blocks.{last}.out")
    assert torch.all(grad[batch.roles == Role.CONTEXT] > 0)
    frame = allpos.sublayer_frame()
    rows = frame[(frame.layer == record.num_blocks) & (frame.role == "context") & (frame.param == "weight")]
    assert (rows.contribution_norm > 0).all(), family
