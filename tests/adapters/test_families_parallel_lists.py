"""XLM and FlauBERT (blocks gathered from parallel ModuleLists) and X-MOD (one LayerNorm called twice per block).

The family tests (tests/tiny.py's table) already run on all three; here: the sites against the
models' own hidden states at every depth (the last one included), hook removal, ``gradflow check``
against the stated zero pattern, each X-MOD LayerNorm call's split against autograd's gradient of
that call alone, and the refused configs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gradflow import GradFlowRecorder, RecorderConfig, mlm_loss
from gradflow.adapters import adapter_for, block_modules, get_module
from gradflow.adapters.xlm import DepthParts
from gradflow.errors import UnsupportedArchitectureError
from gradflow.hooks.sites import EMBEDDINGS_SITE, site_name
from gradflow.interventions.surgery import drop_last_blocks
from gradflow.roles import Role
from gradflow.runs.check import check_batch
from rounding import assert_within_rounding, sum_bound
from tiny import tiny_batch, tiny_model

PARALLEL = ("xlm", "flaubert")
XMOD_CALLS = ("adapter.norm", "ffn.norm")  # output.LayerNorm's first and second call in a block


def _record(model, batch, **config):
    with GradFlowRecorder(model, RecorderConfig(**config)) as rec:
        return rec.record(batch)


def _hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("family", PARALLEL)
def test_depths_gather_the_models_own_modules(family):
    model = tiny_model(family)
    base = model.base_model
    blocks = block_modules(adapter_for(model), base)
    assert len(blocks) == 3 and all(isinstance(b, DepthParts) for b in blocks)
    for i, block in enumerate(blocks):
        assert dict(block.named_children()) == {"attentions": base.attentions[i], "layer_norm1": base.layer_norm1[i],
                                                "ffns": base.ffns[i], "layer_norm2": base.layer_norm2[i]}
    assert sum(p.numel() for b in blocks for p in b.parameters()) == sum(
        p.numel() for name in ("attentions", "layer_norm1", "ffns", "layer_norm2")
        for p in getattr(base, name).parameters())


@pytest.mark.parametrize("family", PARALLEL)
def test_sites_are_the_models_hidden_states_at_every_depth(family):
    model = tiny_model(family)
    batch = tiny_batch()
    record = _record(model, batch)
    out = model(**batch.model_inputs(), output_hidden_states=True)
    hidden = out.hidden_states  # the model's own: embeddings, then each block's output after its padding mask
    assert len(hidden) == 4
    grads = torch.autograd.grad(mlm_loss(out.logits, batch), hidden)
    for site, h, g in zip((EMBEDDINGS_SITE, *(site_name(d) for d in range(3))), hidden, grads):
        grad, act = record.site(site)
        torch.testing.assert_close(act, h.norm(dim=-1), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, g.norm(dim=-1), rtol=1e-5, atol=1e-9)
    pad = batch.roles == Role.PAD
    assert torch.all(record.site(site_name(2))[1][pad] == 0)  # the last block's output is after the mask
    assert torch.all(record.site(site_name(2))[0][batch.roles == Role.CONTEXT] == 0)
    assert torch.all(record.site(site_name(1))[0][batch.roles == Role.CONTEXT] > 0)
    mid_grad, _ = record.site(site_name(2, "mid"))  # layer_norm1's output feeds only its own position's FFN
    assert torch.all(mid_grad[batch.roles == Role.CONTEXT] == 0)


@pytest.mark.parametrize("family", [*PARALLEL, "xmod"])
def test_hooks_removed_also_after_an_error(family):
    model = tiny_model(family)
    batch = tiny_batch()
    before = _hook_count(model)
    with GradFlowRecorder(model) as rec:
        assert _hook_count(model) > before
        rec.record(batch)
    assert _hook_count(model) == before
    with pytest.raises(RuntimeError, match="boom"):
        with GradFlowRecorder(model) as rec, rec.capture(batch.roles):
            model(**batch.model_inputs())
            raise RuntimeError("boom")
    assert _hook_count(model) == before


@pytest.mark.parametrize("family", [*PARALLEL, "xmod"])
def test_check_agrees_with_the_stated_zero_pattern(family):
    model = tiny_model(family)
    adapter = adapter_for(model)
    result = check_batch(model, tiny_batch())
    last = result.num_blocks
    assert result.disagreements == [] and result.to_dict()["theory"]["agree"] is True
    standard = {s.sublayer for s in result.flagged(last) if s.standard}
    assert standard == set(adapter.after_mixing())
    expected = {"attn.q", "attn.out", "attn.norm", "ffn.in", "ffn.out", "ffn.norm"}
    assert standard == (expected | {"adapter.norm"} if family == "xmod" else expected)
    assert {"attn.k", "attn.v"}.isdisjoint(standard)
    assert all(result.flagged(layer) == [] for layer in range(1, last))
    other = {s.sublayer for s in result.flagged(last) if not s.standard}
    if family == "xmod":  # the language adapter's bottleneck Linears act on one position after attention
        assert other == {"output.adapter_modules.en_XX.dense1", "output.adapter_modules.en_XX.dense2"}
    else:
        assert other == set()
    assert result.unsplit == []


def _per_call_norm_grads(model, batch) -> tuple[dict[tuple[int, str, str], torch.Tensor], dict]:
    """autograd's gradient of each call of every block's output.LayerNorm (one parameter copy per call), and the
    float32 rounding bound of its sum over positions (:func:`rounding.sum_bound` of the terms ``g * x_hat``, ``g``)."""
    copies: dict[tuple[int, str, str], torch.Tensor] = {}
    seen: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}  # each call's (input, output)
    norms = [layer.output.LayerNorm for layer in model.base_model.encoder.layer]
    for depth, norm in enumerate(norms):
        params = []
        for name in XMOD_CALLS:
            w = copies[(depth, name, "weight")] = norm.weight.detach().clone().requires_grad_(True)
            b = copies[(depth, name, "bias")] = norm.bias.detach().clone().requires_grad_(True)
            params.append((w, b, depth, name))
        calls = iter(params)

        def forward(x, norm=norm, calls=calls):
            w, b, depth, name = next(calls)  # a third call would raise StopIteration
            y = F.layer_norm(x, norm.normalized_shape, w, b, norm.eps)
            seen[(depth, name)] = x.detach(), y
            return y

        norm.forward = forward
    try:
        loss = mlm_loss(model(**batch.model_inputs()).logits, batch)
    finally:
        for norm in norms:
            del norm.forward
    grads = torch.autograd.grad(loss, [*copies.values(), *(out for _, out in seen.values())])
    bounds = {}
    for ((depth, name), (x, _)), g in zip(seen.items(), grads[len(copies):]):
        x, g = x.reshape(-1, x.shape[-1]).double(), g.reshape(-1, g.shape[-1]).double()
        x_hat = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + norms[depth].eps)
        bounds[(depth, name, "weight")], bounds[(depth, name, "bias")] = sum_bound(g * x_hat, 0), sum_bound(g, 0)
    return dict(zip(copies, grads[:len(copies)])), bounds


def test_xmod_each_layer_norm_call_has_its_own_exact_split():
    model = tiny_model("xmod")
    batch = tiny_batch()
    record = _record(model, batch, materialize=True)
    assert not any(int(r.n_positions[Role.RELPOS]) for r in record.sublayers)  # the second call is no relpos call
    reference, rounding = _per_call_norm_grads(model, batch)
    for (depth, name, param), ref in reference.items():
        total = sum(m for (d, s, p, _), m in record.matrices.items() if (d, s, p) == (depth, name, param))
        # the roles' sums over positions, autograd's in another order: their float32 rounding, plus rtol for
        # record()'s upstream gradient (its sparse head)
        assert_within_rounding(total, ref, rounding[(depth, name, param)], f"{depth} {name} {param}", rtol=1e-5,
                               atol=1e-8)
        n = next(r.n_positions for r in record.sublayers if (r.depth, r.sublayer, r.param) == (depth, name, param))
        assert torch.equal(n, record.sublayers[0].n_positions)  # each call: the batch's positions once
    for depth in range(3):  # the two calls are different gradients: swapping the names would fail above
        first, second = (reference[(depth, name, "weight")] for name in XMOD_CALLS)
        assert not torch.allclose(first, second)
    last = record.sublayer_frame()
    last = last[(last.layer == 3) & (last.role == "context") & last.sublayer.isin(XMOD_CALLS)]
    assert len(last) == 4 and (last.contribution_norm == 0.0).all() and (last.n_nonzero == 0).all()


def test_xmod_two_languages_uses_the_default_one():
    model = tiny_model("xmod", languages=["en_XX", "de_DE"], default_language="de_DE")
    result = check_batch(model, tiny_batch())
    assert result.disagreements == []
    flagged = {s.sublayer for s in result.flagged(3) if not s.standard}
    assert flagged == {"output.adapter_modules.de_DE.dense1", "output.adapter_modules.de_DE.dense2"}
    idle = [p for p in result.params if "en_XX" in p.sublayer]  # called on no position: nothing to split
    assert idle and all(sum(p.positions_nonzero.values()) == 0 for p in idle)


@pytest.mark.parametrize("family, overrides, message", [
    ("xlm", dict(n_langs=2, use_lang_emb=True), "langs input"),
    ("flaubert", dict(n_langs=3, use_lang_emb=True), "langs input"),
    ("xlm", dict(asm=True, asm_cutoffs=[8, 16]), "adaptive softmax"),
    ("flaubert", dict(pre_norm=True), "pre_norm=True branch fails"),
    ("xmod", dict(default_language=None), "set_default_language"),
    ("xmod", dict(default_language="fr_XX"), "has no language adapter"),
    ("xmod", dict(pre_norm=True), "pre_norm=True"),
    ("xmod", dict(adapter_layer_norm=True), "adapter_reuse_layer_norm=True"),
])
def test_refused_configs_name_the_reason(family, overrides, message):
    model = tiny_model(family)
    for key, value in overrides.items():
        setattr(model.config, key, value)
    with pytest.raises(UnsupportedArchitectureError, match=message):
        adapter_for(model)
    with pytest.raises(UnsupportedArchitectureError, match=message):
        GradFlowRecorder(model)


def test_the_refused_flaubert_pre_norm_does_not_run():
    model = tiny_model("flaubert", pre_norm=True)  # the refusal's premise, measured on the installed transformers
    with pytest.raises(TypeError, match="not subscriptable"):
        model(**tiny_batch().model_inputs())


def test_xlm_without_language_embeddings_is_accepted():
    model = tiny_model("xlm", n_langs=2, use_lang_emb=False)  # XLM-17/100 style: no langs input read
    assert adapter_for(model).family == "xlm"


@pytest.mark.parametrize("family", PARALLEL)
def test_drop_removes_every_part_of_the_last_depth(family):
    model = tiny_model(family)
    base = model.base_model
    last = block_modules(adapter_for(model), base)[-1]
    expected = sum(p.numel() for p in last.parameters())
    model, record = drop_last_blocks(model, 1)
    assert record.parameters == expected and base.n_layers == 2 == model.config.n_layers
    assert [len(getattr(base, name)) for name in ("attentions", "layer_norm1", "ffns", "layer_norm2")] == [2] * 4
    assert get_module(block_modules(adapter_for(model), base)[-1], "ffns") is base.ffns[1]
    assert _record(model, tiny_batch()).num_blocks == 2
