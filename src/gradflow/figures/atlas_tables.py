"""The atlas as tables a paper cites: every model at matched depth fractions, and the last block's row.

From an ``atlas.csv`` frame (:func:`gradflow.analysis.atlas.atlas_table`):

- :func:`matched_depth_table`: the context / loss gradient-norm ratio [95% CI] of every model at the
  depth fractions **all** models have a layer at (multiples of ``1 / gcd`` of their block counts:
  6 and 12 blocks share sixths; 5 and 7 only 0 and 1), each row naming every model's layer there;
  the last row (depth 1) is after every model's last block;
- :func:`last_block_table`: the last block's context share per sublayer for every model (``0``: exactly
  zero), and its skippable FLOP share;
- :func:`write_atlas_tables`: ``tables.md`` (both, Markdown), ``tables.tex`` and one
  ``latex/<name>.tex`` per table, in a layout of :data:`gradflow.figures.tables.LATEX_LAYOUTS`.

Numbers have fixed decimals per column (:func:`gradflow.formatting.fixed_column`).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from gradflow.analysis.compare import shared_depth_fractions
from gradflow.figures.tables import (
    LATEX_FOLDER,
    TextTable,
    depth_cell,
    latex_label,
    layers_header,
    markdown_table,
    write_latex_files,
    write_latex_tables,
)
from gradflow.formatting import fixed_column
from gradflow.schema import sorted_sublayers

ATLAS_TABLES_MD = "tables.md"
"""The Markdown copy of the atlas's tables."""


def _depths(frame: pd.DataFrame) -> dict[str, int]:
    """model -> its number of blocks, in the table's order."""
    firsts = frame.drop_duplicates("model")
    return {str(m): int(n) for m, n in zip(firsts["model"], firsts["n_layers"])}


def matched_depth_table(frame: pd.DataFrame) -> TextTable:
    """Every model's context / loss ratio [95% CI] at the depth fractions all models share (see module doc)."""
    ratios = frame[frame["metric"] == "context_loss_ratio"]
    depths = _depths(ratios)
    grid = shared_depth_fractions(depths)
    columns = []
    for model, n in depths.items():
        rows = ratios[ratios["model"] == model].assign(layer=lambda d: (d["depth_fraction"] * n).round().astype(int))
        picked = rows.drop_duplicates("layer").set_index("layer").reindex([int(f * n) for f in grid])
        columns.append(fixed_column(picked["value"], picked["ci_low"], picked["ci_high"]))
    body = [(depth_cell(f), "/".join(str(int(f * n)) for n in depths.values()), *(c[k] for c in columns))
            for k, f in enumerate(grid)]
    step = f"1/{len(grid) - 1}" if len(grid) > 1 else "–"
    caption = ("Context / loss-position gradient-norm ratio [95% sequence-bootstrap CI] of each model at the depth "
               f"fractions every model has a layer at (multiples of {step}; each model's layer in the second column, "
               "in the order of the models); depth 1 is after the last block; 0: exactly zero.")
    return TextTable(("depth", layers_header(list(depths.values())), *depths), tuple(body),
                     caption, latex_label("atlas-depth", *depths), "context_ratio")


def last_block_table(frame: pd.DataFrame) -> TextTable:
    """Every model's last-block context share per sublayer (``0``: exactly zero), then its skippable FLOP share."""
    depths = _depths(frame)
    last = frame[(frame["depth_fraction"] == 1.0) & frame["metric"].str.startswith("context_share:")]
    subs = sorted_sublayers(dict.fromkeys(last["metric"].str.removeprefix("context_share:")))
    columns = []
    for model in depths:
        shares = last[last["model"] == model].assign(sub=lambda d: d["metric"].str.removeprefix("context_share:"))
        values = list(shares.drop_duplicates("sub").set_index("sub").reindex(subs)["value"])
        skip = frame[(frame["model"] == model) & (frame["metric"] == "skippable_flop_share")]["value"]
        columns.append(fixed_column([*values, skip.iloc[0] if len(skip) else None]))
    body = [(name, *(c[k] for c in columns)) for k, name in enumerate([*subs, "skippable FLOPs"])]
    caption = ("The last block: context share of each sublayer's weight-gradient signal (0: exactly zero, no "
               "context channel trains it) and the share of a batch's matmul FLOPs the block spends where it gets "
               "exactly zero gradient (gradflow check; – where not measured).")
    return TextTable(("last block", *depths), tuple(body), caption, latex_label("atlas-last-block", *depths),
                     "last_block")


def write_atlas_tables(frame: pd.DataFrame, out: str | Path, layout: str = "page") -> list[Path]:
    """Write ``tables.md``, ``tables.tex`` and ``latex/<name>.tex`` of an atlas into ``out``; returns the paths."""
    out = Path(out)
    tables = [matched_depth_table(frame), last_block_table(frame)]
    lines = ["# gradflow atlas: tables", ""]
    for table in tables:
        lines += [table.caption, "", *markdown_table(table), ""]
    (out / ATLAS_TABLES_MD).write_text("\n".join(lines), encoding="utf-8")
    return [out / ATLAS_TABLES_MD, write_latex_tables(out / "tables.tex", tables, "gradflow atlas", layout),
            *write_latex_files(out / LATEX_FOLDER, tables, "gradflow atlas", layout)]


__all__ = ["ATLAS_TABLES_MD", "last_block_table", "matched_depth_table", "shared_depth_fractions",
           "write_atlas_tables"]
