"""Rules 4 and 5 of ``figures/diffusion-diagnosis/plan.md`` read from the full-length runs: the recipe and the member.

Rule 4's fallback trains the two best candidates (plan decision 2: ``mdlm-lr`` and ``mdlm``) at the member's 3,059
steps, seed 0, and the one with the higher all-[MASK] top-1 at t = 0.15 on the 1,024 windows is the recipe (the
lower all-[MASK] loss breaking a tie). Rule 5 ships the recipe at the first budget (1x, then 1.5x, 2x, 3x: plan
decision 3, checkpoints 3,059, 4,589, 6,118 and 9,177 of one run) whose top-1 is at least :data:`SHIP_TOP1` and whose
own validation loss is at least :data:`SHIP_MARGIN` nats below the unigram cross-entropy :data:`UNIGRAM_CE`, the
equal-compute numbers beside it.

A run's measures come from ``<runs>/<cell>-s0.json`` or, while it trains, ``<cell>-s0.partial.json`` (a budget not
reached yet decides nothing). Writes ``<out>.md`` and ``<out>.csv``:

    python -m analyses.diffusion_diagnosis.member [--runs figures/diffusion-diagnosis/full] [--out figures/diffusion-diagnosis/member]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from analyses.diffusion_diagnosis.cells import SCHEDULE_STEPS

FALLBACK = ("mdlm-lr", "mdlm")
"""Rule 4's two best candidates (plan decision 2)."""
BUDGETS = {SCHEDULE_STEPS: "1x", 4589: "1.5x", 6118: "2x", 9177: "3x"}
"""Rule 5's budgets (steps: share of the member's compute), in the order they are tried."""
SHIP_TOP1, SHIP_MARGIN = 0.15, 0.5
UNIGRAM_CE = 6.773
"""The unigram cross-entropy in nats (training counts, add-one over the 8,192-token vocabulary) of the non-special
tokens of the 1,024 acceptance windows: :func:`unigram_cross_entropy` on mini-en's corpus and tokenizer, 6.7731."""
DEFAULT_RUNS, DEFAULT_OUT = Path("figures/diffusion-diagnosis/full"), Path("figures/diffusion-diagnosis/member")


def unigram_cross_entropy(train: torch.Tensor, valid: torch.Tensor, special_ids: Sequence[int], vocab: int) -> float:
    """Mean cross-entropy (nats) of the non-special tokens of ``valid`` (N, T) under the unigram distribution of
    ``train``'s (M, T) non-special tokens, add-one smoothed over ``vocab`` tokens."""
    special = torch.tensor(list(special_ids))
    counts = torch.bincount(train[~torch.isin(train, special)], minlength=vocab).double() + 1.0
    log_p = (counts / counts.sum()).log()
    return float(-log_p[valid[~torch.isin(valid, special)]].mean())


@dataclass(frozen=True)
class Budget:
    """One budget of one run: its step, share of compute and the full measures at that step (None: not reached)."""

    cell: str
    step: int
    share: str
    measures: dict | None

    @property
    def top1(self) -> float | None:
        return None if self.measures is None else self.measures["mask15_top1"]

    @property
    def margin(self) -> float | None:
        """The unigram cross-entropy minus the own validation loss (nats; positive: below the unigram stage)."""
        return None if self.measures is None else UNIGRAM_CE - self.measures["own_loss"]

    @property
    def passes(self) -> bool | None:
        if self.measures is None:
            return None
        return self.top1 >= SHIP_TOP1 and self.margin >= SHIP_MARGIN


def load_budgets(runs: Path = DEFAULT_RUNS, cells: Sequence[str] = FALLBACK, seed: int = 0) -> dict[str, list[Budget]]:
    """cell -> its :data:`BUDGETS` in order, from the finished or partial record (measures None where not reached)."""
    out = {}
    for cell in cells:
        paths = [runs / f"{cell}-s{seed}.json", runs / f"{cell}-s{seed}.partial.json"]
        path = next((p for p in paths if p.exists()), None)
        rows = json.loads(path.read_text())["checkpoints"] if path else []
        full = {r["step"]: r for r in rows if "own_loss" in r}
        out[cell] = [Budget(cell, step, share, full.get(step)) for step, share in BUDGETS.items()]
    return out


def choose(budgets: dict[str, list[Budget]]) -> str | None:
    """Rule 4: the cell with the higher top-1 at the 1x budget (then the lower all-[MASK] loss); None until every
    cell has reached it."""
    first = [b[0] for b in budgets.values()]
    if any(b.measures is None for b in first):
        return None
    return min(first, key=lambda b: (-b.top1, b.measures["mask15_loss"])).cell


def shipped(budgets: list[Budget]) -> Budget | None:
    """Rule 5: the first budget that passes; None while every reached budget fails (or none is reached)."""
    for b in budgets:
        if b.passes:
            return b
        if b.measures is None:
            return None
    return None


def verdict(budgets: dict[str, list[Budget]]) -> str:
    """The rules' reading in one paragraph."""
    recipe = choose(budgets)
    if recipe is None:
        return "Rule 4 undecided: not every candidate has reached 3,059 steps."
    first = {c: b[0] for c, b in budgets.items()}
    text = (f"Rule 4: the recipe is **{recipe}** (top-1 at 3,059 steps: "
            + ", ".join(f"{c} {first[c].top1:.3f}" for c in budgets) + ").")
    member = shipped(budgets[recipe])
    reached = [b for b in budgets[recipe] if b.measures is not None]
    if member is not None:
        return text + (f" Rule 5: it ships at **{member.share}** the member's compute ({member.step:,} steps): top-1 "
                       f"{member.top1:.3f} >= {SHIP_TOP1}, own loss {UNIGRAM_CE - member.margin:.3f} nats, "
                       f"{member.margin:.3f} below the unigram {UNIGRAM_CE} (>= {SHIP_MARGIN}).")
    if len(reached) == len(BUDGETS):
        return text + " Rule 5: no budget up to 3x passes; nothing ships under the plan."
    return text + (f" Rule 5 undecided: the budgets reached so far ({', '.join(b.share for b in reached)}) fail; "
                   "the run continues.")


def table_rows(budgets: dict[str, list[Budget]]) -> list[dict]:
    rows = []
    for cell, items in budgets.items():
        for b in items:
            m = b.measures or {}
            rows.append({"cell": cell, "step": b.step, "budget": b.share, "mask15_top1": m.get("mask15_top1"),
                         "mask15_loss": m.get("mask15_loss"), "own_loss": m.get("own_loss"), "margin": b.margin,
                         "mask50_top1": m.get("mask50_top1"), "bert15_top1": m.get("bert15_top1"),
                         "passes": b.passes})
    return rows


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:.{digits}f}"


def markdown(budgets: dict[str, list[Budget]]) -> str:
    lines = ["# The recipe and the member (plan rules 4 and 5)", "",
             f"Seed 0, the member's schedule, all-[MASK] top-1 and loss at t = 0.15 on the 1,024 acceptance windows; "
             f"own loss per real token on 256 windows; margin = unigram cross-entropy {UNIGRAM_CE} nats minus the own "
             f"loss. Ships: top-1 >= {SHIP_TOP1} and margin >= {SHIP_MARGIN}. Made by `python -m "
             "analyses.diffusion_diagnosis.member` from `figures/diffusion-diagnosis/full/`.", "",
             "| cell | budget | steps | top-1 t=0.15 | loss t=0.15 | own loss | margin | top-1 t=0.5 | top-1 BERT 15% "
             "| passes |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table_rows(budgets):
        lines.append(f"| {r['cell']} | {r['budget']} | {r['step']:,} | {_fmt(r['mask15_top1'])} | "
                     f"{_fmt(r['mask15_loss'])} | {_fmt(r['own_loss'])} | {_fmt(r['margin'])} | "
                     f"{_fmt(r['mask50_top1'])} | {_fmt(r['bert15_top1'])} | {_fmt(r['passes'])} |")
    return "\n".join(lines + ["", verdict(budgets), ""])


def csv_text(budgets: dict[str, list[Budget]]) -> str:
    import pandas as pd

    return pd.DataFrame(table_rows(budgets)).to_csv(index=False, float_format="%.6g", lineterminator="\n")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=Path, default=DEFAULT_RUNS)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="writes OUT.md and OUT.csv")
    args = p.parse_args(argv)
    budgets = load_budgets(args.runs)
    args.out.with_suffix(".md").write_text(markdown(budgets), encoding="utf-8")
    args.out.with_suffix(".csv").write_text(csv_text(budgets), encoding="utf-8")
    print(verdict(budgets))


if __name__ == "__main__":
    main()
