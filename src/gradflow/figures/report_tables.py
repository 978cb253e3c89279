"""The tables of a report and of a comparison, as :class:`TextTable` (Markdown in ``summary.md``, LaTeX in
``tables.tex`` and ``latex/<name>.tex``), every number column with fixed decimals (:func:`fixed_column`).

- :func:`layer_table`: one run's context and masked ratios per layer with the rank test (no masked column when
  every loss position is masked: :func:`only_loss_role`);
- :func:`deficit_table`: one run's last-block sublayers against the earlier blocks;
- :func:`mask_ratio_table`: a masked-diffusion run's context ratio per layer and masking ratio t;
- :func:`comparison_ratio_table`: every run's context ratio and the differences to the baseline, per layer, or
  per relative depth when the runs differ in depth (layers matched as :func:`gradflow.analysis.compare.matched_layers`
  matches them);
- :func:`comparison_last_table`: every run's last-block share per sublayer;
- :func:`provenance_table`: a run's meta.json as a table, with no machine's absolute path and the
  mean loss in nats per loss position;
- :func:`write_latex`: ``tables.tex`` and one ``latex/<name>.tex`` per table, in a layout of
  :data:`gradflow.figures.tables.LATEX_LAYOUTS` (:func:`layout_for_width`: the one a figure width suggests);
- :func:`run_tag`: what makes a run's LaTeX labels its own (the objective and a hash of its meta.json).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import pandas as pd

from gradflow.analysis import Comparison, Run
from gradflow.errors import UsageError
from gradflow.figures.tables import (
    LATEX_FOLDER,
    LATEX_LAYOUTS,
    TextTable,
    depth_cell,
    layers_header,
    markdown_table,
    write_latex_files,
    write_latex_tables,
)
from gradflow.formatting import MISSING, fixed_column, format_number, format_p_value
from gradflow.provenance import portable_path
from gradflow.roles import LOSS_ROLES
from gradflow.schema import REQUIRED_META_KEYS


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], caption: str = "", label: str = "") -> TextTable:
    return TextTable(tuple(header), tuple(tuple(row) for row in rows), caption, label)


def check_layout(layout: str) -> None:
    """Raise :class:`UsageError` for a LaTeX layout that is not one of :data:`LATEX_LAYOUTS`."""
    if layout not in LATEX_LAYOUTS:
        raise UsageError(f"unknown LaTeX layout {layout!r}; choose one of {', '.join(LATEX_LAYOUTS)} (column: one "
                         "column of a two-column paper; wide: across both; page: a one-column paper).")


WIDTH_LAYOUTS: dict[str, str] = {"single": "column", "double": "wide"}
"""The LaTeX layout a figure width preset suggests: one column of a two-column paper, or across both."""


def layout_for_width(width: str | float, layout: str | None = None) -> str:
    """``layout`` when given, else the one of :data:`WIDTH_LAYOUTS` for a preset ``width`` (``page`` for inches)."""
    if layout is not None:
        return layout
    return WIDTH_LAYOUTS.get(width, "page") if isinstance(width, str) else "page"


TAG_IGNORED_KEYS: tuple[str, ...] = ("versions", "wall_s", "command", "complete", "error", "counts", "mean_loss",
                                     "device", "world_size", "label", "model_path")
"""meta.json keys :func:`run_tag`'s hash leaves out: what differs between two recordings of one configuration
(software versions, timings, the command's paths, how far it got) or names it (``label``)."""


def run_tag(meta: Mapping[str, Any]) -> str:
    """What makes a run's LaTeX labels its own: its objective (the masking policy, ``scheme`` in an older meta.json,
    and the loss when not ``mlm``) and the first 6 hex digits of the SHA-256 of its meta.json (keys sorted) without
    :data:`TAG_IGNORED_KEYS`: ``diffusion-00be03``. The same run gets the same tag at every report; two runs of one
    model that differ in objective, masking, corpus, seed or any other recorded setting get different ones."""
    masking = meta.get("masking")
    policy = (masking.get("policy") or masking.get("scheme")) if isinstance(masking, Mapping) else None
    loss = meta.get("loss")
    kept = {k: v for k, v in meta.items() if k not in TAG_IGNORED_KEYS}
    digest = hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:6]
    return "-".join(str(p) for p in (policy, None if loss == "mlm" else loss, digest) if p)


def runs_tag(metas: Sequence[Mapping[str, Any]]) -> str:
    """:func:`run_tag`'s hash over several runs (a comparison's): 6 hex digits of their tags, in order."""
    return hashlib.sha256(" ".join(run_tag(m) for m in metas).encode()).hexdigest()[:6]


def write_latex(out: Path, tables: list[TextTable], source: str, layout: str) -> list[Path]:
    """``tables.tex`` (every table) and ``latex/<name>.tex`` (one each); returns the paths."""
    return [write_latex_tables(out / "tables.tex", tables, source, layout),
            *write_latex_files(out / LATEX_FOLDER, tables, source, layout)]


def only_loss_role(ratios: pd.DataFrame) -> str | None:
    """The run's one loss role when it has only one (masked diffusion: every loss position is masked), else None."""
    present = [role for role in LOSS_ROLES if role in set(ratios["role"])]
    return present[0] if len(present) == 1 else None


def layer_table(ratios: pd.DataFrame, tests: pd.DataFrame, sites: bool = True) -> TextTable:
    """Per-layer table: context and masked ratios with CIs (fixed decimals per column), rank test; ``sites=False``
    leaves the site column out (the ``column`` LaTeX layout: layer k is block k's output, 0 the embeddings'). No
    masked column when masked is the only loss role (:func:`only_loss_role`): its ratio is identically 1."""
    test = tests.set_index("layer") if len(tests) else pd.DataFrame()
    layers = sorted(int(x) for x in ratios["layer"].unique())
    site_of = ratios.drop_duplicates("layer").set_index("layer")["site"]
    roles = ("context",) if only_loss_role(ratios) == "masked" else ("context", "masked")
    columns = {}
    for role in roles:
        frame = ratios[ratios["role"] == role].set_index("layer").reindex(layers)
        columns[role] = fixed_column(frame["ratio"], frame["ci_low"], frame["ci_high"])
    effects = fixed_column([test.loc[layer, "rank_biserial"] if layer in test.index else None for layer in layers],
                           decimals=2)
    rows = []
    for k, layer in enumerate(layers):
        p = format_p_value(test.loc[layer, "p_holm"]) if layer in test.index else MISSING
        cells = [*(columns[role][k] for role in roles), effects[k], p]
        rows.append((layer, site_of[layer], *cells) if sites else (layer, *cells))
    return _table(("layer", *(("site",) if sites else ()), *(f"{role} / loss [95% CI]" for role in roles),
                   "rank-biserial", "p (Holm)"), rows)


def deficit_table(deficit: pd.DataFrame, short: bool = False) -> TextTable:
    """Last-block sublayer table (fixed decimals per column); ``short`` headers for one column of a page."""
    share, ratio = fixed_column(deficit["share"]), fixed_column(deficit["ratio_to_earlier"], decimals=2)
    earlier = fixed_column(deficit["earlier_mean"], deficit["earlier_min"], deficit["earlier_max"])
    coverage = fixed_column(pd.concat([deficit["coverage"], deficit["earlier_coverage_mean"]]))
    n = len(deficit)
    rows = [(sub, share[k], earlier[k], ratio[k], coverage[k], coverage[n + k])
            for k, sub in enumerate(deficit["sublayer"])]
    if short:
        return _table(("sublayer", "share", "earlier mean [min, max]", "× earlier", "coverage", "earlier coverage"),
                      rows)
    return _table(("sublayer", "context share", "earlier blocks: mean [min, max]", "ratio to earlier",
                   "coverage", "earlier coverage"), rows)


def t_label(low: float, high: float) -> str:
    """A bin of masking ratios as text: ``t = 0.5`` (a grid's value), ``t 0.2–0.4`` (a bin)."""
    return f"t = {format_number(low)}" if low == high else f"t {format_number(low)}–{format_number(high)}"


def mask_ratio_table(table: pd.DataFrame, intervals: bool = True) -> TextTable:
    """The :func:`gradflow.analysis.ratio_by_mask_ratio` table as a row per layer and a column per bin of t: the
    context / loss ratio (with its CI unless ``intervals`` is False), fixed decimals per column; 0 is exactly 0."""
    bins = table[["t_low", "t_high"]].drop_duplicates().sort_values("t_low")
    layers = sorted(int(x) for x in table["layer"].unique())
    columns, header = [], []
    for low, high in zip(bins["t_low"], bins["t_high"]):
        d = table[(table["t_low"] == low) & (table["t_high"] == high)].set_index("layer").reindex(layers)
        bounds = (d["ci_low"], d["ci_high"]) if intervals else (None, None)
        columns.append(fixed_column(d["ratio"], *bounds))
        header.append(t_label(low, high))
    return _table(("layer", *header), [(layer, *(c[k] for c in columns)) for k, layer in enumerate(layers)])


def comparison_ratio_table(comp: Comparison, depths: Mapping[str, int]) -> TextTable:
    """Every run's context ratio and each non-baseline run's difference, at matched relative depth.

    Runs of one depth: a row per layer. Runs of different depths (``depths``: label -> blocks): a row per relative
    depth of any run (layer / blocks), with each run's layer there (``–`` where it has none); a difference only
    where both runs have a layer at that depth (:func:`gradflow.analysis.compare.matched_layers`). Fixed decimals
    per column."""
    ratios = comp.ratios[comp.ratios["role"] == "context"]
    diffs = comp.ratio_differences[comp.ratio_differences["role"] == "context"]
    others = [lab for lab in comp.labels if lab != comp.baseline]
    same = len({depths[lab] for lab in comp.labels}) == 1
    grid = sorted({Fraction(int(layer), depths[lab]) for lab, layer in zip(ratios["label"], ratios["layer"])})

    def layer_at(lab: str, depth: Fraction) -> int | None:
        layer = depth * depths[lab]
        return int(layer) if layer.denominator == 1 else None

    at = {lab: [layer_at(lab, d) for d in grid] for lab in comp.labels}  # each run's layer per row (None: none)
    columns: list[list[str]] = []
    for frame, labels, value in ((ratios, comp.labels, "ratio"), (diffs, others, "difference")):
        for lab in labels:
            picked = frame[frame["label"] == lab].set_index("layer").reindex([-1 if x is None else x for x in at[lab]])
            columns.append(fixed_column(picked[value], picked["ci_low"], picked["ci_high"]))
    rows = []
    for k, depth in enumerate(grid):
        if same:
            head: list[Any] = [int(depth * depths[comp.labels[0]])]
        else:
            layers = [at[lab][k] for lab in comp.labels]
            head = [depth_cell(depth), "/".join(MISSING if x is None else str(x) for x in layers)]
        rows.append([*head, *(column[k] for column in columns)])
    first = ["layer"] if same else ["depth", layers_header([depths[lab] for lab in comp.labels])]
    return _table([*first, *comp.labels, *[f"{lab} − {comp.baseline}" for lab in others]], rows)


def comparison_last_table(comp: Comparison) -> TextTable:
    """Per last-block sublayer: each run's context share (and its ratio to the earlier blocks), fixed decimals."""
    last = comp.last_block
    subs = list(dict.fromkeys(last["sublayer"]))
    cells = []
    for lab in comp.labels:
        frame = last[last["label"] == lab].drop_duplicates("sublayer").set_index("sublayer").reindex(subs)
        shares, ratios = fixed_column(frame["share"]), fixed_column(frame["ratio_to_earlier"], decimals=2)
        cells.append([MISSING if pd.isna(v) else f"{sh} ({ra}×)" for v, sh, ra in zip(frame["share"], shares, ratios)])
    rows = [[sub, *(column[k] for column in cells)] for k, sub in enumerate(subs)]
    return _table(["sublayer", *[f"{lab}: share (× earlier)" for lab in comp.labels]], rows)


def compact(value: Any) -> str:
    """Dicts and lists as compact JSON, everything else as text."""
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, separators=(", ", ": "))
    return str(value)


def _run_directory(path: Path, out: Path) -> str:
    """The run directory as a summary in ``out`` names it: :func:`portable_path`'s form, relative to ``out``
    (``../runs/a``) where that would be a machine's absolute path, so a summary never prints one."""
    text = portable_path(path, out)
    if not os.path.isabs(text):
        return text
    try:
        return Path(os.path.relpath(Path(path).resolve(), Path(out).resolve())).as_posix()
    except ValueError:  # another drive (Windows): no relative path exists
        return Path(path).name


def provenance_table(run: Run, out: Path) -> list[str]:
    """Markdown provenance table of one run's meta.json, for a summary written to ``out``.

    No machine's absolute path: the run directory as :func:`gradflow.provenance.portable_path`
    writes it for ``out`` (relative to ``out`` where that would be absolute); absolute paths in an
    older meta.json as that run would record them now.
    """
    def portable(value: Any) -> Any:
        return portable_path(value, run.path) if isinstance(value, str) and os.path.isabs(value) else value

    meta = {k: portable(v) for k, v in run.meta.items()}
    tok = {k: portable(v) for k, v in meta.get("tokenizer", {}).items()}
    rows = [("run directory", f"`{_run_directory(run.path, out)}`"), ("model", meta.get("model")),
            ("family", meta.get("family")), ("blocks", meta.get("num_layers")), ("tokenizer", tok.get("name_or_path")),
            ("vocabulary size", tok.get("vocab_size")), ("tokenizer hash", f"`{tok.get('hash')}`"),
            ("loss", meta.get("loss")), ("masking", f"`{compact(meta.get('masking'))}`"),
            ("seed", meta.get("seed")), ("complete", meta.get("complete")),
            ("counts", f"`{compact(meta.get('counts'))}`"),
            ("versions", f"`{compact(meta.get('versions'))}`"), ("command", f"`{meta.get('command')}`")]
    extra = sorted(k for k in meta if k not in REQUIRED_META_KEYS)
    rows += [(k, _mean_loss(meta) if k == "mean_loss" else f"`{compact(meta[k])}`") for k in extra]
    return markdown_table(_table(("key", "value"), rows))


def _mean_loss(meta: Mapping[str, Any]) -> str:
    """meta.json's ``mean_loss`` (a per-batch value) as nats per loss position.

    Under ``reduction: sequence`` a batch's loss is the sum of its sequences' mean cross-entropies, so
    ``mean_loss`` grows with the batch size; ``mean_loss * batches / sequences_recorded`` is exactly the
    mean over sequences of each sequence's mean (nats per loss position). Under ``batch`` it already is
    the mean over batches of each batch's per-position mean."""
    value = meta.get("mean_loss")
    counts = meta.get("counts") or {}
    batches, sequences = counts.get("batches"), counts.get("sequences_recorded")
    if not isinstance(value, (int, float)) or value != value:
        return f"`{compact(value)}`"
    if meta.get("reduction") == "sequence" and batches and sequences:
        per = value * batches / sequences
        return (f"{format_number(per, 4)} nats per loss position (mean over the {sequences} sequences of each "
                f"sequence's mean; meta.json's `mean_loss` {format_number(value, 4)} is per batch, a sum of its "
                "sequence means)")
    if meta.get("reduction") == "batch":
        return f"{format_number(value, 4)} nats per loss position (mean over batches of each batch's mean)"
    return f"`{compact(value)}`"


__all__ = ["TAG_IGNORED_KEYS", "WIDTH_LAYOUTS", "check_layout", "compact", "comparison_last_table",
           "comparison_ratio_table", "deficit_table", "layer_table", "layout_for_width", "mask_ratio_table",
           "only_loss_role", "provenance_table", "run_tag", "runs_tag", "t_label", "write_latex"]
