"""Counts and the progress bar of a recording (``gradflow record``): what its meta.json reports."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pandas as pd

from gradflow.hooks.recorder import BatchRecord
from gradflow.inputs.corpus import CorpusCounts
from gradflow.progress import progress_bar
from gradflow.roles import ALL_ROLES, TOKEN_ROLES
from gradflow.runs.job import RoleTally
from gradflow.schema import EXPERT_DTYPES, EXPERTS_FILE, ROUTER_AUX_DTYPES, ROUTER_AUX_FILE

NONFINITE_REASON = "loss or a recorded norm was NaN/inf; such batches are counted, never averaged in"


@dataclass
class RecordStats(RoleTally):
    """Counts of a recording: the recorded batches' roles (:class:`RoleTally`), skipped non-finite batches,
    summed loss; ``expert_rows``: ``"<depth>|<experts>|<expert>"`` -> the rows of each role (all roles, by code)
    routed to that expert (mixture-of-experts models; ``experts.csv``); ``aux_sum``: the summed auxiliary router loss
    term, ``aux_coef`` its coefficient, ``router_aux``: ``"<depth>|<sublayer>|<param>"`` -> [summed norm of the
    weight's gradient from the loss, from the term, batches] (``--router-aux-loss``; ``router_aux.csv``)."""

    nonfinite_batches: int = 0
    nonfinite_sequences: int = 0
    loss_sum: float = 0.0
    expert_rows: dict[str, list[int]] = field(default_factory=dict)
    aux_sum: float = 0.0
    aux_coef: float | None = None
    router_aux: dict[str, list[float]] = field(default_factory=dict)

    def add_record(self, record: BatchRecord) -> None:
        """Count one recorded batch (its roles are (B, T) codes), its loss and its rows routed to each expert."""
        self.add(record.roles)
        self.loss_sum += record.loss
        for (depth, name), table in record.expert_counts.items():
            for expert, counts in enumerate(table.tolist()):
                self._add_rows(f"{depth}|{name}|{expert}", counts)
        self.aux_sum += record.aux_loss or 0.0
        for (depth, name, param), (norm_loss, norm_aux) in record.router_aux.items():
            self._add_aux(f"{depth}|{name}|{param}", [norm_loss, norm_aux, 1])

    def _add_aux(self, key: str, sums: list[float]) -> None:
        old = self.router_aux.get(key)
        self.router_aux[key] = list(sums) if old is None else [a + b for a, b in zip(old, sums)]

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
        for name in ("nonfinite_batches", "nonfinite_sequences", "loss_sum", "aux_sum"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for key, counts in other.expert_rows.items():
            self._add_rows(key, counts)
        for key, sums in other.router_aux.items():
            self._add_aux(key, sums)

    def tables(self) -> list[tuple[str, pd.DataFrame, tuple[str, ...]]]:
        """The optional tables these counts make: (file, frame, columns): ``experts.csv`` for mixtures of experts,
        ``router_aux.csv`` with ``--router-aux-loss``."""
        tables = [(EXPERTS_FILE, self.expert_frame(), tuple(EXPERT_DTYPES))] if self.expert_rows else []
        if self.router_aux:
            tables.append((ROUTER_AUX_FILE, self.router_aux_frame(), tuple(ROUTER_AUX_DTYPES)))
        return tables

    def router_aux_frame(self) -> pd.DataFrame:
        """``router_aux.csv``: per (layer, sublayer, param) the mean over batches of the norms of the weight's gradient
        from the loss and from the auxiliary term."""
        rows = []
        for key, (loss, aux, batches) in self.router_aux.items():
            depth, name, param = key.split("|")
            rows.append({"layer": int(depth) + 1, "sublayer": name, "param": param, "norm_loss": loss / batches,
                         "norm_aux": aux / batches})
        frame = pd.DataFrame(rows, columns=list(ROUTER_AUX_DTYPES))
        return frame.sort_values(["layer", "sublayer", "param"], kind="stable").reset_index(drop=True)

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

    def aux_meta(self, requested: float | str | None) -> dict:
        """meta.json's ``router_aux_loss`` block (``--router-aux-loss`` only; else nothing)."""
        if requested is None:
            return {}
        return {"router_aux_loss": {"requested": requested, "coefficient": self.aux_coef,
                                    "mean_term": self.aux_sum / self.batches if self.batches else None,
                                    "table": ROUTER_AUX_FILE}}


def record_counts(counts: CorpusCounts, stats: RecordStats, prompted: bool) -> dict:
    """The ``counts`` block of a record run's meta.json: what was read (``counts``) and recorded (``stats``)."""
    return {
        "documents": counts.documents, "windows": counts.windows, "split_documents": counts.split_documents,
        **({"truncated_responses": counts.truncated_responses} if prompted else {}),
        "sequences_recorded": stats.sequences, "batches": stats.batches, "tokens_per_role": stats.tokens,
        "skipped": {"empty_documents": counts.skipped_empty_documents,
                    "nonfinite_batches": stats.nonfinite_batches,
                    "nonfinite_sequences": stats.nonfinite_sequences, "reason_nonfinite": NONFINITE_REASON},
    }


def aux_setting(requested: float | str | None) -> dict:
    """``{"router_aux_loss": "model" or the coefficient}`` with ``--router-aux-loss`` (what a resumed run must share
    with its checkpoint); else nothing (as before)."""
    return {} if requested is None else {"router_aux_loss": requested}


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


__all__ = ["NONFINITE_REASON", "RecordProgress", "RecordStats", "aux_setting", "record_counts"]
