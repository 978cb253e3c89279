"""The channel view's documented behaviour, checked: one block numbering (site names, from 0) in the figure,
colour-bar ticks written as plain numbers, the committed figure's table, what concepts.md and the guide say
about the loss rows, --seed, per-token selection and the CSV's attribution columns."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib
import pandas as pd
import pytest

matplotlib.use("Agg")

from gradflow.figures.channel_view import plot_channel_view  # noqa: E402
from gradflow.schema import CHANNEL_VIEW_COLUMNS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "figures" / "channel_view.csv"
GUIDE = (ROOT / "docs" / "guides" / "channel-view.md").read_text(encoding="utf-8")
CONCEPTS = (ROOT / "docs" / "concepts.md").read_text(encoding="utf-8")
ATTRIBUTION_COLUMNS = ["attribution_sum", "attribution_norm", "ig_sum", "ig_norm"]


@pytest.fixture(scope="module")
def drawn():
    import matplotlib.pyplot as plt

    table = pd.read_csv(COMMITTED)
    artists = plot_channel_view(table)
    fig = artists[0].axes.figure
    fig.canvas.draw()
    yield table, artists
    plt.close(fig)


def test_figure_columns_are_the_site_names_of_the_csv(drawn):
    table, artists = drawn
    ax = artists[0].axes
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == list(dict.fromkeys(table["site"]))
    assert labels[0] == "embeddings.out" and labels[-2:] == ["blocks.5.mid", "blocks.5.out"]
    assert not any(re.fullmatch(r"\d+ (mid|out)", label) for label in labels)  # no 1-based "6 mid"


def test_legend_sits_below_the_site_names_and_ticks_are_plain(drawn):
    _, artists = drawn
    ax = artists[0].axes
    renderer = ax.figure.canvas.get_renderer()
    legend = next(a for a in artists if isinstance(a, matplotlib.legend.Legend))
    assert legend.get_window_extent(renderer).y1 <= ax.xaxis.get_tightbbox(renderer).y0 + 1  # no overlap
    colorbar = artists[-1]
    ticks = [t.get_text() for t in colorbar.get_yticklabels() if t.get_text()]
    assert "0.1" in ticks and "0.01" in ticks, ticks  # the page's colour bar writes them the same way


def test_committed_figure_only_loss_rows_lit_after_the_last_attention():
    table = pd.read_csv(COMMITTED)
    assert tuple(table.columns) == CHANNEL_VIEW_COLUMNS
    last = table[table["site"].isin(["blocks.5.mid", "blocks.5.out"])]
    loss = last["role"].isin(["masked", "random", "kept"])
    assert (last.loc[loss, "grad_norm"] > 0).all() and (last.loc[~loss, "grad_norm"] == 0).all()
    assert table[ATTRIBUTION_COLUMNS].isna().all().all()  # the gradient view leaves them empty (the guide says so)


def test_concepts_names_every_loss_role_as_lit():
    assert "only the masked rows" not in CONCEPTS
    assert "only the loss rows (masked, random and kept" in CONCEPTS


def test_guide_documents_seed_selection_and_every_csv_column():
    assert "--seed" in GUIDE and "seeded with seed 0" not in GUIDE
    assert "Selection is per token" in GUIDE and "(29%)" in GUIDE
    for column in CHANNEL_VIEW_COLUMNS:
        assert f"`{column}`" in GUIDE, column
    assert "four attribution columns are **empty**" in GUIDE
    assert "`meta.json`" in GUIDE and "`selection`" in GUIDE
    assert "(`emb`)" not in GUIDE  # the figure's old label


@pytest.mark.slow
def test_guide_selection_numbers_are_what_the_masking_draws():
    from gradflow.models import load_model
    from gradflow.runs.channels import channel_batch, selection

    mini = load_model("gradflow-mini-en")
    long = "The progress of public credit is witnessed by a considerable rise of American stock abroad."
    short = "The union is strong and free."
    facts = {(long, 0): (4, 17), (long, 4): (1, 17), (short, 0): (2, 7), (short, 11): (4, 7)}
    for (text, seed), (selected, maskable) in facts.items():
        drawn = selection(channel_batch(mini, text, None, seed=seed))
        assert (drawn["selected"], drawn["maskable"]) == (selected, maskable), (text, seed)
    assert "draws 4 of\nits 17 tokens at seed 0 (24%" in GUIDE and "1 at seed 4 (6%)" in GUIDE
    assert "draws 2 of its 7 tokens at seed 0 (29%), 4 at seed 11 (57%)" in GUIDE
