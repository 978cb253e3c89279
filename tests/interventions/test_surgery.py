"""Block surgery on every family: drop round-trips through save/load, re-init touches only the last block."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForMaskedLM

from gradflow.adapters import adapter_for, block_modules
from gradflow.errors import GradflowError, OutputDirError
from gradflow.hooks.states import collect_states
from gradflow.interventions.surgery import (
    SURGERY_FILE,
    SurgeryError,
    SurgeryPlan,
    apply_surgery,
    drop_last_blocks,
    freeze_embeddings,
    freeze_encoder,
    freeze_first_blocks,
    reinit_last_blocks,
    surgery_to_dir,
    unshare_albert,
)
from gradflow.models import load_model
from tiny import FAMILIES, tiny_batch, tiny_model

MODERNBERT_TYPES = {"layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}


def _model(family: str, **overrides):
    """A tiny model whose config is valid to save (tiny ModernBERT keeps 22 default layer types)."""
    extra = MODERNBERT_TYPES if family == "modernbert" else {}
    return tiny_model(family, **extra, **overrides)


def _block_outputs(model, batch) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each depth's block output (the site layer's blocks.{i}.out; XLM's blocks are never called as one
    module) and the logits."""
    states = collect_states(model, batch)
    return [hidden.clone() for hidden in states.hidden[1:]], states.logits


def _reload(model, path):
    model.save_pretrained(path)
    return AutoModelForMaskedLM.from_pretrained(path).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_drop_last_block_round_trip(family, tmp_path):
    batch = tiny_batch()
    model = tiny_model(family)  # ModernBERT: its over-long layer_types are trimmed by the drop
    if family == "esmc":  # its residual scaling depends on the number of blocks
        with pytest.raises(SurgeryError, match="sqrt"):
            drop_last_blocks(model, 1)
        return
    before, _ = _block_outputs(model, batch)
    model, record = drop_last_blocks(model, 1)
    assert (record.blocks_before, record.blocks_after, record.blocks) == (3, 2, (2,))
    assert model.config.num_hidden_layers == 2
    after, logits = _block_outputs(model, batch)
    assert len(after) == 2
    for a, b in zip(after, before[:2]):
        assert torch.equal(a, b)  # hidden states at the kept layers are the original's
    reloaded = _reload(model, tmp_path / "m")
    assert reloaded.config.num_hidden_layers == 2
    again, logits_again = _block_outputs(reloaded, batch)
    assert torch.equal(logits, logits_again)
    for a, b in zip(after, again):
        assert torch.equal(a, b)
    if family == "modernbert":
        assert len(reloaded.config.layer_types) == 2
    if family == "esm":  # the contact head keeps the kept layers' attention-map columns
        assert reloaded.esm.contact_head.regression.in_features == 2 * reloaded.config.num_attention_heads
        assert "contact head" in record.notes


@pytest.mark.parametrize("family", FAMILIES)
def test_reinit_changes_only_last_block(family, tmp_path):
    model = _reload(_model(family), tmp_path / "m")  # loaded weights carry transformers' "initialised" marks
    if family == "albert":
        with pytest.raises(SurgeryError, match="unshare"):
            reinit_last_blocks(model, 1)
        batch = tiny_batch()
        _, ref = _block_outputs(model, batch)
        model, _ = unshare_albert(model)
        assert torch.equal(_block_outputs(model, batch)[1], ref)  # unsharing keeps the function
    with torch.no_grad():  # move every parameter off its init values, so re-init visibly changes all of them
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    twin = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    last = {id(p) for p in block_modules(adapter_for(model), model.base_model)[-1].parameters()}
    last_names = {n for n, p in model.named_parameters() if id(p) in last}
    rng = torch.random.get_rng_state()
    model, record = reinit_last_blocks(model, 1, seed=5)
    assert torch.equal(rng, torch.random.get_rng_state())  # the global RNG is left alone
    assert record.blocks == (2,) and record.seed == 5
    after = model.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed == last_names
    reinit_last_blocks(twin, 1, seed=5)
    for k, v in twin.state_dict().items():
        assert torch.equal(v, after[k])  # seeded: same seed, same weights


def test_reinit_uses_the_architectures_init():
    model = tiny_model("bert", initializer_range=0.5)
    model, _ = reinit_last_blocks(model, 1, seed=0)
    layer = model.bert.encoder.layer[2]
    assert float(layer.intermediate.dense.weight.detach().std()) == pytest.approx(0.5, rel=0.1)
    assert torch.equal(layer.output.LayerNorm.weight, torch.ones(32))
    assert torch.equal(layer.output.dense.bias, torch.zeros(32))


def test_drop_checks_k():
    model = tiny_model("bert")
    with pytest.raises(SurgeryError, match="at least one block"):
        drop_last_blocks(model, 3)
    with pytest.raises(SurgeryError):
        drop_last_blocks(model, -1)
    _, record = drop_last_blocks(model, 0)
    assert record.blocks_after == 3 and model.config.num_hidden_layers == 3


def test_albert_drop_means_fewer_applications(tmp_path):
    model = tiny_model("albert")
    n_params = sum(p.numel() for p in model.parameters())
    model, record = drop_last_blocks(model, 2)
    assert model.config.num_hidden_layers == 1 and record.parameters == 0
    assert sum(p.numel() for p in model.parameters()) == n_params
    assert len(block_modules(adapter_for(model), model.base_model)) == 1
    unshared, _ = unshare_albert(tiny_model("albert"))
    unshared, record = drop_last_blocks(unshared, 1)
    assert unshared.config.num_hidden_groups == 2 and record.parameters > 0
    reloaded = _reload(unshared, tmp_path / "a")
    assert torch.equal(_block_outputs(reloaded, tiny_batch())[1], _block_outputs(unshared, tiny_batch())[1])


def test_albert_groups_that_do_not_divide_raise():
    model = tiny_model("albert", num_hidden_layers=4, num_hidden_groups=2)
    with pytest.raises(SurgeryError, match="groups"):
        drop_last_blocks(model, 1)


def test_freezing():
    model = tiny_model("bert")
    model, rec = freeze_first_blocks(model, 2)
    layers = model.bert.encoder.layer
    assert rec.blocks == (0, 1)
    assert not any(p.requires_grad for p in layers[0].parameters())
    assert not any(p.requires_grad for p in layers[1].parameters())
    assert all(p.requires_grad for p in layers[2].parameters())
    model, rec = freeze_embeddings(model)
    assert not any(p.requires_grad for p in model.bert.embeddings.parameters())
    assert rec.parameters == sum(p.numel() for p in model.bert.embeddings.parameters())
    out = model(**tiny_batch().model_inputs()).logits.sum()
    out.backward()
    assert layers[0].attention.self.query.weight.grad is None
    assert layers[2].attention.self.query.weight.grad is not None
    with pytest.raises(SurgeryError, match="shared"):
        freeze_first_blocks(tiny_model("albert"), 1)
    model, _ = freeze_encoder(tiny_model("bert"))
    assert not any(p.requires_grad for p in model.bert.parameters())


def test_apply_surgery_drops_then_reinitialises():
    model = tiny_model("bert")
    reference = copy.deepcopy(model)
    model, result = apply_surgery(model, SurgeryPlan(drop_last=1, reinit_last=1, seed=2))
    assert [r.operation for r in result.records] == ["drop_last_blocks", "reinit_last_blocks"]
    assert result.records[1].blocks == (1,)  # the new last block
    assert torch.equal(model.bert.encoder.layer[0].output.dense.weight, reference.bert.encoder.layer[0].output.dense.weight)
    assert not torch.equal(model.bert.encoder.layer[1].output.dense.weight,
                           reference.bert.encoder.layer[1].output.dense.weight)


def test_surgery_to_dir(tiny_mlm_dir, tmp_path):
    out = surgery_to_dir(str(tiny_mlm_dir), tmp_path / "cut", drop_last=1)
    meta = json.loads((out / SURGERY_FILE).read_text())
    assert meta["num_hidden_layers"] == 1 and meta["operations"][0]["operation"] == "drop_last_blocks"
    loaded = load_model(str(out))
    original = load_model(str(tiny_mlm_dir))
    expected, _ = drop_last_blocks(original.model, 1)
    ids = loaded.tokenizer("the progress of public credit", return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(loaded.model(**ids).logits, expected(**ids).logits)
    with pytest.raises(OutputDirError):
        surgery_to_dir(str(tiny_mlm_dir), out, drop_last=1)
    with pytest.raises(GradflowError, match="nothing to do"):
        surgery_to_dir(str(tiny_mlm_dir), tmp_path / "noop")
    with pytest.raises(SurgeryError):
        surgery_to_dir(str(tiny_mlm_dir), tmp_path / "all", drop_last=2)
