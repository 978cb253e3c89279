"""Whether a member of issue 52 learned is a measurement, not its name (issue 59): the rule and the mark that every
table of ``docs/results/objectives.md`` and of ``figures/objectives`` (the overview, Parts 1, 3 and 4) applies.

A model whose last validation top-1 at BERT 15% (``figures/objectives/pretraining_curves.csv``, ``make -C analyses
objectives-ship``) is not above ``LEFT_UNIGRAM_TOP1`` did not leave the unigram stage. Its name in a table's row or
column label carries ``UNLEARNED`` (:func:`mark`), none of its numbers is bold, and a :func:`footnote` line under the
table says why. The overview (``analyses.objectives.overview``) marks every cell of its column and has the longer note.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
CURVES = ROOT / "figures/objectives/pretraining_curves.csv"  # each member's held-out top-1 by step (objectives-ship)
# The rule for "learned": the last validation top-1 at BERT 15% passes 0.10. At the unigram stage (predicting token
# frequencies, plan deviation 1) this recipe scores 0.054-0.074 (the diffusion member's curve, the diagnostics of
# figures/objectives/diagnostics and the plan); every run that learned was at 0.19 or more by step 450.
LEFT_UNIGRAM_TOP1 = 0.10
UNLEARNED = "†"  # after the name of a model that did not leave the unigram stage (the overview: after every cell)
STUDY = "figures/objectives"  # the study's folder: its curves, and its overview with the long note
# (each study's overview sits beside its curves: the first diffusion member's, kept as history, in
# figures/objectives/diffusion-v1)
OBJECTIVES = {"gradflow-mini-en": "BERT 15%", "gradflow-mini-en-alltoken": "all-token training",
              "gradflow-mini-en-mask40": "BERT 40%", "gradflow-mini-en-diffusion": "masked diffusion"}


@dataclass(frozen=True)
class Stage:
    """A model's validation top-1 at BERT 15% at its first and last evaluation, and whether it learned by the rule."""

    model: str
    first_step: int
    first_top1: float
    last_step: int
    last_top1: float
    study: str = STUDY  # the folder of the curves it was read from, relative to the repository

    @property
    def overview(self) -> str:
        """The study's overview, whose note the footnote points to."""
        return f"{self.study}/overview.md"

    @property
    def curves(self) -> str:
        """The study's pretraining curves, where the stage was read."""
        return f"{self.study}/pretraining_curves.csv"

    @property
    def learned(self) -> bool:
        """It left the unigram stage: its last top-1 passes ``LEFT_UNIGRAM_TOP1``."""
        return self.last_top1 > LEFT_UNIGRAM_TOP1


def stages(curves: Path = CURVES) -> dict[str, Stage]:
    """Each model's :class:`Stage` from the pretraining curves, by model name (``gradflow-mini-en-...``).
    SystemExit naming the target that writes the curves when they are not there."""
    if not Path(curves).is_file():
        raise SystemExit(f"{curves} is not there: it says which model learned (make -C analyses objectives-ship)")
    frame = pd.read_csv(curves).dropna(subset=["valid_top1"]).sort_values(["model", "step"], kind="stable")
    folder = Path(curves).resolve().parent
    study = folder.relative_to(ROOT).as_posix() if folder.is_relative_to(ROOT) else STUDY
    return {model: Stage(model, int(ev.step.iloc[0]), float(ev.valid_top1.iloc[0]), int(ev.step.iloc[-1]),
                         float(ev.valid_top1.iloc[-1]), study)
            for model, ev in frame.groupby("model", sort=False)}


def learned(curves: Path = CURVES) -> dict[str, bool]:
    """Model name -> whether it left the unigram stage (:func:`stages`)."""
    return {model: stage.learned for model, stage in stages(curves).items()}


def mark(name: str, did_learn: bool) -> str:
    """``name`` as a table's row or column label: ``UNLEARNED`` right after it when the model did not learn."""
    return name if did_learn else name + UNLEARNED


def footnote(stage: Stage) -> str:
    """The line under a table whose labels mark ``stage``'s model (pointing to the overview's note)."""
    objective = OBJECTIVES.get(stage.model, "its objective")
    return (f"{UNLEARNED} {stage.model} did not leave the unigram stage (its validation top-1 at BERT 15% was "
            f"{stage.last_top1:.3f} at its last evaluation, step {stage.last_step:,}, not above "
            f"{LEFT_UNIGRAM_TOP1:.2f}; see the overview's note, `{stage.overview}`): what is marked {UNLEARNED} "
            f"describes a model that has not learned to use context, not {objective} as an objective.")


def footnotes(models, curves: Path = CURVES, stage: dict[str, Stage] | None = None) -> list[str]:
    """The :func:`footnote` of each of ``models`` (names, in order, once each) that did not learn; ``stage``: the
    curves' stages when the caller has read them already."""
    stage = stages(curves) if stage is None else stage
    return [footnote(stage[m]) for m in dict.fromkeys(models) if m in stage and not stage[m].learned]
