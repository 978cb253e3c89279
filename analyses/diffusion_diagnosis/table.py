"""The diagnosis table and the plan's rules (``figures/diffusion-diagnosis/plan.md``), from the committed runs.

Every number comes from ``runs/<cell>-s<seed>.json`` (``analyses.diffusion_diagnosis.train``): a cell's score is its
all-[MASK] top-1 at t = 0.15 on 1,024 validation windows at its last step. The rules, as the plan fixed them:

1. a cell **left the unigram stage** if its score is at least :data:`LEFT_UNIGRAM` in every planned seed;
2. a contrast (:data:`CONTRASTS`) is **an effect** if the difference of the two cells' seed means is at least
   :data:`EFFECT` in size and has the same sign in every seed (seed k minus seed k);
3. the **explanation** (:func:`explanation`): the first of the plan's readings that the effects satisfy;
4. the **recipe** (:func:`choose_recipe`): the best candidate (masked diffusion: no kept tokens) by seed mean, a
   candidate within :data:`PREFER_SIMPLER` of it with fewer changes preferred.

    python -m analyses.diffusion_diagnosis.table  # -> figures/diffusion-diagnosis/diagnosis.{md,csv}
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from analyses.diffusion_diagnosis.cells import CELLS, cell

SEEDS = (0, 1)
"""The planned seeds of every cell."""
LEFT_UNIGRAM = 0.10
"""Rule 1's threshold (all-[MASK] top-1 at t = 0.15)."""
EFFECT = 0.03
"""Rule 2's smallest difference of seed means."""
PREFER_SIMPLER = 0.01
"""Rule 4: a candidate this close to the best with fewer changes is preferred."""
CONTRASTS: tuple[tuple[str, str, str], ...] = (
    ("kept in tied", "kept", "base"),
    ("kept in untied", "untied-kept", "untied"),
    ("kept with a zero output", "untied-zero-kept", "untied-zero"),
    ("untying", "untied", "base"),
    ("zero output", "untied-zero", "untied"),
    ("antithetic t", "antithetic", "base"),
    ("bell t", "bell", "base"),
    ("lower maximum t", "low-t", "base"),
    ("MDLM's learning rate", "mdlm-lr", "base"),
    ("MDLM's recipe", "mdlm", "base"),
)
"""Rule 2's contrasts: (label, cell, minus cell)."""
DEFAULT_RUNS = Path("figures/diffusion-diagnosis/runs")


@dataclass(frozen=True)
class CellResult:
    """One cell's runs: ``scores`` seed -> all-[MASK] top-1 at t = 0.15 (1,024 windows, last step); ``finals`` seed
    -> the run's last checkpoint record; ``steps`` the runs' step count."""

    name: str
    scores: dict[int, float]
    finals: dict[int, dict]
    steps: int

    @property
    def complete(self) -> bool:
        """Every planned seed has run."""
        return all(s in self.scores for s in SEEDS)

    @property
    def mean(self) -> float:
        """The mean score over the seeds run (nan if none)."""
        return sum(self.scores.values()) / len(self.scores) if self.scores else math.nan

    @property
    def mean_loss(self) -> float:
        """The mean all-[MASK] cross-entropy at t = 0.15 over the seeds run (nats; nan if none)."""
        losses = [f["mask15_loss"] for f in self.finals.values()]
        return sum(losses) / len(losses) if losses else math.nan

    @property
    def left_unigram(self) -> bool | None:
        """Rule 1 (None while a planned seed is missing)."""
        return all(v >= LEFT_UNIGRAM for v in self.scores.values()) if self.complete else None


@dataclass(frozen=True)
class Contrast:
    """Rule 2 for one contrast: ``diffs`` seed -> difference; ``effect`` None while a seed is missing."""

    label: str
    cell: str
    minus: str
    diffs: dict[int, float]
    effect: bool | None

    @property
    def mean(self) -> float:
        return sum(self.diffs.values()) / len(self.diffs) if self.diffs else math.nan


def load_results(runs: Path = DEFAULT_RUNS) -> dict[str, CellResult]:
    """Every cell's :class:`CellResult` from ``runs/*.json`` (cells without runs have empty scores)."""
    found: dict[str, list[dict]] = {}
    for path in sorted(runs.glob("*-s*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        found.setdefault(record["cell"], []).append(record)
    unknown = sorted(set(found) - {c.name for c in CELLS})
    if unknown:
        raise ValueError(f"runs of unknown cells {unknown} under {runs}: the cells are those of cells.CELLS")
    out = {}
    for c in CELLS:
        records = found.get(c.name, [])
        steps = {r["steps"] for r in records}
        if len(steps) > 1:
            raise ValueError(f"cell {c.name}: runs of different lengths {sorted(steps)} under {runs}")
        out[c.name] = CellResult(c.name, {r["seed"]: r["final"]["mask15_top1"] for r in records},
                                 {r["seed"]: r["final"] for r in records}, steps.pop() if steps else 0)
    return out


def contrast(results: dict[str, CellResult], label: str, a: str, b: str) -> Contrast:
    """Rule 2 for ``a`` minus ``b``."""
    seeds = [s for s in SEEDS if s in results[a].scores and s in results[b].scores]
    diffs = {s: results[a].scores[s] - results[b].scores[s] for s in seeds}
    if len(seeds) < len(SEEDS):
        return Contrast(label, a, b, diffs, None)
    mean = sum(diffs.values()) / len(diffs)
    same_sign = all(d > 0 for d in diffs.values()) or all(d < 0 for d in diffs.values())
    return Contrast(label, a, b, diffs, abs(mean) >= EFFECT and same_sign)


def contrasts(results: dict[str, CellResult]) -> list[Contrast]:
    """Every contrast of :data:`CONTRASTS`."""
    return [contrast(results, *spec) for spec in CONTRASTS]


def explanation(found: Sequence[Contrast]) -> str:
    """Rule 3: the first reading of the plan that the effects satisfy (or why none is named yet)."""
    by = {c.label: c for c in found}
    needed = ("kept in tied", "kept in untied", "untying")
    if any(by[k].effect is None for k in needed):
        return "not yet decided: a planned seed of the kept x tied cells is missing"
    kept_tied, kept_untied, untying = (by[k].effect for k in needed)
    if kept_tied and untying and not kept_untied:
        return "the confound: kept tokens matter through the tied embeddings"
    if kept_tied and kept_untied:
        return "kept tokens matter whatever the embeddings"
    if untying and not kept_tied and not kept_untied:
        return "the tied embeddings"
    effects = [c.label for c in found if c.effect]
    return "none of the plan's readings; effects: " + (", ".join(effects) if effects else "none")


def choose_recipe(results: dict[str, CellResult]) -> tuple[str, ...]:
    """Rule 4: the recipe's cell, or (no candidate left the unigram stage) the two best candidates to train at the
    member's full budget; empty while a candidate misses a planned seed."""
    candidates = [results[c.name] for c in CELLS if c.candidate]
    if not all(r.complete for r in candidates):
        return ()
    # plan.md decision 2: a tie in top-1 is broken by the lower all-[MASK] loss at t = 0.15 (the same prediction)
    ranked = sorted(candidates, key=lambda r: (-r.mean, r.mean_loss))
    if not any(r.left_unigram for r in ranked):
        return tuple(r.name for r in ranked[:2])
    best = ranked[0]
    close = [r for r in ranked if best.mean - r.mean <= PREFER_SIMPLER]
    return (min(close, key=lambda r: (len(cell(r.name).changes()), -r.mean)).name,)


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _final_mean(result: CellResult, key: str) -> float | None:
    """The mean of ``key`` over the cell's last checkpoints that have it (None if none has)."""
    values = [f[key] for f in result.finals.values() if f.get(key) is not None]
    return sum(values) / len(values) if values else None


def table_rows(results: dict[str, CellResult]) -> list[dict]:
    """One row per cell and seed run: the diagnosis CSV."""
    rows = []
    for c in CELLS:
        r = results[c.name]
        for seed in sorted(r.scores):
            final = r.finals[seed]
            rows.append({"cell": c.name, "changes": "; ".join(c.changes()) or "the first member's recipe",
                         "candidate": c.candidate, "seed": seed, "steps": r.steps, "mask15_top1": final["mask15_top1"],
                         "mask15_loss": final["mask15_loss"], "mask50_top1": final.get("mask50_top1"),
                         "bert15_top1": final.get("bert15_top1"), "own_loss": final.get("own_loss")})
    return rows


def markdown(results: dict[str, CellResult]) -> str:
    """The diagnosis page: the cells' table, the contrasts, the explanation and the recipe (rules 1-4)."""
    found = contrasts(results)
    out = ["# The diagnosis (issue 60): every cell's runs, the plan's contrasts and rules", "",
           "All-[MASK] top-1 at t = 0.15 on 1,024 held-out windows at the runs' last step (`figures/diffusion-"
           "diagnosis/runs/`, rules of `plan.md`; the most frequent token scores 0.060). Made by "
           "`python -m analyses.diffusion_diagnosis.table`.", "",
           "| cell | changes from the first member | steps | top-1 seed 0 | top-1 seed 1 | mean | left the unigram "
           "stage | t = 0.5 (mean) | BERT 15% (mean) |", "|---|---|---|---|---|---|---|---|---|"]
    for c in CELLS:
        r = results[c.name]
        left = {None: "-", True: "yes", False: "no"}[r.left_unigram]
        out.append(f"| `{c.name}` | {'; '.join(c.changes()) or 'none (the first member)'} | {r.steps or '-'} | "
                   f"{_fmt(r.scores.get(0))} | {_fmt(r.scores.get(1))} | {_fmt(r.mean)} | {left} | "
                   f"{_fmt(_final_mean(r, 'mask50_top1'))} | {_fmt(_final_mean(r, 'bert15_top1'))} |")
    out += ["", f"Contrasts (rule 2: an effect if the seed means differ by at least {EFFECT} with the same sign in "
            "both seeds):", "", "| contrast | cells | seed 0 | seed 1 | mean | effect |", "|---|---|---|---|---|---|"]
    for c in found:
        effect = {None: "-", True: "yes", False: "no"}[c.effect]
        out.append(f"| {c.label} | `{c.cell}` - `{c.minus}` | {_fmt(c.diffs.get(0), 3)} | {_fmt(c.diffs.get(1), 3)} | "
                   f"{_fmt(c.mean, 3)} | {effect} |")
    chosen = choose_recipe(results)
    if not chosen:
        verdict = "not yet decided: a candidate cell misses a planned seed"
    elif results[chosen[0]].left_unigram:
        verdict = f"`{chosen[0]}`"
    else:
        verdict = "no candidate left the unigram stage: the two best, " + " and ".join(f"`{n}`" for n in chosen) + \
                  ", train at the member's full 3,059 steps (rule 4)"
    out += ["", f"**Explanation (rule 3):** {explanation(found)}.", "", f"**Recipe (rule 4):** {verdict}.", ""]
    return "\n".join(out)


def csv_text(results: dict[str, CellResult]) -> str:
    """:func:`table_rows` as CSV text (floats to 6 decimals)."""
    rows = table_rows(results)
    fields = ["cell", "changes", "candidate", "seed", "steps", "mask15_top1", "mask15_loss", "mask50_top1",
              "bert15_top1", "own_loss"]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows([{k: (f"{v:.6f}" if isinstance(v, float) else v) for k, v in row.items()} for row in rows])
    return buffer.getvalue()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=Path, default=DEFAULT_RUNS)
    p.add_argument("--out", type=Path, default=Path("figures/diffusion-diagnosis"))
    args = p.parse_args(argv)
    if not args.runs.is_dir():
        raise SystemExit(f"no runs under {args.runs}: python -m analyses.diffusion_diagnosis.train makes them")
    results = load_results(args.runs)
    (args.out / "diagnosis.md").write_text(markdown(results), encoding="utf-8")
    (args.out / "diagnosis.csv").write_text(csv_text(results), encoding="utf-8")
    print(markdown(results))


if __name__ == "__main__":
    main()
