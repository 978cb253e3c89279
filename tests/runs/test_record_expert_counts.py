"""``experts.csv``'s counts (:class:`gradflow.runs.record_stats.RecordStats`): summed over batches, kept through a
checkpoint (JSON), merged across processes, written one row per (layer, experts, expert, token role)."""

from __future__ import annotations

import json

import torch

from gradflow.roles import ALL_ROLES, TOKEN_ROLES, Role
from gradflow.runs.record_stats import RecordStats
from gradflow.runs.resume import restore_fields, stats_state
from gradflow.schema import EXPERT_DTYPES


class _Record:
    """The parts of a BatchRecord that RecordStats reads."""

    def __init__(self, counts: dict):
        self.roles = torch.full((1, 4), int(Role.CONTEXT), dtype=torch.int8)
        self.loss = 1.0
        self.expert_counts = counts
        self.aux_loss = None
        self.router_aux = {}


def _table(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor([row + [0] * (len(ALL_ROLES) - len(row)) for row in rows])


def test_expert_counts_add_survive_a_checkpoint_and_merge():
    first = {(0, "ffn.experts"): _table([[1, 0, 0, 3], [0, 0, 0, 4]]), (1, "ffn.experts"): _table([[2], [5]])}
    second = {(0, "ffn.experts"): _table([[0, 1, 0, 2], [1, 0, 0, 0]]), (1, "ffn.experts"): _table([[0], [1]])}
    stats = RecordStats()
    stats.add_record(_Record(first))
    stats.add_record(_Record(second))
    restored = RecordStats()
    restore_fields(restored, json.loads(json.dumps(stats_state(stats))))
    assert restored.expert_rows == stats.expert_rows
    other = RecordStats()
    other.add_record(_Record(first))
    restored.merge(other)
    frame = restored.expert_frame()
    assert tuple(frame.columns) == tuple(EXPERT_DTYPES) and len(frame) == 4 * len(TOKEN_ROLES)
    got = frame.set_index(["layer", "experts", "expert", "role"]).n_rows
    assert got[(1, "ffn.experts", 0, "context")] == 3 + 2 + 3
    assert got[(1, "ffn.experts", 1, "masked")] == 0 + 1 + 0
    assert got[(1, "ffn.experts", 0, "random")] == 1
    assert got[(2, "ffn.experts", 1, "masked")] == 5 + 1 + 5
    assert int(frame.n_rows.sum()) == 2 * sum(int(t.sum()) for t in first.values()) + \
        sum(int(t.sum()) for t in second.values())
