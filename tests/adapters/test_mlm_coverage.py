"""Every model type transformers maps to a masked-LM class is either supported or refused with a reason.

A transformers release that maps a new type fails ``test_every_masked_lm_type_is_decided`` until
the type gets an adapter (and a tiny config in tests/tiny.py) or an entry in the refusal table.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from gradflow import GradFlowRecorder, mlm_loss
from gradflow.adapters import adapter_for, block_modules, supported_model_types
from gradflow.adapters.coverage import REFUSED, coverage_markdown, masked_lm_model_types
from gradflow.errors import ModelLoadError, UnsupportedArchitectureError
from gradflow.models.loading import load_model
from gradflow.roles import Role
from tiny import FAMILY_CONFIGS, tiny_batch, tiny_model

DOC = Path(__file__).resolve().parents[2] / "docs" / "mlm-coverage.md"
MLM_TYPES = masked_lm_model_types()


def test_every_masked_lm_type_is_decided():
    supported = set(supported_model_types())
    undecided = sorted(set(MLM_TYPES) - supported - set(REFUSED))
    assert undecided == [], f"masked-LM model types with neither an adapter nor a refusal: {undecided}"
    assert set(REFUSED) <= set(MLM_TYPES), "refusals of types transformers no longer maps"
    assert not supported & set(REFUSED)
    # a supported masked-LM type is certified by the family tests: it needs a tiny config
    assert supported & set(MLM_TYPES) <= set(FAMILY_CONFIGS)


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refusal_states_its_kind_and_is_raised(model_type):
    reason = REFUSED[model_type]
    assert reason.startswith(("does not hold: ", "not supported yet: ")), model_type
    with pytest.raises(UnsupportedArchitectureError) as err:
        adapter_for(AutoConfig.for_model(model_type))
    assert reason in str(err.value) and repr(model_type) in str(err.value)


def test_loading_a_refused_type_names_the_reason(tmp_path):
    AutoConfig.for_model("funnel", vocab_size=64, d_model=16, n_head=2, d_head=8, d_inner=16,
                         block_sizes=[1, 1]).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="pools the sequence"):
        load_model(str(tmp_path))


def _without_version(text: str) -> str:
    """The page with the transformers version it was generated under blanked: a patch release of transformers
    that maps the same model types must not fail CI; a new or dropped type still does."""
    return re.sub(r"^transformers \S+ maps", "transformers <version> maps", text, flags=re.MULTILINE)


def test_coverage_doc_is_current():
    assert _without_version(DOC.read_text(encoding="utf-8")) == _without_version(coverage_markdown()), \
        "docs/mlm-coverage.md is out of date: run python -m analyses.maintenance.make_mlm_coverage"
    assert _without_version("transformers 5.24.0 maps 51") == "transformers <version> maps 51"
    page = coverage_markdown()
    table, diffusion = page.split("\n## Masked diffusion LMs\n")
    diffusion, experts = diffusion.split("\n## Mixtures of experts\n")
    assert len(table.splitlines()) == 10 + len(MLM_TYPES)  # a fixed header and one row per mapped type
    rows = [line for line in diffusion.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == ["llada", "Dream", "diffusion_gemma"]
    moe = [line for line in experts.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in moe] == ["olmoe", "mixtral", "qwen3_moe", "qwen2_moe"]
    assert all("ffn.router" in r and r.endswith("ffn.experts.gate_up_proj, ffn.experts.down_proj |") for r in moe)
    assert "shifted (p predicts p + 1)" in rows[1] and "| unshifted |" in rows[0]
    assert "| supported (diffusion_gemma, transformers) | unshifted: the canvas only;" in rows[2]
    assert "| refused |" not in diffusion  # REFUSED_BEYOND_MLM is empty: DiffusionGemma is recorded


def _module_output_grads(model, batch, paths: dict[str, str]) -> dict[str, torch.Tensor]:
    """Loss gradient w.r.t. the outputs of modules of the last block, (B, T, D) each."""
    last = block_modules(adapter_for(model), model.base_model)[-1]
    outputs: dict[str, torch.Tensor] = {}
    handles = [last.get_submodule(path).register_forward_hook(
        lambda mod, args, out, name=name: outputs.__setitem__(name, out)) for name, path in paths.items()]
    try:
        loss = mlm_loss(model(**batch.model_inputs()).logits, batch)
    finally:
        for handle in handles:
            handle.remove()
    grads = torch.autograd.grad(loss, list(outputs.values()))
    return dict(zip(outputs, grads))


def test_convbert_span_convolution_zero_and_nonzero_modules():
    """The notes' statement: conv_kernel_layer and key_conv_attn_layer get exactly zero gradient at
    context outputs; conv_out_layer, unfolded over neighbours, does not (nor do the query's neighbours)."""
    model = tiny_model("convbert")
    batch = tiny_batch()
    grads = _module_output_grads(model, batch, {
        "kernel": "attention.self.conv_kernel_layer", "key_conv": "attention.self.key_conv_attn_layer",
        "conv_out": "attention.self.conv_out_layer", "query": "attention.self.query"})
    context = batch.roles == Role.CONTEXT
    assert torch.all(grads["kernel"][context] == 0) and torch.all(grads["query"][context] == 0)
    key_conv = grads["key_conv"].transpose(1, 2)  # SeparableConv1D outputs (B, D, T)
    assert torch.all(key_conv[context] == 0)
    assert torch.all(grads["conv_out"][context].norm(dim=-1) > 0)
    assert torch.all(grads["kernel"][batch.roles == Role.MASKED].norm(dim=-1) > 0)


@pytest.mark.slow
def test_big_bird_block_sparse_keeps_the_exact_zero():
    model = tiny_model("big_bird", attention_type="block_sparse", block_size=2, num_random_blocks=1)
    batch = tiny_batch(t=32)
    with GradFlowRecorder(model) as rec:
        record = rec.record(batch)
    assert model.base_model.attention_type == "block_sparse"  # (a too short input switches it to full)
    last = record.num_blocks - 1
    grad, _ = record.site(f"blocks.{last}.out")
    assert torch.all(grad[batch.roles == Role.CONTEXT] == 0)
    frame = record.sublayer_frame()
    rows = frame[(frame.layer == record.num_blocks) & (frame.role == "context")]
    zero = set(adapter_for(model).after_mixing())
    assert (rows[rows.sublayer.isin(zero)].contribution_norm == 0).all()
    assert (rows[rows.sublayer.isin({"attn.k", "attn.v"}) & (rows.param == "weight")].contribution_norm > 0).all()


def test_esmc_query_norm_zero_key_norm_not():
    """The notes' statement: in the last block q_norm gets exactly zero gradient at context positions, k_norm not."""
    model = tiny_model("esmc")
    batch = tiny_batch()
    grads = _module_output_grads(model, batch, {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"})
    context = batch.roles == Role.CONTEXT
    assert torch.all(grads["q_norm"][context] == 0)
    assert torch.all(grads["k_norm"][context].norm(dim=-1) > 0)


@pytest.mark.slow
def test_ultrabert_sliding_window_keeps_the_exact_zero():
    """The notes' statement: the window narrows which keys a query sees and leaves the last block's zero.

    The tiny config's last block attends within radius 4, so in row 0 (loss at positions 3 and 6) the
    final special token (position 11) is outside every loss position's window: the window is real.
    """
    model = tiny_model("ultrabert")
    batch = tiny_batch()
    assert model.config.layer_types[-1] == "sliding_attention" and model.config.sliding_window == 4
    assert (batch.roles[0] <= Role.KEPT).nonzero().flatten().tolist() == [3, 6]
    with GradFlowRecorder(model) as rec:
        record = rec.record(batch)
    last = record.num_blocks - 1
    grad, _ = record.site(f"blocks.{last}.out")
    assert torch.all(grad[batch.roles > Role.KEPT] == 0)  # context, specials, padding
    before, _ = record.site(f"blocks.{last - 1}.out")
    assert before[0, 11] == 0 and torch.all(before[0, 1:11] > 0)  # outside / inside the last block's windows
    full = tiny_model("ultrabert", layer_types=["sliding_attention", "full_attention", "full_attention"])
    with GradFlowRecorder(full) as rec:
        assert rec.record(batch).site(f"blocks.{last - 1}.out")[0][0, 11] > 0
    frame = record.sublayer_frame()
    rows = frame[(frame.layer == record.num_blocks) & (frame.role == "context")]
    zero = set(adapter_for(model).after_mixing())
    assert (rows[rows.sublayer.isin(zero)].contribution_norm == 0).all()
    assert (rows[~rows.sublayer.isin(zero)].contribution_norm > 0).all()
