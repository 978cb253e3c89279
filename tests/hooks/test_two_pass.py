"""The recorder on a two-pass model (a tiny native DiffusionGemma): the prompt pass and the canvas pass of each depth
joined into one block record (:mod:`gradflow.hooks.passes`).

Checked on every split parameter of every depth (attention, norms, gated MLP, router, fused experts): the roles'
sum is autograd's gradient over both passes (the tied weights' ``.grad``), to 1e-5 of its norm. The exact zeros, as
``== 0``, under each objective:

- masked diffusion (loss at 3 of 16 canvas positions): in the last block every after-mixing sublayer gets exactly
  zero from ``context`` and from ``prompt`` positions, and the sites ``blocks.2.mid``/``blocks.2.out`` get zero
  gradient at both; the key path (``attn.k``, ``attn.norm``) does not;
- the published recipe (loss on the whole canvas): no canvas position is without loss, so the zero left is the
  prompt's: every after-mixing sublayer of the last block and its ``mid``/``out`` sites at the prompt positions.
"""

from __future__ import annotations

import pytest
import torch

from gradflow.adapters import adapter_for
from gradflow.errors import RecorderError
from gradflow.hooks.recorder import GradFlowRecorder, RecorderConfig
from gradflow.losses import get_loss
from gradflow.roles import ALL_ROLES, Role
from tiny_diffusion_gemma import PROMPT, tiny_diffusion_gemma, two_pass_batch

LAST = 2
OBJECTIVES = {"masked diffusion": False, "whole canvas": True}


def _record(model, batch, **config):
    with GradFlowRecorder(model, RecorderConfig(materialize=True, **config)) as rec:
        return rec.record(batch), rec.adapter


def _autograd(model, batch) -> float:
    """The same loss through plain autograd into the parameters' ``.grad``; returns it."""
    model.zero_grad()
    spec = adapter_for(model).two_pass
    logits = model(**spec.model_inputs(batch.input_ids, batch.attention_mask, batch.prompt_width)).logits
    placed = torch.cat([logits.new_zeros(logits.shape[0], PROMPT, logits.shape[2]), logits], dim=1)
    loss = get_loss("mlm", "batch")(placed, batch)
    loss.backward()
    return float(loss.detach())


def _parameter(model, adapter, depth: int, sublayer: str, param: str) -> torch.Tensor:
    """The decoder block's parameter (the encoder's is the same tensor)."""
    layer = model.model.decoder.layers[depth]
    if sublayer.startswith("ffn.experts."):
        return getattr(layer.get_submodule(adapter.experts["ffn.experts"].path), sublayer.rsplit(".", 1)[1])
    return getattr(layer.get_submodule(adapter.sublayers[sublayer].path), param)


@pytest.mark.parametrize("whole", OBJECTIVES.values(), ids=OBJECTIVES.keys())
def test_split_sums_to_autograd_over_both_passes(whole):
    """Every recorded parameter of every depth: the roles' matrices sum to the tied weight's ``.grad``; in every
    block but the last the prompt's share is not zero (a split of the canvas pass alone would miss it)."""
    model = tiny_diffusion_gemma()
    batch = two_pass_batch(whole_canvas=whole)
    record, adapter = _record(model, batch)
    loss = _autograd(model, batch)
    assert record.loss == pytest.approx(loss, rel=1e-6)
    assert record.roles.shape == batch.roles.shape and record.grad_norm.shape[1:] == batch.roles.shape
    names = {(s.depth, s.sublayer) for s in record.sublayers}
    assert len(names) == 3 * 15 - 1  # 15 a block (13 sublayers, 2 expert weights); no attn.v in the full layer
    worst = 0.0
    for s in record.sublayers:
        grad = _parameter(model, adapter, s.depth, s.sublayer, s.param).grad
        total = sum(record.matrices[(s.depth, s.sublayer, s.param, role)] for role in ALL_ROLES
                    if (s.depth, s.sublayer, s.param, role) in record.matrices)
        error = float((total - grad).norm() / grad.norm())
        worst = max(worst, error)
        assert error <= 1e-5, (s.depth, s.sublayer, error)
        if s.depth < LAST:
            assert s.contribution_norm[int(Role.PROMPT)] > 1e-3 * float(grad.norm()), (s.depth, s.sublayer)
    assert worst > 0  # float32 rounding, not a copy of .grad


@pytest.mark.parametrize("whole", OBJECTIVES.values(), ids=OBJECTIVES.keys())
def test_exact_zeros_at_the_last_block(whole):
    model = tiny_diffusion_gemma()
    batch = two_pass_batch(whole_canvas=whole)
    record, adapter = _record(model, batch)
    after = set(adapter.after_mixing())
    zero_roles = ["prompt"] if whole else ["prompt", "context"]
    loss_roles = ["random", "kept"] if whole else ["masked"]
    last = [s for s in record.sublayers if s.depth == LAST]
    assert {s.sublayer for s in last} >= after
    for s in last:
        key_path = s.sublayer not in after
        for role in zero_roles:
            code = int(Role[role.upper()])
            assert s.n_positions[code] > 0
            if key_path:  # keys (and values: the full layer's keys are its values) read every position
                assert s.contribution_norm[code] > 0, (s.sublayer, role)
            else:
                assert s.contribution_norm[code] == 0 and s.n_nonzero[code] == 0, (s.sublayer, role)
                assert torch.count_nonzero(record.matrices[(LAST, s.sublayer, s.param, role)]) == 0
        for role in loss_roles:
            assert s.contribution_norm[int(Role[role.upper()])] > 0, (s.sublayer, role)
    roles = record.roles
    no_loss = (roles == Role.PROMPT) | (roles == Role.CONTEXT)
    for point in ("mid", "out"):
        grad = record.grad_norm[record.site_names.index(f"blocks.{LAST}.{point}")]
        assert torch.all(grad[no_loss] == 0) and torch.all(grad[~no_loss] > 0), point
    earlier = record.grad_norm[record.site_names.index(f"blocks.{LAST - 1}.out")]
    assert torch.all(earlier > 0)  # the prompt's earlier layers feed the keys the canvas reads


def test_prompt_padding_contributes_nothing_and_is_joined():
    """A right-padded prompt (masked out as keys): its ``pad`` positions get exactly zero everywhere, so the role
    present in a pass of its own adds exactly, and the split still sums to autograd."""
    model = tiny_diffusion_gemma()
    batch = two_pass_batch(prompt_pad=True)
    record, adapter = _record(model, batch)
    _autograd(model, batch)
    pad = int(Role.PAD)
    for s in record.sublayers:
        assert s.n_positions[pad] == 2 and s.contribution_norm[pad] == 0, (s.depth, s.sublayer)
        grad = _parameter(model, adapter, s.depth, s.sublayer, s.param).grad
        total = sum(m for (d, n, p, _), m in record.matrices.items() if (d, n, p) == (s.depth, s.sublayer, s.param))
        assert float((total - grad).norm()) <= 1e-5 * float(grad.norm()), (s.depth, s.sublayer)
    assert torch.all(record.grad_norm[:, record.roles == Role.PAD] == 0)


def test_hooks_removed_and_one_sequence_refused():
    model = tiny_diffusion_gemma()
    def count():
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    before = count()
    batch = two_pass_batch()
    batch.prompt_width = None
    with GradFlowRecorder(model) as rec:
        assert count() > before
        with pytest.raises(RecorderError, match="record a batch of prompt and canvas"):
            rec.record(batch)
        with pytest.raises(RecorderError, match="the canvas only"):
            rec.record(two_pass_batch(), loss="all-positions")
    assert count() == before
