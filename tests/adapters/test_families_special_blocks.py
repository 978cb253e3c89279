"""MobileBERT, Longformer and FNet: the statements of their adapters' notes, measured on tiny models.

The family tests (tests/hooks/test_recorder_families.py and the others that run every entry of
tests/tiny.py's table) certify the exact last-block zero and the exact decomposition; here: the
narrow bottleneck of the real MobileBERT checkpoints and NoNorm's split, the positions Longformer
appends and its global attention, FNet's all-zero last block, and ``gradflow check`` on each.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from gradflow import GradFlowRecorder, RecorderConfig, mlm_loss
from gradflow.adapters import adapter_for, block_modules
from gradflow.adapters.special_blocks import mobilebert_refusal
from gradflow.errors import RecorderError, UnsupportedArchitectureError
from gradflow.roles import ALL_ROLES, Role
from gradflow.runs.check import check_batch
from tiny import tiny_batch, tiny_model

NARROW = dict(intra_bottleneck_size=16, true_hidden_size=16)  # hidden 32 -> 16, as 512 -> 128 in the checkpoints
MOBILEBERT_CONTEXT = {"attn.k", "attn.v", "bottleneck.attention.dense", "bottleneck.attention.LayerNorm"}


def _record(model, batch, **config):
    with GradFlowRecorder(model, RecorderConfig(materialize=True, **config)) as rec:
        return rec.record(batch)


def _last_context(record) -> dict[tuple[str, str], float]:
    frame = record.sublayer_frame()
    rows = frame[(frame.layer == record.num_blocks) & (frame.role == "context")]
    return {(r.sublayer, r.param): r.contribution_norm for r in rows.itertuples()}


def _grads_at(model, batch, block: int, paths: dict[str, str],
              **inputs) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(input, loss gradient w.r.t. the output) of modules of one block, from a plain forward and backward."""
    blocks = block_modules(adapter_for(model), model.base_model)
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(name):
        return lambda module, args, out: seen.__setitem__(name, (args[0].detach(), out))

    handles = [blocks[block].get_submodule(path).register_forward_hook(keep(name)) for name, path in paths.items()]
    try:
        loss = mlm_loss(model(**batch.model_inputs(), **inputs).logits, batch)
    finally:
        for handle in handles:
            handle.remove()
    grads = torch.autograd.grad(loss, [out for _, out in seen.values()])
    return {name: (x, g) for (name, (x, _)), g in zip(seen.items(), grads)}


# ---------------------------------------------------------------------------------------------- MobileBERT

@pytest.mark.parametrize("norm", ["no_norm", "layer_norm"])
def test_mobilebert_narrow_bottleneck_last_block_zero_set(norm):
    model = tiny_model("mobilebert", normalization_type=norm, **NARROW)
    adapter = adapter_for(model)
    assert set(adapter.sublayers) - set(adapter.after_mixing()) == MOBILEBERT_CONTEXT
    assert len(adapter.sublayers) == 8 + 6 + 9  # standard, bottlenecks, 3 stacked FFNs
    record = _record(model, tiny_batch())
    last = _last_context(record)
    assert {name for name, _ in last} == set(adapter.sublayers)
    for (name, param), norm_value in last.items():
        if name in adapter.after_mixing():
            assert norm_value == 0.0, (name, param)
            key = (record.num_blocks - 1, name, param, "context")
            assert torch.count_nonzero(record.matrices[key]) == 0
        elif param == "weight":
            assert norm_value > 0, (name, param)
    frame = record.sublayer_frame()
    early = frame[(frame.layer < record.num_blocks) & (frame.role == "context") & (frame.param == "weight")]
    assert (early.contribution_norm > 0).all() and set(early.sublayer) == set(adapter.sublayers)


def test_mobilebert_narrow_bottleneck_sums_to_autograd():
    model = tiny_model("mobilebert", **NARROW)
    batch = tiny_batch()
    record = _record(model, batch)
    model.zero_grad(set_to_none=True)
    mlm_loss(model(**batch.model_inputs()).logits, batch).backward()
    blocks = block_modules(adapter_for(model), model.base_model)
    checked = 0
    for depth, block in enumerate(blocks):
        for name, spec in adapter_for(model).sublayers.items():
            module = block.get_submodule(spec.path)
            for param in ("weight", "bias"):
                ref = getattr(module, param).grad
                total = sum(m for (d, s, p, _), m in record.matrices.items() if (d, s, p) == (depth, name, param))
                assert float((total - ref).norm()) <= 1e-5 * float(ref.norm()) + 1e-12, (depth, name, param)
                checked += 1
    assert checked == 3 * 23 * 2


def test_nonorm_gain_gradient_per_position_is_g_times_x():
    """NoNorm (x * weight + bias): the gain's contribution of a role is sum over its positions of g_t * x_t."""
    model = tiny_model("mobilebert", **NARROW)
    batch = tiny_batch()
    record = _record(model, batch)
    paths = {"attn.norm": "attention.output.LayerNorm", "bottleneck.input.LayerNorm": "bottleneck.input.LayerNorm"}
    assert type(block_modules(adapter_for(model), model.base_model)[0].get_submodule(paths["attn.norm"])).__name__ \
        == "NoNorm"
    seen = _grads_at(model, batch, 1, paths)
    roles = batch.roles.reshape(-1).long()
    for name, (x, g) in seen.items():
        x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        for code, role in enumerate(ALL_ROLES):
            if int((roles == code).sum()) == 0:
                continue
            rows = roles == code
            for param, expected in (("weight", (g2[rows] * x2[rows]).sum(0)), ("bias", g2[rows].sum(0))):
                torch.testing.assert_close(record.matrices[(1, name, param, role)], expected, rtol=1e-5, atol=1e-10)


def test_mobilebert_other_layouts_are_refused_with_the_attribute():
    for overrides, named in ((dict(num_feedforward_networks=2), "num_feedforward_networks=2"),
                             (dict(use_bottleneck=False), "use_bottleneck=False"),
                             (dict(use_bottleneck_attention=True), "use_bottleneck_attention=True")):
        model = tiny_model("mobilebert", **overrides)
        with pytest.raises(UnsupportedArchitectureError, match=named):
            adapter_for(model)
    assert adapter_for(AutoConfig.for_model("mobilebert")).family == "mobilebert"  # the published layout
    assert mobilebert_refusal(SimpleNamespace(model_type="mobilebert")) is None  # a stand-in (the coverage table)


# ---------------------------------------------------------------------------------------------- Longformer

def test_longformer_appended_positions_are_pad():
    model = tiny_model("longformer")  # attention_window 8: tiny_batch's 12 positions run as 16
    batch = tiny_batch()
    record = _record(model, batch)
    assert record.roles.shape == batch.roles.shape == (3, 12)
    assert all(g.shape == (3, 12) for g in record.grad_norm) and all(a.shape == (3, 12) for a in record.act_norm)
    counts = torch.bincount(batch.roles.reshape(-1).long(), minlength=len(ALL_ROLES))
    appended = 3 * (16 - 12)
    for rec in record.sublayers:  # every sublayer reads all 16 positions per row; q/k/v (T, B, H) as (B, T, H)
        expected = counts.clone()
        expected[Role.PAD] += appended
        assert torch.equal(rec.n_positions, expected), (rec.depth, rec.sublayer, rec.param)
    with pytest.raises(RecorderError, match="roles have shape"):
        with GradFlowRecorder(model, adapter=replace(adapter_for(model), appends_padding=False)) as rec:
            rec.record(batch)


def test_longformer_without_appended_positions_matches():
    """A length that is a multiple of the window (16): no appended positions, and the same zero pattern."""
    model = tiny_model("longformer")
    batch = tiny_batch(t=16)
    record = _record(model, batch)
    last = _last_context(record)
    zero = set(adapter_for(model).after_mixing())
    assert all(v == 0.0 for (name, _), v in last.items() if name in zero)
    assert last[("attn.k", "weight")] > 0 and last[("attn.v", "weight")] > 0


def test_longformer_global_attention_zero_pattern():
    """With global attention on <s> (position 0, role special): the last block's global projections get exactly
    zero from every position, its standard zeros stay, and an earlier block's key_global gets context gradient."""
    model = tiny_model("longformer")
    batch = tiny_batch()
    glob = torch.zeros_like(batch.attention_mask)
    glob[:, 0] = 1
    paths = {"query_global": "attention.self.query_global", "key_global": "attention.self.key_global",
             "value_global": "attention.self.value_global"}
    last = _grads_at(model, batch, 2, paths, global_attention_mask=glob)
    assert set(last) == set(paths)  # the global projections ran
    for name, (_, g) in last.items():
        assert torch.count_nonzero(g) == 0, name
    earlier = _grads_at(model, batch, 1, paths, global_attention_mask=glob)
    context = batch.roles == Role.CONTEXT
    key_global = earlier["key_global"][1].transpose(0, 1)[:, :12]  # (T, B, H) -> (B, T, H)
    assert torch.all(key_global[context].norm(dim=-1) > 0)
    with GradFlowRecorder(model, RecorderConfig()) as rec:
        with rec.capture(batch.roles):
            out = model(**batch.model_inputs(), global_attention_mask=glob)
            mlm_loss(out.logits, batch).backward()
        record = rec.result()
    zero = set(adapter_for(model).after_mixing())
    values = _last_context(record)
    assert all(v == 0.0 for (name, _), v in values.items() if name in zero)
    assert values[("attn.k", "weight")] > 0 and values[("attn.v", "weight")] > 0


# ---------------------------------------------------------------------------------------------- FNet

def test_fnet_every_last_block_sublayer_is_zero_from_context():
    model = tiny_model("fnet")
    batch = tiny_batch()
    adapter = adapter_for(model)
    assert set(adapter.after_mixing()) == set(adapter.sublayers) == {"attn.norm", "ffn.in", "ffn.out", "ffn.norm"}
    last_block = block_modules(adapter, model.base_model)[-1]
    named = {spec.path for spec in adapter.sublayers.values()}
    assert {path.rpartition(".")[0] for path, _ in last_block.named_parameters()} == named  # nothing else to train
    record = _record(model, batch)
    values = _last_context(record)
    assert len(values) == 8 and all(v == 0.0 for v in values.values())  # 4 sublayers, a weight and a bias each
    context = batch.roles == Role.CONTEXT
    mid, _ = record.site(f"blocks.{record.num_blocks - 1}.mid")
    before, _ = record.site(f"blocks.{record.num_blocks - 2}.out")
    assert torch.all(mid[context] == 0) and torch.all(before[context] > 0)  # the last mixing ends the flow


# ---------------------------------------------------------------------------------------------- gradflow check

GLOBAL_PROJECTIONS = {"attention.self.query_global", "attention.self.key_global", "attention.self.value_global"}


@pytest.mark.parametrize("family, overrides, not_called", [
    ("mobilebert", NARROW, set()), ("longformer", {}, GLOBAL_PROJECTIONS), ("fnet", {}, set())])
def test_check_agrees_with_the_theory(family, overrides, not_called):
    """Measured zeros agree with the theory; the only block parameters not split are Longformer's global
    projections, which do not run without a global_attention_mask."""
    model = tiny_model(family, **overrides)
    result = check_batch(model, tiny_batch())
    adapter = adapter_for(model)
    last = result.num_blocks
    assert result.disagreements == [] and result.to_dict()["theory"]["agree"] is True
    assert {s.sublayer for s in result.flagged(last) if s.standard} == set(adapter.after_mixing())
    assert set(result.expected_last_block) == set(adapter.after_mixing())
    for layer in range(1, last):
        assert result.flagged(layer) == []
    unsplit = {row["parameter"].rpartition(".")[0] for row in result.unsplit if row["layer"] == last}
    assert unsplit == not_called
    assert all("not called" in row["reason"] for row in result.unsplit)


def test_check_counts_longformers_padded_token_calls_as_token_calls():
    """Longformer pads T = 12 to 16 inside the model: its block Linears run on B * 16 rows and still count
    as token calls (at the batch's real tokens), so the FLOP terms are those of an unpadded batch of the
    same tokens: nothing lands in ``non_token`` and the block term is the same as without padding."""
    model = tiny_model("longformer")
    batch = tiny_batch()  # T = 12, attention_window 8 (family table): padded to 16
    flops = check_batch(model, batch).flops
    assert flops.non_token == 0.0 and flops.blocks_linear > 0.0
    bert_like = tiny_model("bert")  # the same block shapes, no padding inside the model
    reference = check_batch(bert_like, batch).flops
    assert flops.blocks_linear == pytest.approx(reference.blocks_linear, rel=1e-12)
    assert flops.skippable == pytest.approx(reference.skippable, rel=1e-12)
