"""The channel view object behind ``gradflow explore``: exact numbers, page data and the static page."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from gradflow.errors import ChannelViewError
from gradflow.explore import view as view_module
from gradflow.explore.view import ChannelView, channel_view
from gradflow.figures.style import ROLE_COLORS
from gradflow.hooks.recorder import GradFlowRecorder, RecorderConfig
from gradflow.models import load_model
from gradflow.roles import ROLE_ORDER, TOKEN_ROLES
from gradflow.runs.channels import channel_batch

TEXT = "The progress of public credit is witnessed by a considerable rise of American stock abroad."


@pytest.fixture(scope="module")
def mini():
    return load_model("gradflow-mini-en")


@pytest.fixture(scope="module")
def masked_view(mini) -> ChannelView:
    return channel_view(mini, TEXT, mask=[3, 7])


def test_grid_equals_the_recorder_and_the_last_block_zero_is_exact(mini, masked_view):
    batch = channel_batch(mini, TEXT, [3, 7])
    with GradFlowRecorder(mini.model, RecorderConfig(sublayers=False), mini.adapter) as rec:
        record = rec.record(batch)
    grid = np.array(masked_view.grid("grad_norm"))  # (T, S)
    assert np.array_equal(grid, record.grad_norm[:, 0].T.numpy().astype(float))
    last = [i for i, s in enumerate(masked_view.sites()) if s.startswith(f"blocks.{masked_view.num_blocks - 1}.")]
    assert len(last) == 2
    for t, role in enumerate(masked_view.roles):
        if role in ("masked", "random", "kept"):
            assert (grid[t, last] > 0).all()
        else:
            assert (grid[t, last] == 0).all()  # exactly zero, not small
            assert (grid[t, : last[0]] > 0).any()  # earlier blocks reach it through attention
    zero = masked_view.last_block_zero()
    assert zero == [r not in ("masked", "random", "kept") for r in masked_view.roles]


def test_sublayer_shares_sum_to_one_and_after_mixing_sublayers_get_nothing_from_context(masked_view):
    frame = masked_view.sublayers
    assert set(frame["layer"]) == {masked_view.num_blocks}
    totals = frame.groupby(["sublayer", "param"])["share"].sum()
    assert np.allclose(totals.to_numpy(), 1.0, atol=1e-12)
    context = frame[frame["role"] == "context"].set_index(["sublayer", "param"])
    for name in masked_view.after_mixing:
        assert float(context.loc[(name, "weight"), "magnitude_sum"]) == 0.0
        assert int(context.loc[(name, "weight"), "n_nonzero"]) == 0
    assert float(context.loc[("attn.k", "weight"), "share"]) > 0
    assert float(context.loc[("attn.v", "weight"), "share"]) > 0


def test_payload_is_strict_json_with_exact_zeros(masked_view):
    payload = masked_view.payload()
    text = json.dumps(payload, allow_nan=False)
    back = json.loads(text)
    assert back["tokens"][3] == "of" and back["input_tokens"][3] == "[MASK]" and back["roles"][3] == "masked"
    start = back["last_block_start"]
    assert [s["layer"] for s in back["sites"][start:]] == [masked_view.num_blocks] * 2
    assert back["grad_norm"][1][start] == 0.0 and back["grad_norm"][3][start] > 0
    assert back["masking"] == {"policy": "explicit", "positions": [3, 7], "selected": [3, 7]}
    assert "exactly 0" in back["explanation"][1]
    assert {row["role"] for row in back["sublayers"]} >= {"masked", "context", "special"}


def test_random_masking_is_seeded_and_all_positions_loss_leaves_no_context_dark(mini):
    a, b = channel_view(mini, TEXT, mask="random", seed=5), channel_view(mini, TEXT, mask="random", seed=5)
    assert a.roles == b.roles and a.masking["policy"] == "bert" and a.masking["selected"]
    assert np.array_equal(np.array(a.grid()), np.array(b.grid()))
    everywhere = channel_view(mini, TEXT, mask=[3], loss="all-positions")
    zero = everywhere.last_block_zero()
    assert not any(z for z, r in zip(zero, everywhere.roles) if r != "special")


def test_no_selected_position_gives_a_notice_not_a_gradient(mini, tmp_path):
    view = channel_view(mini, TEXT, mask=[])
    assert not view.has_gradient and "No token is selected" in view.notice
    assert not any("No token is selected" in p for p in view.payload()["explanation"])  # said once, not twice
    assert view.payload()["grad_norm"] is None
    with pytest.raises(ChannelViewError, match="cannot write its numbers"):
        view.to_csv(tmp_path / "x.csv")


def test_every_word_masked_leaves_no_zero_at_word_positions(mini):
    n = len(mini.tokenizer(TEXT)["input_ids"])
    view = channel_view(mini, TEXT, mask=list(range(1, n - 1)))
    assert view.roles.count("masked") == n - 2
    assert view.last_block_zero() == [True] + [False] * (n - 2) + [True]


def test_bad_masks_raise_channel_view_errors(mini):
    with pytest.raises(ChannelViewError, match="special token"):
        channel_view(mini, TEXT, mask=[0])
    with pytest.raises(ChannelViewError, match="out of range"):
        channel_view(mini, TEXT, mask=[500])
    with pytest.raises(ChannelViewError, match="unknown loss"):
        channel_view(mini, TEXT, mask=[3], loss="nope")
    with pytest.raises(ChannelViewError, match="'random'"):
        channel_view(mini, TEXT, mask="everything")


def test_csv_and_figures_come_from_the_project_code(masked_view, tmp_path):
    csv = masked_view.to_csv(tmp_path / "view.csv")
    import pandas as pd

    table = pd.read_csv(csv)
    assert len(table) == len(masked_view.tokens) * len(masked_view.sites())
    assert (table.loc[(table["layer"] == masked_view.num_blocks) & (table["role"] == "context"), "grad_norm"] == 0).all()
    paths = masked_view.save(tmp_path / "view", formats=["png", "pdf"])
    assert [p.suffix for p in paths] == [".png", ".pdf"] and all(p.stat().st_size > 1000 for p in paths)


def test_static_page_is_self_contained_and_survives_hostile_text(mini, tmp_path):
    pytest.importorskip("plotly")
    hostile = "The </script><script>alert(1)</script> /*PLOTLY*/ <!-- stock rose."
    view = channel_view(mini, hostile, mask=[2])
    page = view.to_html(tmp_path / "view.html")
    assert (tmp_path / "view.html").read_text(encoding="utf-8") == page
    assert not re.search(r"<script[^>]+src=", page)  # nothing loaded from anywhere
    # plotly.js mentions CDN addresses (geo maps, MathJax) that these plots never use: the browser test proves offline
    assert "<script>alert(1)" not in page  # the text is data, never markup
    assert page.count("/*PLOTLY*/") == 1  # a marker in the text stays text: the page was filled in one pass
    config = re.search(r"window\.GRADFLOW = (\{.*?\});</script>", page, flags=re.S).group(1)
    assert json.loads(config)["view"]["text"] == hostile
    assert "Plotly" in page and len(page) > 1_000_000  # plotly.js itself is inline
    frame = re.search(r'<iframe srcdoc="([^"]*)"', view._repr_html_()).group(1)
    assert "<script>alert(1)" not in html.unescape(frame)  # in the notebook frame too, the text stays data


def test_notebook_outputs_carry_plotly_once_per_kernel_session(masked_view, mini):
    pytest.importorskip("plotly")
    from gradflow.explore.page import NOTEBOOK_PLOTLY_ID, plotly_js_path
    from gradflow.explore.view import reset_notebook_plotly

    marker = plotly_js_path().read_text(encoding="utf-8")[:200]  # plotly.js's licence header
    reset_notebook_plotly()
    first, second = masked_view._repr_html_(), channel_view(mini, TEXT, mask=[5])._repr_html_()
    assert first.startswith(f'<script type="text/plain" id="{NOTEBOOK_PLOTLY_ID}">') and marker in first
    assert marker not in second and NOTEBOOK_PLOTLY_ID in second  # only the script that hands plotly.js over
    assert len(first) > 4_000_000 and len(second) < 200_000
    for output in (first, second):
        frame = html.unescape(re.search(r'<iframe srcdoc="([^"]*)"', output).group(1))
        assert marker not in frame and '"plotly": "parent"' in frame  # the frame asks the notebook for it
        assert 'sandbox="allow-scripts allow-downloads"' in output  # still apart from the notebook's origin
    reset_notebook_plotly()
    assert marker in masked_view._repr_html_()


def test_text_repr_is_one_short_line(masked_view, mini):
    text = repr(masked_view)
    assert "\n" not in text and len(text) < 250, text
    assert text == ("<ChannelView gradflow-mini-en, loss mlm: 19 tokens (2 masked, 15 context, 2 special); "
                    "13 sites x 19 positions; text 'The progress of public credit is witnessed by a considera...'>")
    assert "grad_norm" not in text and "DataFrame" not in text  # no table dumped
    empty = repr(channel_view(mini, "The nation.", mask=[]))
    assert "no gradient" in empty and "3 context" in empty


def test_site_labels_are_site_names_and_the_text_counts_blocks_from_0(masked_view):
    payload = masked_view.payload()
    assert [s["label"] for s in payload["sites"]] == [s["name"] for s in payload["sites"]]
    assert payload["sites"][-1]["label"] == f"blocks.{masked_view.num_blocks - 1}.out"
    assert "In the last block (blocks.5)" in payload["explanation"][1]
    assert not re.search(r"\bblock 6\b", " ".join(payload["explanation"]))


def test_loaded_model_by_name(masked_view):
    view = channel_view("gradflow-mini-en", TEXT, mask=[3, 7])
    assert torch.equal(torch.tensor(view.grid()), torch.tensor(masked_view.grid()))


def test_the_explorer_colours_roles_as_the_figures_do():
    static = Path(view_module.__file__).with_name("static")
    script = (static / "explore.js").read_text(encoding="utf-8")
    table = re.search(r"const ROLE_COLORS = \{(.*?)\};", script, re.S).group(1)
    colors = dict(re.findall(r'(\w+): "(#[0-9A-F]{6})"', table))
    assert list(colors) == list(ROLE_ORDER)  # the legend's order: ROLE_ORDER = Object.keys(ROLE_COLORS)
    assert colors == {r: ROLE_COLORS[r] for r in ROLE_ORDER}
    css = (static / "explore.css").read_text(encoding="utf-8")
    for role in TOKEN_ROLES:
        if role != "pad":
            assert f".role-{role} {{ color: {ROLE_COLORS[role]}; }}" in css
