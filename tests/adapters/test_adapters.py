"""Adapters own every architecture fact: lookup by config, declared MLM head and final norm, position offsets."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoConfig

from gradflow.adapters import Adapter, HeadSpec, SublayerSpec, adapter_for, supported_model_types
from gradflow.runs.logit_lens import LogitLens, head_function
from gradflow.errors import DiagnosticsError, SurgeryError, UnsupportedArchitectureError
from gradflow.hooks.states import collect_states
from gradflow.interventions.finetune.train import max_input_length
from gradflow.interventions.surgery import unshare_albert
from gradflow.roles import Role
from tiny import FAMILIES, FAMILY_CONFIGS, PRE_LN, tiny_batch, tiny_model

# families whose final norm is declared and where it lives (relative to the base model)
FINAL_NORMS = {"modernbert": "final_norm", "esm": "encoder.emb_layer_norm_after", "megatron-bert": "encoder.ln",
               "xlm-roberta-xl": "encoder.LayerNorm", "roberta-prelayernorm": "LayerNorm", "esmc": "norm",
               "eurobert": "norm", "ultrabert": "norm", "modernvbert": "text_model.final_norm",
               "ultravbert": "text_model.norm"}


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_for_config_and_model_agree(family):
    model = tiny_model(family)
    assert adapter_for(model.config) is adapter_for(model)
    default = AutoConfig.for_model(family)
    refuse = adapter_for(model).refuse
    if refuse is not None and refuse(default) is not None:  # X-MOD's default config names no default language
        with pytest.raises(UnsupportedArchitectureError, match="does not support"):
            adapter_for(default)
        default = AutoConfig.for_model(family, **FAMILY_CONFIGS[family])
    assert adapter_for(default) is adapter_for(model)


def test_adapter_for_unknown_config_raises():
    with pytest.raises(UnsupportedArchitectureError, match="register_adapter"):
        adapter_for(AutoConfig.for_model("gpt2"))
    with pytest.raises(UnsupportedArchitectureError):
        adapter_for(object())


from tiny import MOE_FAMILIES  # noqa: E402

REMOTE_CODE_FAMILIES = {"llada", "Dream", "dream"}  # tiny remote-code models: tests/adapters/test_diffusion_families.py


def test_every_supported_model_type_is_a_tested_family():
    # mixtures of experts (causal LMs, no masked-LM class): tests/hooks/test_experts.py runs each of MOE_FAMILIES;
    # DiffusionGemma (two passes through tied blocks): tests/hooks/test_two_pass.py, test_diffusion_gemma.py
    two_pass = {"diffusion_gemma"}
    assert set(supported_model_types()) == set(FAMILIES) | REMOTE_CODE_FAMILIES | set(MOE_FAMILIES) | two_pass


def test_bert_layout_variants_keep_the_bert_family():
    for model_type in ("roberta", "xlm-roberta", "camembert", "data2vec-text", "electra", "ernie", "roformer"):
        assert adapter_for(AutoConfig.for_model(model_type)).family == "bert"


def _head_and_norm_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The declared final norm (if any) then the declared head, on (B, T, H) hidden states."""
    adapter = adapter_for(model)
    with torch.no_grad():
        if adapter.final_norm is not None:
            hidden = model.base_model.get_submodule(adapter.final_norm)(hidden)
        return head_function(model)(hidden)


@pytest.mark.parametrize("family", FAMILIES)
def test_declared_head_and_final_norm_reproduce_the_logits(family):
    model = tiny_model(family)
    states = collect_states(model, tiny_batch())
    assert adapter_for(model).final_norm == FINAL_NORMS.get(family)
    assert (family in PRE_LN) == (family in FINAL_NORMS)
    logits = _head_and_norm_logits(model, states.hidden[-1])
    torch.testing.assert_close(logits, states.logits, rtol=0, atol=1e-5)


def test_deberta_v2_non_legacy_head():
    model = tiny_model("deberta-v2", legacy=False)
    assert not hasattr(model, "cls") and hasattr(model, "lm_predictions")
    states = collect_states(model, tiny_batch())
    torch.testing.assert_close(_head_and_norm_logits(model, states.hidden[-1]), states.logits, rtol=0, atol=1e-5)


def test_lens_reports_a_wrong_declaration():
    model = tiny_model("xlm-roberta-xl")  # (tiny ModernBERT's logits barely change without its final norm)
    batch = tiny_batch()
    states = collect_states(model, batch)
    keep = batch.roles != Role.PAD
    lens = LogitLens(model, replace(adapter_for(model), final_norm=None))
    with pytest.raises(DiagnosticsError, match="cannot reproduce.*final_norm"):
        lens.resolve(states.hidden[-1], states.logits, keep)
    with pytest.raises(DiagnosticsError, match="head"):
        LogitLens(model, replace(adapter_for(model), head=HeadSpec(("cls",))))
    with pytest.raises(DiagnosticsError, match="final norm"):
        LogitLens(model, replace(adapter_for(model), final_norm="encoder.nowhere"))


def test_readme_adapter_takes_the_bert_defaults():
    adapter = Adapter(family="mybert", model_types=("mybert",), embeddings="embeddings", blocks="encoder.layer",
                      mid=("attention", "output"), attn_norm="post",
                      sublayers={"attn.q": SublayerSpec("attention.self.query")})
    assert adapter.head == HeadSpec(("cls",)) and adapter.final_norm is None
    assert adapter.position_offset(AutoConfig.for_model("bert")) == 0
    assert adapter.drop_blocks is None and adapter.unshare is None and adapter.per_layer_config == ()


@pytest.mark.parametrize("family, offset", [("bert", 0), ("roberta", 2), ("xlm-roberta-xl", 2),
                                            ("roberta-prelayernorm", 2), ("deberta-v2", 0)])
def test_position_offset_caps_the_input_length(family, offset):
    model = tiny_model(family)  # 64 learned positions; RoBERTa-style ids start at pad_token_id + 1 = 2

    class Tokenizer:
        model_max_length = 10**30

    assert adapter_for(model).position_offset(model.config) == offset
    assert max_input_length(model, Tokenizer(), 1000) == 64 - offset


def test_unshare_needs_shared_blocks():
    with pytest.raises(SurgeryError, match="ALBERT"):
        unshare_albert(tiny_model("bert"))
