"""Masked diffusion LMs that ship remote code: LLaDA (unshifted head) and Dream (shifted head), at tiny size.

The checkpoints are built offline by ``tests/models/remote_code/tiny_remote.py`` (their own modeling code,
``auto_map`` for AutoConfig and AutoModel only, safetensors weights) and loaded with
``load_model(..., trust_remote_code=True)``. On both, with the registered adapter and with ``adapter="auto"``:
the per-role split sums to autograd's gradient, the recorder leaves no hook behind, and the exact last-block
zero holds at every position that carries no loss. For Dream the objective is the shifted one: position p
carries the loss of the token at p + 1 when that token is masked, so the zero sits at the positions whose
successor is not masked, a masked input among them, and not at a clean position before a masked one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gradflow import GradFlowRecorder, RecorderConfig, mlm_loss
from gradflow.adapters import block_modules, get_module
from gradflow.adapters.norms import splittable
from gradflow.inputs.masking import MaskedBatch, MaskedDiffusion, mask_batch, shift_to_loss_side
from gradflow.models import load_model
from gradflow.roles import Role
from models.remote_code.tiny_remote import build_dream_tiny, build_llada_tiny

NON_LOSS = (Role.CONTEXT, Role.SPECIAL, Role.PAD)
BUILDERS = {"llada": build_llada_tiny, "dream": build_dream_tiny}
# sublayers of the last block that read only their own position's post-attention state, by module path (auto)
AFTER_MIXING_PATHS = {
    "llada": {"q_proj", "attn_out", "ff_norm", "ff_proj", "up_proj", "ff_out"},
    "dream": {"self_attn.q_proj", "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
              "mlp.down_proj"},
}
MIXING_PATHS = {"llada": {"attn_norm", "k_proj", "v_proj"},
                "dream": {"input_layernorm", "self_attn.k_proj", "self_attn.v_proj"}}
# masked tokens per row (row 2 is padded after position 7); row 1 masks 3 and 4 in a row, row 2 masks 1 after <bos>
SELECTED = {0: (3, 6, 10), 1: (3, 4, 8), 2: (1, 2, 5)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """Both tiny checkpoints, built once and loaded with load_model(..., trust_remote_code=True)."""
    return {family: load_model(str(build(tmp_path_factory.mktemp(f"{family}_tiny"))), trust_remote_code=True)
            for family, build in BUILDERS.items()}


@pytest.fixture(params=["llada", "dream"])
def loaded(request, checkpoints):
    return request.param, checkpoints[request.param]


def _tokens(tokenizer, b: int = 3, t: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask): random ordinary tokens between <bos> and <eos>; the last row padded after position 7."""
    special = set(tokenizer.all_special_ids)
    ordinary = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    ids = ordinary[torch.randint(len(ordinary), (b, t), generator=torch.Generator().manual_seed(0))]
    ids[:, 0], ids[:, -1] = tokenizer.bos_token_id, tokenizer.eos_token_id
    attention = torch.ones(b, t, dtype=torch.long)
    attention[-1, -4:] = 0
    ids[-1, -4:] = tokenizer.pad_token_id
    ids[-1, -5] = tokenizer.eos_token_id
    return ids, attention


def _input_roles(ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    roles = torch.full(ids.shape, int(Role.CONTEXT), dtype=torch.int8)
    roles[:, 0] = Role.SPECIAL
    roles[(ids == ids[0, -1]) & (attention == 1)] = Role.SPECIAL  # <eos>
    roles[attention == 0] = Role.PAD
    for row, positions in SELECTED.items():
        roles[row, list(positions)] = Role.MASKED
    return roles


def unshifted_batch(tokenizer) -> MaskedBatch:
    """LLaDA's objective: the masked positions carry the loss of their own token."""
    original, attention = _tokens(tokenizer)
    roles = _input_roles(original, attention)
    inputs = torch.where(roles == Role.MASKED, tokenizer.mask_token_id, original)
    labels = torch.where(roles == Role.MASKED, original, -100)
    return MaskedBatch(inputs, original, labels, roles, attention, torch.arange(3))


def shifted_batch(tokenizer) -> MaskedBatch:
    """Dream's objective, by hand: position p carries the loss of the token at p + 1 when that one is masked (its
    role is the successor's, whatever p's own input is); every other position carries no loss."""
    original, attention = _tokens(tokenizer)
    input_roles = _input_roles(original, attention)
    inputs = torch.where(input_roles == Role.MASKED, tokenizer.mask_token_id, original)
    carries = torch.zeros_like(attention, dtype=torch.bool)
    carries[:, :-1] = input_roles[:, 1:] == Role.MASKED
    labels = torch.full_like(original, -100)
    labels[:, :-1] = torch.where(carries[:, :-1], original[:, 1:], -100)
    roles = torch.where(carries, torch.tensor(int(Role.MASKED), dtype=torch.int8),
                        torch.where(input_roles == Role.MASKED, torch.tensor(int(Role.CONTEXT), dtype=torch.int8),
                                    input_roles))
    for row in range(3):  # the contract of gradflow.inputs.masking.shift_to_loss_side, row by row
        want_roles, want_labels = shift_to_loss_side(input_roles[row].numpy(),
                                                     torch.where(input_roles[row] == Role.MASKED, original[row],
                                                                 -100).numpy())
        assert np.array_equal(roles[row].numpy(), want_roles) and np.array_equal(labels[row].numpy(), want_labels)
    return MaskedBatch(inputs, original, labels, roles, attention, torch.arange(3), input_roles=input_roles)


def _batch(family: str, tokenizer) -> MaskedBatch:
    return shifted_batch(tokenizer) if family == "dream" else unshifted_batch(tokenizer)


def _record(model, batch, adapter=None):
    with GradFlowRecorder(model, RecorderConfig(materialize=True), adapter=adapter) as rec:
        return rec.record(batch, "mlm"), rec


def split_vs_autograd(model, batch, record, rec) -> tuple[float, int]:
    """(max |sum of the role matrices - autograd's gradient| over every split parameter, parameters checked)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = dict(zip(map(id, params), torch.autograd.grad(mlm_loss(model(**batch.model_inputs()).logits, batch),
                                                          params, allow_unused=True)))
    floor = 1e-3 * max(float(g.norm()) for g in grads.values() if g is not None)
    worst, checked = 0.0, 0
    for name, spec in rec.adapter.sublayers.items():
        for depth, block in enumerate(rec.blocks):
            module = get_module(block, spec.path)
            if not splittable(module):
                continue
            for param in ("weight", "bias"):
                ref = getattr(module, param, None)
                if ref is None:
                    continue
                total = sum(m.double() for (d, s, p, _), m in record.matrices.items() if (d, s, p) == (depth, name, param))
                want = grads[id(ref)].double()
                diff = float((total - want).abs().max())
                assert float((total - want).norm()) <= 1e-5 * max(float(want.norm()), floor), (name, depth, param)
                worst, checked = max(worst, diff), checked + 1
    return worst, checked


def test_checkpoints_load_through_automodel_with_their_registered_adapter(loaded):
    family, lm = loaded
    auto_map = json.loads((Path(lm.path) / "config.json").read_text(encoding="utf-8"))["auto_map"]
    assert (Path(lm.path) / "model.safetensors").is_file()
    assert set(auto_map) == {"AutoConfig", "AutoModel"}
    assert type(lm.model).__name__ == {"llada": "LLaDAModelLM", "dream": "DreamModel"}[family]
    assert lm.adapter.family == family and lm.adapter.shifted_head == (family == "dream")
    assert lm.tokenizer.mask_token_id == lm.model.config.mask_token_id
    assert lm.adapter.after_mixing() == ("attn.q", "attn.out", "ffn.in", "ffn.gate", "ffn.out", "ffn.norm")


def test_head_and_final_norm_reproduce_the_logits(loaded):
    family, lm = loaded
    model, adapter = lm.model, lm.adapter
    batch = _batch(family, lm.tokenizer)
    outputs = []
    last = block_modules(adapter, model.base_model)[-1]
    handle = last.register_forward_hook(lambda m, args, out: outputs.append(out[0]))
    try:
        with torch.no_grad():
            logits = model(**batch.model_inputs()).logits
    finally:
        handle.remove()
    with torch.no_grad():
        mine = adapter.head.function(model)(get_module(model.base_model, adapter.final_norm)(outputs[0]))
    assert torch.equal(mine, logits)


@pytest.mark.parametrize("which", ["registered", "auto"])
def test_split_sums_to_autograd_and_hooks_are_removed(loaded, which):
    family, lm = loaded
    model, batch = lm.model, _batch(family, lm.tokenizer)
    before = [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()]
    record, rec = _record(model, batch, adapter=None if which == "registered" else "auto")
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for m in model.modules()] == before
    assert not any(getattr(p, "_backward_hooks", None) for p in model.parameters())
    assert not any("forward" in m.__dict__ for m in model.modules())  # no forward left swapped
    worst, checked = split_vs_autograd(model, batch, record, rec)
    assert checked == 2 * (9 + 3 * (family == "dream"))  # 9 weights per block, + q/k/v biases for Dream
    assert worst < 1e-6


def _module_output_grads(model, blocks, paths: set[str], batch) -> dict[str, torch.Tensor]:
    """The loss gradient w.r.t. the outputs of modules of the last block, (B, T, D) each, by autograd alone."""
    outputs: dict[str, torch.Tensor] = {}
    handles = [get_module(blocks[-1], path).register_forward_hook(
        lambda m, args, out, path=path: outputs.__setitem__(path, out)) for path in paths]
    try:
        loss = mlm_loss(model(**batch.model_inputs()).logits, batch)
    finally:
        for handle in handles:
            handle.remove()
    return dict(zip(outputs, torch.autograd.grad(loss, list(outputs.values()))))


@pytest.mark.parametrize("which", ["registered", "auto"])
def test_exact_last_block_zero_at_the_positions_without_loss(loaded, which):
    family, lm = loaded
    model, batch = lm.model, _batch(family, lm.tokenizer)
    record, rec = _record(model, batch, adapter=None if which == "registered" else "auto")
    last = record.num_blocks - 1
    grad, _ = record.site(f"blocks.{last}.out")
    for role in NON_LOSS:
        assert torch.all(grad[batch.roles == role] == 0), role
    assert torch.all(grad[batch.roles == Role.MASKED] > 0)
    zero = set(rec.adapter.after_mixing()) if which == "registered" else AFTER_MIXING_PATHS[family]
    mixing = {"attn.k", "attn.v", "attn.norm"} if which == "registered" else MIXING_PATHS[family]
    assert zero | mixing == set(rec.adapter.sublayers)
    frame = record.sublayer_frame()
    rows = frame[(frame.layer == record.num_blocks) & frame.role.isin(["context", "special", "pad"])]
    for row in rows[rows.sublayer.isin(zero)].itertuples():
        assert row.contribution_norm == 0.0 and row.magnitude_sum == 0.0 and row.n_nonzero == 0, row
    for (depth, name, _, role), matrix in record.matrices.items():
        if depth == last and role in ("context", "special", "pad") and name in zero:
            assert torch.count_nonzero(matrix) == 0, (name, role)
    context = rows[(rows.role == "context") & (rows.param == "weight")].set_index("sublayer")
    for name in mixing:  # attention keys, values and the pre-norm reach every position
        assert context.loc[name, "contribution_norm"] > 0, name
    early = frame[(frame.layer < record.num_blocks) & (frame.role == "context") & (frame.param == "weight")]
    assert (early.contribution_norm > 0).all()
    # per position, by autograd alone: the module outputs of the last block's after-mixing sublayers
    paths = {rec.adapter.sublayers[name].path for name in zero}
    no_loss = batch.labels == -100
    for path, g in _module_output_grads(model, rec.blocks, paths, batch).items():
        assert torch.all(g[no_loss] == 0), path
        assert torch.all(g[~no_loss].abs().amax(-1) > 0), path


def test_dream_shifted_zero_sits_where_no_loss_is_whatever_the_input(checkpoints):
    lm = checkpoints["dream"]
    batch = shifted_batch(lm.tokenizer)
    masked_input = batch.input_ids == lm.tokenizer.mask_token_id
    masked_no_loss = masked_input & (batch.labels == -100)  # e.g. row 0 position 10: its successor is <eos>
    clean_with_loss = ~masked_input & (batch.labels != -100)  # e.g. row 0 position 2, before masked 3
    assert masked_no_loss[0, 10] and clean_with_loss[0, 2] and clean_with_loss[2, 0]  # <bos> before a masked token
    assert masked_input[1, 3] and batch.roles[1, 3] == Role.MASKED  # a masked input before a masked one: loss
    record, rec = _record(lm.model, batch)
    last = record.num_blocks - 1
    for site in (f"blocks.{last}.mid", f"blocks.{last}.out"):
        grad, _ = record.site(site)
        assert torch.all(grad[masked_no_loss] == 0) and torch.all(grad[clean_with_loss] > 0), site
    paths = {rec.adapter.sublayers[name].path for name in rec.adapter.after_mixing()}
    for path, g in _module_output_grads(lm.model, rec.blocks, paths, batch).items():
        assert torch.all(g[masked_no_loss] == 0) and torch.all(g[clean_with_loss].abs().amax(-1) > 0), path
    # the same through the library's own shifted objective (masked diffusion, t = 0.4)
    texts = ["The progress of public credit is witnessed by a considerable rise of American stock abroad.",
             "We must ensure that the laws are faithfully executed."]
    drawn = mask_batch(lm.tokenizer, texts, MaskedDiffusion(ratio=0.4, seed=3, shift=True, min_selected=2))
    no_loss_but_masked = (drawn.input_roles == Role.MASKED) & (drawn.roles == Role.CONTEXT)
    assert no_loss_but_masked.any()
    record, rec = _record(lm.model, drawn)
    grad, _ = record.site(f"blocks.{last}.out")
    assert torch.all(grad[no_loss_but_masked] == 0) and torch.all(grad[drawn.roles == Role.MASKED] > 0)
    worst, _ = split_vs_autograd(lm.model, drawn, record, rec)
    assert worst < 1e-6


def test_the_base_model_cannot_run_alone_so_the_whole_model_runs(loaded):
    """Why both adapters state ``run_whole_model`` (not ``head_mixes_positions``: their heads are position-wise): the
    recorder's head-at-the-loss-positions path calls the base model with the batch's inputs and reads its
    last_hidden_state; LLaDA's base model returns logits instead, Dream's takes only the 4-D mask DreamModel.forward
    builds. The recorder runs the whole model for them; sparse training stops the whole model at the last block."""
    family, lm = loaded
    assert lm.adapter.run_whole_model and lm.adapter.head_mixes_positions is None
    assert lm.adapter.subset_block is not None
    with GradFlowRecorder(lm.model, RecorderConfig()) as rec:
        assert rec._position_wise_head() is None
    inputs = _batch(family, lm.tokenizer).model_inputs()
    with torch.no_grad():
        if family == "llada":
            out = lm.model.base_model(**inputs)
            assert not hasattr(out, "last_hidden_state") and out.logits.shape[-1] == len(lm.tokenizer)
        else:
            with pytest.raises(RuntimeError, match="attn_mask"):
                lm.model.base_model(**inputs)


def test_check_counts_llada_s_output_layer_as_head_compute(checkpoints):
    """LLaDA's output layer ``ff_out`` sits inside its base model (``HeadSpec.in_base_model``): ``gradflow check``
    counts it at the loss positions, as every other MLM head, not at every position as encoder compute."""
    from gradflow.runs.check import check_batch

    lm = checkpoints["llada"]
    batch = _batch("llada", lm.tokenizer)
    flops = check_batch(lm.model, batch, lm.adapter).flops
    ff_out = get_module(lm.model, "model.transformer.ff_out")
    assert flops.encoder_other == 0  # wte is a look-up; ff_out is the only Linear outside the blocks
    assert flops.head == 3 * 2 * ff_out.in_features * ff_out.out_features * flops.loss_tokens
    assert flops.head_unselected == 3 * 2 * ff_out.in_features * ff_out.out_features * flops.unselected_tokens
