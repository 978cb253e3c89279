"""Two-pass models (DiffusionGemma): one batch state per pass while capturing, joined into one for the record.

A two-pass adapter (:mod:`gradflow.adapters.two_pass`) runs the prompt's ``P`` positions through the first pass's
blocks and the canvas's ``C`` positions through the second pass's, whose parameters are the first's, depth by depth.
While capturing, the recorder keeps one :class:`~gradflow.hooks.batch_state.BatchState` per pass (the hooks of a
pass take the roles of its own positions, (B, P) or (B, C)), switched when a pass starts. A tied weight's gradient
is the sum of both passes' contributions; every role's contribution comes from one pass (the prompt's positions are
``prompt`` or ``pad``, the canvas's never ``prompt``), so per role the two passes' statistics add, and the split
sums to autograd's gradient over both passes. A role present in both passes (``pad``, padding of the prompt and of
the canvas) must have an exactly zero contribution in one of them (padding is masked out as a key and carries no
loss: its gradient is exactly zero), else the record is refused. :func:`join_states` makes the (B, P + C) state.
"""

from __future__ import annotations

import torch

from gradflow.adapters import Adapter
from gradflow.adapters.two_pass import canvas_logits
from gradflow.errors import RecorderError
from gradflow.hooks.batch_state import BatchState, RolePartition, SublayerStats
from gradflow.hooks.records import RecorderConfig
from gradflow.inputs.batch import MaskedBatch
from gradflow.roles import ALL_ROLES


def pass_states(config: RecorderConfig, roles: torch.Tensor, sequence_index: torch.Tensor | None, num_sites: int,
                widths: tuple[int, ...] | None, adapter: Adapter) -> list[BatchState]:
    """One empty state per pass: the (B, T) ``roles`` cut along T into ``widths`` (their sum T), in pass order; one
    state of the whole batch for a one-pass ``adapter`` (``widths`` None)."""
    if (widths is None) != (adapter.two_pass is None):
        raise RecorderError("a two-pass model's capture takes the widths of its passes (P, C), and only it does")
    if widths is None:
        return [BatchState.start(config, roles, sequence_index, num_sites)]
    if sum(widths) != roles.shape[1] or any(w < 1 for w in widths):
        raise RecorderError(f"the passes' widths {widths} do not split the batch's {roles.shape[1]} positions")
    starts = [sum(widths[:k]) for k in range(len(widths))]
    return [BatchState.start(config, roles[:, a:a + w], sequence_index, num_sites) for a, w in zip(starts, widths)]


def join_states(states: list[BatchState]) -> BatchState:
    """The state of the whole (B, P + C) batch from the passes' states (after ``finish_experts`` on each): per site
    the (B, T_k) norms side by side (a site a pass's gradient never reached: zeros), per sublayer parameter the
    passes' per-role statistics added (a pass whose gradient never reached it: its positions counted, zero
    contribution), materialised matrices and expert counts added."""
    first = states[0]
    roles = torch.cat([s.roles for s in states], dim=1)
    joined = BatchState(first.config, roles, RolePartition.of_roles(roles), first.sequence_index,
                        [None] * len(first.act), [None] * len(first.act), loss=first.loss)
    for i in range(len(first.act)):
        if all(s.act[i] is not None for s in states):
            joined.act[i] = torch.cat([s.act[i] for s in states], dim=1)
            joined.grad[i] = torch.cat([s.grad[i] if s.grad[i] is not None else torch.zeros_like(s.act[i])
                                        for s in states], dim=1)
    keys = list(dict.fromkeys(key for s in states for key in s.sublayers))
    for key in keys:
        parts = [s.sublayers.get(key) or _untouched(s) for s in states]
        _check_disjoint(key, parts)
        positions = [p[4] for p in parts]
        joined.sublayers[key] = (sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts),
                                 sum(p[3] for p in parts),
                                 None if any(p is None for p in positions) else torch.cat(positions, dim=1))
    for s in states:
        for key, matrix in s.matrices.items():
            joined.matrices[key] = joined.matrices[key] + matrix if key in joined.matrices else matrix
        for key, counts in s.expert_counts.items():
            joined.expert_counts[key] = joined.expert_counts[key] + counts if key in joined.expert_counts else counts
    shapes = {key[:3]: matrix for key, matrix in joined.matrices.items()}
    for key, matrix in shapes.items():  # a role of a pass its gradient never reached: an exactly zero matrix
        for code in joined.partition.present:
            joined.matrices.setdefault((*key, ALL_ROLES[code]), torch.zeros_like(matrix))
    return joined


def _untouched(state: BatchState) -> SublayerStats:
    """The statistics of a sublayer parameter whose gradient never reached this pass: its positions counted, no
    contribution (autograd computed none: exactly zero)."""
    counts = state.partition.counts
    zeros = torch.zeros(counts.shape, dtype=torch.float32, device=counts.device)
    position = (torch.zeros(state.roles.shape, dtype=torch.float32, device=counts.device)
                if state.config.position_magnitudes else None)
    return counts.clone(), zeros, zeros, zeros, position


def _check_disjoint(key: tuple, parts: list[SublayerStats]) -> None:
    """Refuse a role that contributes in more than one pass: its norm would not be the sum of the passes' norms."""
    live = torch.stack([(p[3] > 0).to(torch.long) for p in parts]).sum(dim=0)
    if bool((live > 1).any()):
        role = ALL_ROLES[int(torch.nonzero(live > 1)[0])]
        raise RecorderError(f"role {role!r} contributes to {'.'.join(map(str, key))} in both passes of a two-pass "
                            "model, so its norm is not the sum of the passes' norms: give the prompt's and the "
                            "canvas's positions different roles")


def check_pass_loss(adapter: Adapter, loss: object) -> None:
    """Refuse the all-positions loss on a two-pass model (its logits cover the canvas only)."""
    if adapter.two_pass is not None and loss == "all-positions":
        raise RecorderError(f"{adapter.family} predicts the canvas only: the loss on every canvas position is the "
                            "random-canvas objective's own loss (--objective random-canvas), not all-positions")


def pass_inputs(adapter: Adapter, batch: MaskedBatch) -> dict:
    """The forward's keyword arguments of ``batch``: its own (one pass), or cut into prompt and canvas (two)."""
    spec = adapter.two_pass
    if spec is None:
        return batch.model_inputs()
    if batch.prompt_width is None:
        raise RecorderError(f"{adapter.family} runs a prompt and a canvas through two passes: record a batch of "
                            "prompt and canvas (gradflow.inputs.canvas.canvas_batch), not one sequence")
    return {**batch.extra_inputs, **spec.model_inputs(batch.input_ids, batch.attention_mask, batch.prompt_width)}


def pass_widths(adapter: Adapter, batch: MaskedBatch) -> tuple[int, ...] | None:
    """(P, C) of a two-pass batch; None for a one-pass adapter."""
    if adapter.two_pass is None:
        return None
    if batch.prompt_width is None:
        pass_inputs(adapter, batch)  # raises the one sentence
    return (batch.prompt_width, batch.input_ids.shape[1] - batch.prompt_width)


def placed_logits(adapter: Adapter, batch: MaskedBatch, logits: torch.Tensor) -> torch.Tensor:
    """The model's logits at the batch's positions: as they are (one pass), or the canvas's placed after the prompt."""
    if adapter.two_pass is None:
        return logits
    return canvas_logits(logits, batch.prompt_width)


__all__ = ["check_pass_loss", "join_states", "pass_inputs", "pass_states", "pass_widths", "placed_logits"]
