"""The atlas's tables (issue 49): every model at the depth fractions all of them share, the last block's row, fixed
decimals, one .tex per table; the committed atlases' tables are what the writer makes of their atlas.csv."""

from __future__ import annotations

import shutil
import subprocess
from fractions import Fraction
from pathlib import Path

import pandas as pd
import pytest

from gradflow.figures.atlas_tables import (
    last_block_table,
    matched_depth_table,
    shared_depth_fractions,
    write_atlas_tables,
)
from gradflow.figures.tables import LATEX_LAYOUTS

ROOT = Path(__file__).resolve().parents[2]
ATLASES = [ROOT / "figures" / "atlas", ROOT / "figures" / "twelve-blocks" / "atlas"]


@pytest.mark.parametrize("depths, step", [({"a": 6, "b": 12}, 6), ({"a": 5, "b": 7}, 1), ({"a": 6, "b": 8, "c": 12}, 2),
                                          ({"a": 4}, 4)],
                         ids=["6 and 12 share sixths", "5 and 7 share only the ends", "6, 8 and 12 share halves",
                              "one model: every layer"])
def test_shared_depth_fractions_are_multiples_of_one_over_the_gcd(depths, step):
    assert shared_depth_fractions(depths) == [Fraction(k, step) for k in range(step + 1)]


def _synthetic_atlas() -> pd.DataFrame:
    rows = []
    for model, n in (("six", 6), ("twelve", 12)):
        for layer in range(n + 1):
            value = 0.0 if layer == n else 0.5 - layer / (4 * n)
            rows.append((model, "bert", n, layer / n, "context_loss_ratio", value, value * 0.9, value * 1.1))
        for sub, share in (("attn.q", 0.0), ("attn.k", 0.8123), ("ffn.in", 0.0)):
            rows.append((model, "bert", n, 1.0, f"context_share:{sub}", share, None, None))
        rows.append((model, "bert", n, 1.0, "skippable_flop_share", 0.05 if n == 12 else 0.1, None, None))
    return pd.DataFrame(rows, columns=["model", "family", "n_layers", "depth_fraction", "metric", "value", "ci_low",
                                       "ci_high"])


def test_the_matched_depth_table_pairs_layer_k_with_2k_and_ends_on_two_exact_zeros():
    table = matched_depth_table(_synthetic_atlas())
    assert table.header == ("depth", "layers (6/12)", "six", "twelve") and table.name == "context_ratio"
    assert [row[1] for row in table.rows] == [f"{k}/{2 * k}" for k in range(7)]
    assert table.rows[-1] == ("1.000", "6/12", "0 [0, 0]", "0 [0, 0]")
    assert table.rows[3] == ("0.500", "3/6", "0.375 [0.338, 0.413]", "0.375 [0.338, 0.413]")  # same depth, same value
    assert "multiples of 1/6" in table.caption


def test_the_last_block_table_marks_exact_zeros_and_the_skippable_share():
    table = last_block_table(_synthetic_atlas())
    assert table.rows == (("attn.q", "0", "0"), ("attn.k", "0.812", "0.812"), ("ffn.in", "0", "0"),
                          ("skippable FLOPs", "0.100", "0.050"))


@pytest.mark.parametrize("atlas", ATLASES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_committed_atlas_tables_are_current(atlas, tmp_path):
    made = write_atlas_tables(pd.read_csv(atlas / "atlas.csv"), tmp_path)
    for path in made:
        relative = path.relative_to(tmp_path)
        assert (atlas / relative).read_text() == path.read_text(), f"{atlas / relative} is stale: rewrite it with " \
            "gradflow.figures.atlas_tables.write_atlas_tables"
    text = (atlas / "tables.md").read_text()
    assert "| 1.000 |" in text and text.count("0 [0, 0]") >= 3  # every model's exact zero after its last block


def test_the_twelve_block_atlas_matches_six_and_twelve_at_sixths():
    text = (ATLASES[1] / "tables.md").read_text()
    assert "| depth | layers (12/12/12/6/6) |" in text and "| 0.500 | 6/6/6/3/3 |" in text
    assert "| 1.000 | 12/12/12/6/6 | 0 [0, 0] | 0 [0, 0] | 0 [0, 0] | 0 [0, 0] | 0 [0, 0] |" in text


@pytest.mark.skipif(shutil.which("pdflatex") is None,
                    reason="no pdflatex here (.ci/run installs texlive-latex-recommended): structure tests only")
@pytest.mark.parametrize("layout", LATEX_LAYOUTS)
def test_a_two_model_atlas_table_compiles_and_fits_its_page(tmp_path, layout):
    frame = pd.read_csv(ATLASES[1] / "atlas.csv")
    frame = frame[frame["model"].isin(["gradflow-mini-en", "gradflow-mini12-en"])]
    write_atlas_tables(frame, tmp_path, layout)
    opts = {"page": "", "wide": ",twocolumn", "column": ",twocolumn"}[layout]
    body = "".join(f"\\input{{latex/{name}}}\\clearpage\n" for name in ("context_ratio", "last_block"))
    (tmp_path / "paper.tex").write_text(
        f"\\documentclass[10pt{opts}]{{article}}\\usepackage{{booktabs}}\\setlength{{\\textwidth}}{{6.5in}}"
        "\\setlength{\\columnsep}{0.25in}\\setlength{\\oddsidemargin}{0in}\\begin{document}\n" + body
        + "\\end{document}\n")
    proc = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "paper.tex"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:]
    log = (tmp_path / "paper.log").read_text(errors="replace")
    assert "Overfull \\hbox" not in log, log[log.index("Overfull"):][:600]
