"""The recorder's state while it captures one batch (typed; internal to :mod:`gradflow.hooks`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gradflow.hooks.linear_inputs import InputSlot
from gradflow.hooks.records import RecorderConfig
from gradflow.hooks.split_linear import DirectSplit
from gradflow.roles import NUM_ROLES

SublayerStats = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]
"""Per role, (NUM_ROLES,) each: n_positions, n_nonzero, magnitude_sum, contribution_norm; then the
(B, T) per-position magnitudes or None."""


@dataclass(frozen=True)
class RolePartition:
    """The positions of a (B, T) batch flattened to B * T rows, split by role.

    ``codes``: (B * T,) long role code per row; ``index``: NUM_ROLES tensors of row indices;
    ``counts``: (NUM_ROLES,) long number of rows per role; ``count_list``: the same as Python ints.
    """

    codes: torch.Tensor
    index: list[torch.Tensor]
    counts: torch.Tensor
    count_list: tuple[int, ...]

    @property
    def present(self) -> list[int]:
        """The role codes with at least one row."""
        return [code for code, count in enumerate(self.count_list) if count]

    @classmethod
    def of_roles(cls, roles: torch.Tensor) -> "RolePartition":
        """The partition of (B, T) role codes."""
        return cls.of_codes(roles.reshape(-1).long())

    @classmethod
    def of_codes(cls, flat: torch.Tensor) -> "RolePartition":
        """The partition of (N,) long role codes."""
        index = [torch.nonzero(flat == code).squeeze(1) for code in range(NUM_ROLES)]
        counts = torch.bincount(flat, minlength=NUM_ROLES)
        return cls(flat, index, counts, tuple(counts.tolist()))


@dataclass
class BatchState:
    """What the hooks gather during one capture.

    ``roles``: (B, T) int8; ``grad`` and ``act``: per site, the (B, T) float32 norms of the loss
    gradient and of the hidden state (None until seen); ``calls``: calls per (depth, id(module))
    of a sublayer module; ``sublayers``: (depth, sublayer, param) -> :data:`SublayerStats`;
    ``matrices``: (depth, sublayer, param, role) -> summed gradient, when materialised;
    ``emb_out``: the embeddings output and ``extra_targets`` the non-token sublayer outputs
    (the targets of ``torch.autograd.grad``); ``loss``: the loss value; ``module_calls``: calls
    per id(module) over all depths; ``deferred``: id(weight) -> the statistics of a Linear call
    that wait for the largest role's product, computed by the weight gradient's backward
    (:mod:`gradflow.hooks.split_linear`); ``finish(None)`` computes it directly instead; ``inputs``: the
    input side of the last Linear input (shared by the modules that read it, :mod:`gradflow.hooks.linear_inputs`);
    ``scratch``: float32 buffers reused by the calls of the batch (:meth:`buffer`); ``experts``: (depth, sublayer,
    param) -> the expert weights' sums accumulated over experts (:class:`~gradflow.hooks.experts.ExpertSums`, turned
    into ``sublayers`` entries when the record is made); ``expert_counts``: (depth, experts name) -> (E, NUM_ROLES)
    long, the rows of each role routed to each expert.
    """

    config: RecorderConfig
    roles: torch.Tensor
    partition: RolePartition
    sequence_index: torch.Tensor
    grad: list[torch.Tensor | None]
    act: list[torch.Tensor | None]
    calls: dict[tuple[int, int], int] = field(default_factory=dict)
    sublayers: dict[tuple[int, str, str], SublayerStats] = field(default_factory=dict)
    matrices: dict[tuple[int, str, str, str], torch.Tensor] = field(default_factory=dict)
    emb_out: torch.Tensor | None = None
    extra_targets: list[torch.Tensor] = field(default_factory=list)
    loss: float = float("nan")
    module_calls: dict[int, int] = field(default_factory=dict)
    deferred: dict[int, DirectSplit] = field(default_factory=dict)
    inputs: InputSlot = field(default_factory=InputSlot)
    scratch: dict[tuple, torch.Tensor] = field(default_factory=dict)
    experts: dict[tuple[int, str, str], object] = field(default_factory=dict)
    expert_counts: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def start(cls, config: RecorderConfig, roles: torch.Tensor, sequence_index: torch.Tensor | None,
              num_sites: int) -> "BatchState":
        """An empty state for a batch with (B, T) ``roles`` and ``num_sites`` sites."""
        roles = roles.to(torch.int8)
        if sequence_index is None:
            sequence_index = torch.arange(roles.shape[0])
        return cls(config, roles, RolePartition.of_roles(roles), sequence_index, [None] * num_sites,
                   [None] * num_sites)

    @property
    def b(self) -> int:
        """Batch size B."""
        return int(self.roles.shape[0])

    @property
    def t(self) -> int:
        """Sequence length T."""
        return int(self.roles.shape[1])

    def buffer(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A float32 scratch tensor (uninitialised) of ``shape``, allocated once per batch and reused by every
        call asking for the same ``name`` and shape: its pages are touched once a batch, not once a call.
        The caller consumes it before the next call asks for it."""
        key = (name, shape, device)
        buffer = self.scratch.get(key)
        if buffer is None:
            buffer = self.scratch[key] = torch.empty(shape, dtype=torch.float32, device=device)
        return buffer

    def release_graph(self) -> None:
        """Drop the references into the autograd graph (the embeddings output, extra targets)."""
        self.emb_out = None
        self.extra_targets = []
        self.deferred = {}
        self.inputs.clear()
        self.scratch = {}


__all__ = ["BatchState", "RolePartition", "SublayerStats"]
