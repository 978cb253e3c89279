"""``pretrain.py``'s runs stopped and resumed: long runs (the pretraining seeds) go in ``--max-minutes`` chunks.

The state is :mod:`analyses.pretraining.recipe.checkpoint`'s ``<out>/checkpoint.pt`` (atomic, ``weights_only``, the
global RNG states included) holding the model's, optimizer's and schedule's states, the run's two generators, the
next step, the tokens seen, the training log so far, the time spent and the flags that define the run; a rerun of the
same command resumes from it, a different command is refused. A resumed run equals one that never stopped, bit for
bit on the same machine (tests/analyses/test_pretrain_objectives.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import torch

from analyses.pretraining.recipe.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint, set_rng_state

RUN_ONLY = ("threads", "max_minutes", "state_every")
"""Flags that change how a run is carried out, not what it computes: they may differ between its chunks."""


@dataclass
class Progress:
    """Where a run stands: ``step`` the next step to take (1 for a fresh run), times in seconds."""

    step: int = 1
    tokens_seen: int = 0
    log_rows: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0


def identity(args: argparse.Namespace) -> dict[str, str]:
    """The flags that define the run, as strings."""
    return {k: str(v) for k, v in sorted(vars(args).items()) if k not in RUN_ONLY}


def resume(args: argparse.Namespace, model, opt, schedule, gen: torch.Generator,
           ratio_gen: torch.Generator) -> Progress:
    """Restore ``args.out``'s state into the live objects (a fresh :class:`Progress` when there is none); a state of
    a different command is refused (``SystemExit`` naming the flags that differ)."""
    payload = load_checkpoint(args.out)
    if payload is None:
        return Progress()
    stored, now = payload["identity"], identity(args)
    differ = sorted(k for k in stored.keys() | now.keys() if stored.get(k) != now.get(k))
    if differ:
        raise SystemExit(f"{args.out / CHECKPOINT_NAME} belongs to a different run (flags {', '.join(differ)} "
                         "differ): rerun the command that started it, or delete the file to start again")
    model.load_state_dict(payload["model"])
    opt.load_state_dict(payload["optimizer"])
    schedule.load_state_dict(payload["schedule"])
    gen.set_state(payload["gen"])
    ratio_gen.set_state(payload["ratio_gen"])
    set_rng_state(payload["rng"])
    print(f"resuming at step {payload['step']} from {args.out / CHECKPOINT_NAME}", flush=True)
    return Progress(payload["step"], payload["tokens_seen"], list(payload["log_rows"]), payload["wall_s"],
                    payload["cpu_s"])


def keep(args: argparse.Namespace, progress: Progress, model, opt, schedule, gen: torch.Generator,
         ratio_gen: torch.Generator) -> Path:
    """Write the run's state (``progress.step``: the next step) to ``args.out``; returns the file."""
    return save_checkpoint(args.out, {
        "identity": identity(args), "step": progress.step, "tokens_seen": progress.tokens_seen,
        "log_rows": progress.log_rows, "wall_s": progress.wall_s, "cpu_s": progress.cpu_s,
        "model": model.state_dict(), "optimizer": opt.state_dict(), "schedule": schedule.state_dict(),
        "gen": gen.get_state(), "ratio_gen": ratio_gen.get_state()})


def finish(args: argparse.Namespace) -> None:
    """A finished run's state is no longer needed."""
    (args.out / CHECKPOINT_NAME).unlink(missing_ok=True)
