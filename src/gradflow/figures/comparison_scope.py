"""What each run of a comparison stands for: its objective, and for a masked-diffusion run the t it pools or keeps.

``gradflow compare`` of a BERT run and a masked-diffusion run would otherwise set a fixed 15% selection beside a
diffusion run pooled over its whole grid of t, and say so nowhere. :func:`scope_runs` applies ``--mask-ratio``
(:func:`gradflow.analysis.by_t.select_by_t`) to the diffusion runs and appends each diffusion run's scope to its
label (``diffusion (t = 0.15)``, ``diffusion (pooled over t 0.1-0.9)``), so every figure legend, table header
and csv row of the comparison says what is pooled; :func:`runs_table` and :func:`scope_notes` are the summary's
runs table (objective, masking, t) and its sentences on the selection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gradflow.analysis.by_t import (
    POOLED_TABLES,
    POOLED_TABLES_WITHOUT_SEQUENCES,
    TSelection,
    select_by_t,
    sublayers_selected,
    t_scope,
)
from gradflow.analysis.run_data import Run
from gradflow.errors import RunError
from gradflow.figures.tables import TextTable
from gradflow.formatting import masking_label, objective_label


@dataclass(frozen=True)
class ScopedRuns:
    """The runs of a comparison after ``--mask-ratio``, their labels with scopes, and the scopes themselves."""

    runs: list[Run]
    labels: list[str]
    """``label (scope)`` for a masked-diffusion run, the label itself for any other."""
    scopes: list[str | None]
    """:func:`gradflow.analysis.by_t.t_scope` of each run (None: no t)."""
    recorded: list[int]
    """Sequences each run recorded (before the selection)."""
    selection: TSelection | None


def scope_runs(runs: Sequence[Run], labels: Sequence[str] | None, selection: TSelection | None) -> ScopedRuns:
    """Select the masked-diffusion runs by ``selection`` (the others stay whole) and label every run with its scope.

    ``labels``: one per run (default: the run directories' names). Raises :class:`RunError` when ``selection`` is
    given and no run has a masking ratio t, or a diffusion run has no sequence of that t."""
    names = [run.label for run in runs] if labels is None else [str(x) for x in labels]
    if selection is not None and all(run.mask_ratios is None for run in runs):
        raise RunError(f"--mask-ratio selects a masked-diffusion run's sequences by t, and none of these runs has t "
                       f"({', '.join(names)}: no mask_ratios.parquet); leave --mask-ratio out.")
    chosen = [select_by_t(run, selection) if selection is not None and run.mask_ratios is not None else run
              for run in runs]
    scopes = [t_scope(run, selection) for run in runs]
    if len(names) != len(runs):
        raise RunError(f"Got {len(runs)} runs but {len(names)} labels; pass one label per run.")
    shown = [f"{name} ({scope})" if scope else name for name, scope in zip(names, scopes)]
    return ScopedRuns(runs=chosen, labels=shown, scopes=scopes,
                      recorded=[int(run.sequences["sequence_index"].nunique()) for run in runs], selection=selection)


def runs_table(scoped: ScopedRuns) -> TextTable:
    """The summary's runs table: label, model, objective, masking, t (what the numbers keep or pool; only when a run
    has t), blocks, sequences (kept / recorded when selected), complete."""
    with_t = any(scope is not None for scope in scoped.scopes)
    rows = []
    for run, label, scope, recorded in zip(scoped.runs, scoped.labels, scoped.scopes, scoped.recorded):
        kept = int(run.sequences["sequence_index"].nunique())
        rows.append((label, run.meta.get("model"), objective_label(run.meta), masking_label(run.meta.get("masking")),
                     *([scope or "–"] if with_t else []), run.num_layers,
                     kept if kept == recorded else f"{kept} of {recorded}", run.complete))
    header = ("label", "model", "objective", "masking", *(["t"] if with_t else []), "blocks", "sequences", "complete")
    return TextTable(header, tuple(rows), "", "")


def scope_notes(scoped: ScopedRuns) -> list[str]:
    """Sentences for the summary, under the runs table: what each diffusion run pools or keeps (none without one)."""
    if all(scope is None for scope in scoped.scopes):
        return []
    if scoped.selection is None:
        return [("A masked-diffusion run pools every sequence's masking ratio t into each number (its label says "
                 "over which t); a loss position's gradient scales like 1/t, so a pooled run is not comparable with a "
                 "fixed selection rate such as BERT's 15%. Compare at a matched t with `--mask-ratio T` (a grid "
                 "value) or `--mask-ratio LOW,HIGH` (a bin)."), ""]
    pooled = POOLED_TABLES if all(sublayers_selected(run) for run, scope in zip(scoped.runs, scoped.scopes)
                                  if scope is not None) else POOLED_TABLES_WITHOUT_SEQUENCES
    return [(f"Masked-diffusion runs keep only their sequences of {scoped.selection.describe()} (`--mask-ratio`; "
             "the sequences column says how many of those recorded); the other runs are whole. Their sublayer "
             "shares (the last block) come from the kept sequences' sublayer_sequences.parquet, where the run has "
             f"it (coverage is not kept per sequence: –). {pooled} of a selected run still pool every t; differences "
             "to a run of other sequences are unpaired."), ""]


__all__ = ["ScopedRuns", "runs_table", "scope_notes", "scope_runs"]
