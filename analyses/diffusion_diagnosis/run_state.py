"""A diagnosis run's training state on disk, so a long run (rule 5's budgets) goes in ``--max-minutes`` chunks.

A run's state is everything its next step depends on: the model's and the optimizer's tensors, the schedule's
position, the two generators (windows and masking; ratios), the last 25 losses (the logged train loss), the
checkpoints measured so far and the time spent. :func:`save` writes it atomically to ``<out>/<cell>-s<seed>.state.pt``
(float32, about 3x the model: not committed, ``.gitignore``); :func:`load` gives it back, and a resumed run equals one
that never stopped, bit for bit on the same machine (tests/analyses/test_diffusion_diagnosis.py).
:func:`write_partial` keeps the checkpoints measured so far in ``<out>/<cell>-s<seed>.partial.json`` (committed as
they come: a machine that does not come back loses only the state).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class RunState:
    """Where a run stands. ``step``: the next training step to take (steps done so far); ``measured``: whether the
    checkpoint at ``step`` (if any) is already in ``checkpoints``; times in seconds."""

    step: int
    losses: list[float]
    checkpoints: list[dict]
    train_s: float
    wall_s: float
    cpu_s: float
    tensors: dict = field(default_factory=dict, repr=False)

    @property
    def measured(self) -> bool:
        return bool(self.checkpoints) and self.checkpoints[-1]["step"] == self.step


def state_path(out: Path, cell: str, seed: int) -> Path:
    return out / f"{cell}-s{seed}.state.pt"


def partial_path(out: Path, cell: str, seed: int) -> Path:
    return out / f"{cell}-s{seed}.partial.json"


def save(path: Path, state: RunState, model, opt, schedule, gen: torch.Generator, ratio_gen: torch.Generator) -> None:
    """Write ``state`` with the live objects' states to ``path`` (a temporary file first, then renamed)."""
    payload = {"step": state.step, "losses": state.losses[-25:], "checkpoints": state.checkpoints,
               "train_s": state.train_s, "wall_s": state.wall_s, "cpu_s": state.cpu_s,
               "model": model.state_dict(), "optimizer": opt.state_dict(), "schedule": schedule.state_dict(),
               "gen": gen.get_state(), "ratio_gen": ratio_gen.get_state()}
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)


def load(path: Path, model, opt, schedule, gen: torch.Generator, ratio_gen: torch.Generator) -> RunState | None:
    """Restore the state at ``path`` into the live objects; None when there is none."""
    if not path.exists():
        return None
    payload = torch.load(path, weights_only=True)
    model.load_state_dict(payload["model"])
    opt.load_state_dict(payload["optimizer"])
    schedule.load_state_dict(payload["schedule"])
    gen.set_state(payload["gen"])
    ratio_gen.set_state(payload["ratio_gen"])
    return RunState(payload["step"], list(payload["losses"]), list(payload["checkpoints"]), payload["train_s"],
                    payload["wall_s"], payload["cpu_s"])


def write_partial(path: Path, record: dict) -> None:
    """``record`` (a run's record so far, marked ``"partial": true``) to ``path``, atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**record, "partial": True}, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


def truncate_csv(path: Path, after_step: int) -> None:
    """Drop the snapshot rows of ``path`` measured after ``after_step`` (written after the state was saved)."""
    if not path.exists():
        return
    import csv
    import io

    with path.open(newline="", encoding="utf-8") as fh:
        rows = list(csv.reader(fh))
    column = rows[0].index("step")
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\r\n").writerows([rows[0], *(r for r in rows[1:] if int(r[column]) <= after_step)])
    path.write_text(buffer.getvalue(), encoding="utf-8", newline="")
