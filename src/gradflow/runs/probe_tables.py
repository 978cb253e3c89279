"""``tables.tex`` of probe directories (issue 26): booktabs tables a paper can ``\\input``.

``gradflow probe`` writes, per regime, every layer's test accuracy with its 95% sentence-bootstrap
CI, selectivity and (when computed) the online code length, then the last-layer drops with their
paired CIs. ``gradflow compare`` of probe directories writes each model's drop and the paired drop
differences (each model's drop minus its task's baseline's, on the test words both scored).

Numbers are rounded as in the Markdown tables of the probe analyses (``figures/probes/drops.md``,
``layers_<task>.md``): accuracies and accuracy drops to 4 decimals, selectivity to 3, code lengths
in kbits to 2 and code-length drops in whole bits. The cell functions below are that rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from gradflow.analysis.probe_tables import ProbeTables, load_probe_dirs
from gradflow.figures.tables import TextTable, latex_label, write_latex_tables

TABLES_TEX = "tables.tex"
"""The LaTeX file ``gradflow probe`` and ``gradflow compare`` (of probe directories) write."""
CODE_METRIC = "code_length_bits"
METRIC_NAMES = {"accuracy": "accuracy", CODE_METRIC: "code length (bits)"}


def accuracy_cell(value: float, low: float, high: float) -> str:
    """A test accuracy with its CI: ``0.9264 [0.9214, 0.9312]``."""
    return f"{value:.4f} [{low:.4f}, {high:.4f}]"


def drop_cell(metric: str, value: float, low: float, high: float) -> str:
    """A last-layer drop (or a drop difference) with its CI, signed: ``-0.0032 [-0.0063, -0.0004]`` for
    accuracy, whole bits for code length: ``-394 [-469, -319]``."""
    digits = 0 if metric == CODE_METRIC else 4
    return f"{value:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"


def best_earlier_cell(metric: str, layer: int, score: float) -> str:
    """The best earlier layer and its score: ``4 (0.9296)``; code length in kbits: ``4 (6.14 kbits)``."""
    return f"{int(layer)} ({score / 1000:.2f} kbits)" if metric == CODE_METRIC else f"{int(layer)} ({score:.4f})"


def _has_code(frame: pd.DataFrame) -> bool:
    return bool(frame["code_length_bits"].notna().any())


def layer_table(probes: pd.DataFrame, name: str) -> TextTable:
    """Every probed site of one model, task and regime (rows of ``probes.csv``)."""
    code = _has_code(probes)
    header = ("layer", "site", "accuracy [95% CI]", "selectivity", *(("code (kbits)",) if code else ()))
    rows = tuple((int(r.layer), r.site, accuracy_cell(r.accuracy, r.ci_low, r.ci_high), f"{r.selectivity:.3f}",
                  *((f"{r.code_length_bits / 1000:.2f}",) if code else ())) for r in probes.itertuples())
    first = probes.iloc[0]
    caption = (f"{name} on {first.task}, {first.regime} regime: linear-probe test accuracy per layer with its 95% "
               f"sentence-bootstrap CI ({int(first.n_tokens):,} test words, {int(first.n_sentences):,} sentences), "
               "selectivity (accuracy minus the control task's)"
               + (", and the online code length of the train labels in kbits (lower is better)." if code else "."))
    return TextTable(header, rows, caption, latex_label("probe", name, str(first.task), str(first.regime)))


def drop_table(drops: pd.DataFrame, name: str, task: str) -> TextTable:
    """The last-layer drops of one probe run (rows of ``probe_drops.csv``)."""
    rows = tuple((r.regime, METRIC_NAMES.get(r.metric, r.metric),
                  drop_cell(r.metric, r.last_layer_drop, r.ci_low, r.ci_high),
                  best_earlier_cell(r.metric, r.best_earlier_layer, r.best_earlier_score)) for r in drops.itertuples())
    caption = (f"{name} on {task}: last-layer drop, the last layer's score minus the best earlier layer's "
               "(accuracy; for code length, the best earlier layer's bits minus the last layer's), with its paired "
               "95% sentence-bootstrap CI; negative when the last layer is the worse feature.")
    return TextTable(("regime", "metric", "last-layer drop (95% CI)", "best earlier layer"), rows, caption,
                     latex_label("probe-drops", name, task))


def probe_tables(tables: ProbeTables) -> list[TextTable]:
    """One probe directory's tables: a layer table per regime, then its drops."""
    name = tables.labels[0] if tables.labels else str(tables.probes["model"].iloc[0])
    task = str(tables.probes["task"].iloc[0])
    out = [layer_table(frame, name) for _, frame in tables.probes.groupby("regime", sort=False)]
    if not tables.drops.empty:
        out.append(drop_table(tables.drops, name, task))
    return out


def comparison_drop_table(drops: pd.DataFrame) -> TextTable:
    """Each model's last-layer accuracy drop (and code-length drop when computed), per task and regime."""
    code = bool((drops["metric"] == CODE_METRIC).any())
    rows = []
    for (task, label, regime), d in drops.groupby(["task", "label", "regime"], sort=False):
        acc = d[d["metric"] == "accuracy"]
        bits = d[d["metric"] == CODE_METRIC]
        if acc.empty:
            continue
        a = acc.iloc[0]
        cells = [task, regime, label, drop_cell("accuracy", a.last_layer_drop, a.ci_low, a.ci_high),
                 best_earlier_cell("accuracy", a.best_earlier_layer, a.best_earlier_score)]
        if code:
            cells.append(drop_cell(CODE_METRIC, *bits.iloc[0][["last_layer_drop", "ci_low", "ci_high"]])
                         if len(bits) else math.nan)
        rows.append(tuple(cells))
    header = ("task", "regime", "model", "accuracy drop (95% CI)", "best earlier layer",
              *(("code-length drop, bits (95% CI)",) if code else ()))
    caption = ("Last-layer drop per model: the last layer's test accuracy minus the best earlier layer's, with its "
               "paired 95% sentence-bootstrap CI" + (", and the same for the online code length in bits." if code
                                                      else "."))
    labels = list(dict.fromkeys(drops["label"]))
    return TextTable(header, tuple(rows), caption, latex_label("probe-drops", *labels))


def difference_table(differences: pd.DataFrame) -> TextTable:
    """Rows of ``probe_drop_differences.csv``: each model's accuracy drop minus its task's baseline's."""
    rows = tuple((r.task, r.regime, f"{r.label} − {r.baseline}", drop_cell("accuracy", r.difference, r.ci_low, r.ci_high),
                  f"{int(r.n_words):,}", f"{int(r.n_sentences):,}") for r in differences.itertuples())
    caption = ("Paired last-layer drop differences: each model's accuracy drop minus the baseline's, on the test words "
               "both scored, with a 95% bootstrap CI over the shared test sentences.")
    labels = list(dict.fromkeys([*differences["baseline"], *differences["label"]]))
    return TextTable(("task", "regime", "models", "drop difference (95% paired CI)", "words", "sentences"), rows,
                     caption, latex_label("probe-differences", *labels))


def comparison_tables(tables: ProbeTables, differences: pd.DataFrame) -> list[TextTable]:
    """The comparison's tables: every model's drop, then the paired differences (when there are any)."""
    out = [comparison_drop_table(tables.drops)] if not tables.drops.empty else []
    if not differences.empty:
        out.append(difference_table(differences))
    return out


def write_probe_tables(probe_dir: str | Path) -> Path:
    """Write ``tables.tex`` into a probe directory from its ``probes.csv`` and ``probe_drops.csv``."""
    probe_dir = Path(probe_dir)
    return write_latex_tables(probe_dir / TABLES_TEX, probe_tables(load_probe_dirs([probe_dir])), "gradflow probe")


def write_comparison_tables(probe_dirs: Sequence[str | Path], labels: Sequence[str] | None, out_dir: str | Path,
                            differences: pd.DataFrame) -> Path:
    """Write ``tables.tex`` of a probe comparison into ``out_dir`` (``differences``: the paired drop
    differences, columns ``PROBE_DIFFERENCE_COLUMNS``, possibly empty)."""
    tables = comparison_tables(load_probe_dirs(probe_dirs, labels), differences)
    return write_latex_tables(Path(out_dir) / TABLES_TEX, tables, "gradflow compare")


__all__ = ["TABLES_TEX", "accuracy_cell", "best_earlier_cell", "comparison_drop_table", "comparison_tables",
           "difference_table", "drop_cell", "drop_table", "layer_table", "probe_tables", "write_comparison_tables",
           "write_probe_tables"]
