"""DeBERTa v1, SqueezeBERT and I-BERT: interleaved rows, grouped pointwise convolutions, (output, scale) pairs.

The family tests (tests/hooks/test_recorder_families.py and the others run on every entry of the tiny
family table) certify the zeros and the sums; these tests check what is particular to the three:
the row rule against the model's own q/k/v split, the outside biases, exact per-role norms of
grouped convolutions against torch's own convolution backward, the (B, H, T) sites, I-BERT's float
mode against F.linear/F.layer_norm, the refusal of its quantised mode, and ``gradflow check``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig

from gradflow import GradFlowRecorder, RecorderConfig, mlm_loss
from gradflow.adapters import SublayerSpec, adapter_for, get_module
from gradflow.errors import SiteError, UnsupportedArchitectureError
from gradflow.hooks.sites import SiteLayer
from gradflow.roles import ALL_ROLES
from gradflow.runs.check import check_batch
from rounding import assert_within_rounding, gamma, sum_bound
from tiny import tiny_batch, tiny_model

FAMILIES = ("deberta", "squeezebert", "ibert")
BERT_ZERO = {"attn.q", "attn.out", "attn.norm", "ffn.in", "ffn.out", "ffn.norm"}


def _record(model, batch, **config):
    with GradFlowRecorder(model, RecorderConfig(**config)) as rec:
        return rec.record(batch), rec


# ---------------------------------------------------------------------------------------------- DeBERTa v1

def test_interleaved_rows_are_the_models_own_q_k_v():
    model = tiny_model("deberta")
    attention = model.deberta.encoder.layer[0].attention.self
    heads, width = model.config.num_attention_heads, model.config.hidden_size
    assert heads == 2
    h = torch.randn(2, 5, width)
    with torch.no_grad():
        qkv = attention.transpose_for_scores(attention.in_proj(h)).chunk(3, dim=-1)  # the model's split
        for i, name in enumerate(("attn.q", "attn.k", "attn.v")):
            spec = adapter_for(model).sublayers[name]
            rows = spec.rows(attention.in_proj.out_features, model.config)
            mine = F.linear(h, attention.in_proj.weight[rows])
            assert torch.equal(attention.transpose_for_scores(mine), qkv[i]), name
    # the rule itself: G groups of n parts, the i-th part of each group, group by group
    spec = SublayerSpec("p", chunk=(1, 3), interleave="heads")
    assert spec.rows(12, type("C", (), {"heads": 2})()).tolist() == [2, 3, 8, 9]
    assert SublayerSpec("p", chunk=(1, 3)).rows(12).tolist() == [4, 5, 6, 7]


def test_outside_biases_are_split_by_role_and_sum_to_autograd():
    model = tiny_model("deberta")
    with torch.no_grad():  # non-zero biases (they are initialised to zero)
        for layer in model.deberta.encoder.layer:
            layer.attention.self.q_bias.normal_(0, 0.1)
            layer.attention.self.v_bias.normal_(0, 0.1)
    batch = tiny_batch()
    record, _ = _record(model, batch, materialize=True)
    model.zero_grad(set_to_none=True)
    layers = model.deberta.encoder.layer
    seen = _inputs_and_grads(model, batch, dict(enumerate(layer.attention.self.in_proj for layer in layers)))
    last = record.num_blocks - 1
    for depth, layer in enumerate(layers):
        attention = layer.attention.self
        g = seen[depth][1].reshape(-1, attention.num_attention_heads, 3, attention.attention_head_size)  # q, k, v
        for name, bias, part in (("attn.q", attention.q_bias, 0), ("attn.v", attention.v_bias, 2)):
            total = sum(m for (d, s, p, _), m in record.matrices.items() if (d, s, p) == (depth, name, "bias"))
            # the roles' sums over 36 positions, autograd's in another order: their float32 rounding, plus rtol for
            # record()'s upstream gradient (its sparse head)
            rounding = sum_bound(g[:, :, part].reshape(g.shape[0], -1), dim=0)
            assert_within_rounding(total, bias.grad, rounding, f"{depth} {name}", rtol=1e-5, atol=1e-9)
    frame = record.sublayer_frame().set_index(["layer", "sublayer", "param", "role"])
    assert frame.loc[(last + 1, "attn.q", "bias", "context"), "contribution_norm"] == 0.0
    assert frame.loc[(last + 1, "attn.v", "bias", "context"), "contribution_norm"] > 0
    assert torch.count_nonzero(record.matrices[(last, "attn.q", "bias", "context")]) == 0


def test_relative_position_projections_get_only_relpos_gradient():
    """pos_proj (c2p) and pos_q_proj (p2c) map the relative-position embeddings: their whole gradient is
    relpos, in every block, and equals autograd's (pos_q_proj's output is scaled in place by the model:
    the recorder hands the model a copy of non-token outputs, so its hook still sees the gradient)."""
    model = tiny_model("deberta")
    batch = tiny_batch()
    extra = {"pos_k": SublayerSpec("attention.self.pos_proj"), "pos_q": SublayerSpec("attention.self.pos_q_proj")}
    adapter = replace(adapter_for(model), sublayers={**adapter_for(model).sublayers, **extra})
    with GradFlowRecorder(model, RecorderConfig(materialize=True), adapter=adapter) as rec:
        record = rec.record(batch)
    model.zero_grad(set_to_none=True)
    mlm_loss(model(**batch.model_inputs()).logits, batch).backward()
    for depth, layer in enumerate(model.deberta.encoder.layer):
        for name, module in (("pos_k", layer.attention.self.pos_proj), ("pos_q", layer.attention.self.pos_q_proj)):
            for param in ("weight", "bias"):
                keys = [k for k in record.matrices if k[:3] == (depth, name, param)]
                if getattr(module, param) is None:
                    assert not keys
                    continue
                assert [k[3] for k in keys] == ["relpos"], (name, param)
                ref = getattr(module, param).grad
                torch.testing.assert_close(record.matrices[keys[0]], ref, rtol=1e-5, atol=1e-10)
                assert float(ref.norm()) > 0
    result = check_batch(model, batch)
    rows = [p for p in result.params if p.sublayer in ("attention.self.pos_proj", "attention.self.pos_q_proj")]
    assert len(rows) == 9 and all(set(p.n_positions) == {"relpos"} and p.contribution["relpos"] > 0 for p in rows)
    assert result.unsplit == []  # q_bias, v_bias: attributed as attn.q's and attn.v's bias


# ---------------------------------------------------------------------------------------------- SqueezeBERT

def _inputs_and_grads(model, batch, modules):
    """Each module's input and output gradient under the MLM loss (hooks removed), e.g. a convolution's (B, C_in, T)
    and (B, C_out, T), a Linear's (B, T, D_in) and (B, T, D_out); the parameters' .grad is autograd's."""
    seen, handles = {}, []
    for key, module in modules.items():
        def hook(mod, args, out, key=key):
            seen[key] = [args[0].detach(), None]
            out.register_hook(lambda g, key=key: seen[key].__setitem__(1, g))
        handles.append(module.register_forward_hook(hook))
    try:
        mlm_loss(model(**batch.model_inputs()).logits, batch).backward()
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_grouped_conv_role_norms_equal_torch_conv_backward():
    model = tiny_model("squeezebert")
    batch = tiny_batch()
    adapter = adapter_for(model)
    block = model.transformer.encoder.layers[-1]
    modules = {name: get_module(block, adapter.sublayers[name].path) for name in ("attn.q", "attn.k", "ffn.in",
                                                                                    "ffn.out", "attn.out")}
    assert {name: m.groups for name, m in modules.items()} == {"attn.q": 4, "attn.k": 4, "ffn.in": 4, "ffn.out": 4,
                                                               "attn.out": 1}
    record, _ = _record(model, batch, materialize=True)
    seen = _inputs_and_grads(model, batch, modules)
    frame = record.sublayer_frame().set_index(["layer", "sublayer", "param", "role"])
    roles = batch.roles
    checked = 0
    for name, module in modules.items():
        x, g = seen[name]
        for code, role in enumerate(ALL_ROLES):
            keep = (roles == code)
            if not keep.any():
                continue
            # torch's own weight gradient of the convolution, the gradient kept at this role's positions only
            ref = torch.nn.grad.conv1d_weight(x, module.weight.shape, g * keep[:, None, :], groups=module.groups)
            mine = record.matrices[(record.num_blocks - 1, name, "weight", role)]
            # sums over the 36 positions in two orders: their float32 rounding 2 gamma_36 sum |g| |x| (the same
            # convolution on magnitudes), plus rtol for record()'s upstream gradient (its sparse head)
            terms = torch.nn.grad.conv1d_weight(x.double().abs(), module.weight.shape,
                                                (g * keep[:, None, :]).double().abs(), groups=module.groups)
            rounding = 2 * gamma(x.shape[0] * x.shape[2]) * terms
            assert_within_rounding(mine, ref, rounding, f"{name} {role}", rtol=1e-5, atol=1e-10)
            row = frame.loc[(record.num_blocks, name, "weight", role)]
            allowed = 1e-12 + float(rounding.norm())  # | ||a|| - ||b|| | <= ||a - b||
            assert row.contribution_norm == pytest.approx(float(ref.norm()), rel=1e-5, abs=allowed)
            # per-position magnitude: the norm of the position's own block-diagonal contribution
            mags = [float(torch.nn.grad.conv1d_weight(x[b:b + 1, :, t:t + 1], module.weight.shape,
                                                      g[b:b + 1, :, t:t + 1], groups=module.groups).norm())
                    for b, t in keep.nonzero().tolist()]
            assert row.magnitude_sum == pytest.approx(sum(mags), rel=1e-5, abs=1e-12)
            if name in BERT_ZERO and role == "context":
                assert row.contribution_norm == 0.0 and torch.count_nonzero(mine) == 0
            checked += 1
    assert checked >= 20


def test_channels_first_sites_are_the_blocks_own_states():
    """blocks.{i}.mid is post_attention's (B, H, T) output and blocks.{i}.out the block's, read as (B, T, H)."""
    model = tiny_model("squeezebert")
    batch = tiny_batch()
    record, rec = _record(model, batch)
    assert rec.adapter.channels_first
    mids = {}
    handles = [layer.post_attention.register_forward_hook(lambda m, a, out, i=i: mids.__setitem__(i, out))
               for i, layer in enumerate(model.transformer.encoder.layers)]
    try:
        out = model(**batch.model_inputs(), output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    grads = torch.autograd.grad(mlm_loss(out.logits, batch), [mids[i] for i in range(3)])
    for depth in range(3):
        grad, act = record.site(f"blocks.{depth}.mid")
        torch.testing.assert_close(act, mids[depth].norm(dim=1), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, grads[depth].norm(dim=1), rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(record.site(f"blocks.{depth}.out")[1], out.hidden_states[depth + 1].norm(dim=-1),
                                   rtol=1e-5, atol=1e-6)


def test_channels_first_mid_must_be_a_module_output():
    """A transposed copy of a module's input would miss the gradient of the input's other uses (the residual)."""
    model = tiny_model("squeezebert")
    adapter = replace(adapter_for(model), mid=("post_attention", "input"))
    with pytest.raises(SiteError, match="channels_first"):
        SiteLayer(model, adapter)


# ---------------------------------------------------------------------------------------------- I-BERT

def test_ibert_float_mode_modules_compute_linear_and_layer_norm():
    model = tiny_model("ibert")
    block = model.ibert.encoder.layer[0]
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        dense = block.attention.self.query
        y, scale = dense(x)
        assert scale is None and torch.equal(y, F.linear(x, dense.weight, dense.bias))
        norm = block.attention.output.LayerNorm
        y, scale = norm(x)
        assert scale is None
        torch.testing.assert_close(y, F.layer_norm(x, (32,), norm.weight, norm.bias, norm.eps), rtol=1e-5, atol=1e-6)
    specs = adapter_for(model).sublayers
    assert {n: s.acts_as for n, s in specs.items()} == {**dict.fromkeys(specs, "linear"), "attn.norm": "layer_norm",
                                                        "ffn.norm": "layer_norm"}


def test_ibert_quant_mode_is_refused_with_its_reason():
    config = AutoConfig.for_model("ibert", quant_mode=True)
    with pytest.raises(UnsupportedArchitectureError, match="straight-through"):
        adapter_for(config)
    assert adapter_for(AutoConfig.for_model("ibert")).family == "ibert"  # quant_mode=False, the default
    # the reason, measured: in quant mode IntLayerNorm's bias gets no gradient at all (it enters as .data)
    model = tiny_model("ibert", quant_mode=True).train()
    batch = tiny_batch()
    model(**batch.model_inputs())  # training mode: the activation ranges are collected
    model.eval()
    mlm_loss(model(**batch.model_inputs()).logits, batch).backward()
    norm = model.ibert.encoder.layer[-1].attention.output.LayerNorm
    assert norm.bias.grad is None and norm.weight.grad is not None and bool(norm.weight.grad.abs().sum() > 0)


# ---------------------------------------------------------------------------------------------- all three

@pytest.mark.parametrize("family", FAMILIES)
def test_check_agrees_with_the_bert_zero_pattern(family):
    model = tiny_model(family)
    result = check_batch(model, tiny_batch())
    last = result.num_blocks
    assert set(adapter_for(model).after_mixing()) == BERT_ZERO
    assert result.disagreements == [] and result.to_dict()["theory"]["agree"] is True
    assert {s.sublayer for s in result.flagged(last) if s.standard} == BERT_ZERO
    assert all(not s.flagged for s in result.sublayers if s.layer < last)
    assert all(p.positions_nonzero.get("context", 0) > 0 for p in result.params
               if p.layer == last and p.sublayer in ("attn.k", "attn.v") and p.param == "weight")


@pytest.mark.parametrize("family", FAMILIES)
def test_hooks_are_removed(family):
    model = tiny_model(family)

    def count() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    before = count()
    with pytest.raises(RuntimeError, match="boom"):
        with GradFlowRecorder(model) as rec:
            assert count() > before
            with rec.capture(tiny_batch().roles):
                raise RuntimeError("boom")
    assert count() == before


@pytest.mark.parametrize("family, overrides", [
    ("ibert", {}),
    ("squeezebert", dict(q_groups=1, k_groups=1, v_groups=1, post_attention_groups=1, intermediate_groups=1,
                         output_groups=1)),
])
def test_check_counts_conv_and_quant_linear_flops_like_linear(family, overrides):
    """QuantLinear (float mode) and ungrouped pointwise Conv1d cost what BERT's Linears of the same shapes
    cost: the block and attention FLOP terms and the last block's skippable FLOPs equal BERT's."""
    batch = tiny_batch()
    flops = check_batch(tiny_model(family, **overrides), batch).flops
    reference = check_batch(tiny_model("bert"), batch).flops
    for term in ("blocks_linear", "attention", "skippable", "skippable_attention"):
        assert getattr(flops, term) == pytest.approx(getattr(reference, term), rel=1e-12), term
    assert flops.share > 0.0  # (SqueezeBERT's pooler, on the B [CLS] rows, is a non-token call: not compared)


def test_check_counts_grouped_convs_per_group():
    """SqueezeBERT's grouped convs (4 groups in q, k, v and the FFN input) cost a quarter of a dense one."""
    batch = tiny_batch()
    grouped = check_batch(tiny_model("squeezebert"), batch).flops
    dense = check_batch(tiny_model("squeezebert", q_groups=1, k_groups=1, v_groups=1, intermediate_groups=1), batch).flops
    h, ffn, blocks = 32, 48, 3
    n = int(batch.attention_mask.sum())  # real tokens: token calls count there
    saved = 2 * 3 * n * blocks * (3 * h * h + h * ffn) * (1 - 1 / 4)
    assert dense.blocks_linear - grouped.blocks_linear == pytest.approx(saved, rel=1e-12)
