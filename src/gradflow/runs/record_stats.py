"""Counts and the progress bar of a recording (``gradflow record``): what its meta.json reports."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pandas as pd

from gradflow.hooks.recorder import BatchRecord
from gradflow.progress import progress_bar
from gradflow.roles import ALL_ROLES, TOKEN_ROLES
from gradflow.runs.job import RoleTally
from gradflow.schema import EXPERT_DTYPES

NONFINITE_REASON = "loss or a recorded norm was NaN/inf; such batches are counted, never averaged in"


@dataclass
class RecordStats(RoleTally):
    """Counts of a recording: the recorded batches' roles (:class:`RoleTally`), skipped non-finite batches,
    summed loss; ``expert_rows``: ``"<depth>|<experts>|<expert>"`` -> the rows of each role (all roles, by code)
    routed to that expert (mixture-of-experts models; ``experts.csv``)."""

    nonfinite_batches: int = 0
    nonfinite_sequences: int = 0
    loss_sum: float = 0.0
    expert_rows: dict[str, list[int]] = field(default_factory=dict)

    def add_record(self, record: BatchRecord) -> None:
        """Count one recorded batch (its roles are (B, T) codes), its loss and its rows routed to each expert."""
        self.add(record.roles)
        self.loss_sum += record.loss
        for (depth, name), table in record.expert_counts.items():
            for expert, counts in enumerate(table.tolist()):
                self._add_rows(f"{depth}|{name}|{expert}", counts)

    def _add_rows(self, key: str, counts: list[int]) -> None:
        old = self.expert_rows.get(key)
        self.expert_rows[key] = list(counts) if old is None else [a + b for a, b in zip(old, counts)]

    def skip(self, sequences: int) -> None:
        """Count one batch left out because its loss or a norm was not finite."""
        self.nonfinite_batches += 1
        self.nonfinite_sequences += sequences

    def merge(self, other: RecordStats) -> None:
        """Add another process's counts to these."""
        super().merge(other)
        for name in ("nonfinite_batches", "nonfinite_sequences", "loss_sum"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for key, counts in other.expert_rows.items():
            self._add_rows(key, counts)

    def expert_frame(self) -> pd.DataFrame:
        """``experts.csv``: one row per (layer, experts, expert, token role), roles in display order."""
        rows = []
        for key, counts in self.expert_rows.items():
            depth, name, expert = key.split("|")
            rows += [{"layer": int(depth) + 1, "experts": name, "expert": int(expert), "role": role,
                      "n_rows": counts[ALL_ROLES.index(role)]} for role in TOKEN_ROLES]
        frame = pd.DataFrame(rows, columns=list(tuple(EXPERT_DTYPES)))
        return frame.sort_values(["layer", "experts", "expert"], kind="stable").reset_index(drop=True)

    @property
    def mean_loss(self) -> float | None:
        """Mean loss per recorded batch (None before the first batch)."""
        return self.loss_sum / self.batches if self.batches else None


class RecordProgress:
    """A tqdm bar with sequences, tokens and tokens/s (or nothing when quiet). On a terminal it redraws
    up to 10 times a second; into a log file (stderr not a terminal) one line every 30 s and at the end."""

    def __init__(self, quiet: bool):
        self.bar = None
        self.tokens = 0
        self.start = time.time()
        if not quiet:
            self.bar = progress_bar(unit="seq", desc="recording", dynamic_ncols=True)

    def update(self, sequences: int, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(sequences)
            rate = self.tokens / max(time.time() - self.start, 1e-9)
            self.bar.set_postfix(tokens=self.tokens, tok_s=f"{rate:.0f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


__all__ = ["NONFINITE_REASON", "RecordProgress", "RecordStats"]
