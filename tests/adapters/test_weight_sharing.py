"""Weight-shared blocks (ALBERT): the last block's exact zeros are per application, and every surface says so.

The check, the report's headline, the atlas and the explorer state the per-application zero together with the
shared weight's total context share (its gradient summed over every application), computed here by hand from
the recorder's per-depth split. A model without sharing (BERT) gets none of it.
"""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pandas as pd
import pytest

from conftest import SAMPLE_LINES, build_tiny_mlm_dir
from gradflow.analysis.atlas import last_block_sharing, model_rows, shared_context_shares
from gradflow.cli import main
from gradflow.cli.check import render
from gradflow.explore.view import channel_view
from gradflow.figures.atlas import last_block_bars
from gradflow.figures.report import write_report
from gradflow.figures.style import gradflow_style
from gradflow.formatting import format_number
from gradflow.hooks.recorder import GradFlowRecorder, RecorderConfig
from gradflow.models import load_model
from gradflow.roles import Role
from gradflow.runs.channels import channel_batch
from gradflow.runs.check import check_batch, check_model, weight_sharing
from gradflow.runs.record import RecordConfig, record_corpus
from gradflow.schema import ATLAS_STEP_DIRS, CHECK_FILE, META_FILE, WEIGHT_SHARING_META_KEY
from tiny import tiny_batch, tiny_model

ZERO = ["attn.q", "attn.out", "attn.norm", "ffn.in", "ffn.out", "ffn.norm"]  # post-LN after-mixing sublayers
RECORD = {"max_length": 24, "batch_size": 4, "limit": 8, "quiet": True}


def build_tiny_albert_dir(path, layers: int = 3, seed: int = 0):
    """A random tiny AlbertForMaskedLM (one shared layer applied ``layers`` times) with conftest's tokenizer."""
    import torch
    from transformers import AlbertConfig, AlbertForMaskedLM, BertTokenizerFast

    build_tiny_mlm_dir(path)  # the WordPiece tokenizer (and a BERT model, replaced below)
    tok = BertTokenizerFast.from_pretrained(path)
    config = AlbertConfig(vocab_size=len(tok), embedding_size=16, hidden_size=32, num_hidden_layers=layers,
                          num_attention_heads=2, intermediate_size=48, max_position_embeddings=64,
                          pad_token_id=tok.pad_token_id, num_hidden_groups=1, inner_group_num=1)
    torch.manual_seed(seed)
    AlbertForMaskedLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def albert_dir(tmp_path_factory):
    return build_tiny_albert_dir(tmp_path_factory.mktemp("tiny_albert"))


@pytest.fixture(scope="module")
def albert_atlas_model(tmp_path_factory, albert_dir, tiny_corpus):
    """An atlas-model directory of the tiny ALBERT: its MLM record run and its check.json."""
    root = tmp_path_factory.mktemp("albert_atlas") / "tiny-albert"
    record_corpus(RecordConfig(out=str(root / ATLAS_STEP_DIRS["record"]), model=str(albert_dir),
                               texts=str(tiny_corpus), **RECORD))
    check = check_model(str(albert_dir), str(tiny_corpus), batch_size=4, max_length=24)
    (root / ATLAS_STEP_DIRS["check"]).mkdir()
    (root / ATLAS_STEP_DIRS["check"] / CHECK_FILE).write_text(json.dumps(check.to_dict()), encoding="utf-8")
    return root


def _hand_total_shares(model, batch, layers) -> dict[tuple[str, str], float]:
    """(sublayer, param) -> context / all roles of the per-position magnitudes summed over ``layers`` (1..L)."""
    with GradFlowRecorder(model, RecorderConfig()) as rec:
        record = rec.record(batch, loss="mlm", reduction="batch")
    sums: dict[tuple[str, str], list[float]] = {}
    for r in record.sublayers:
        if r.depth + 1 in layers:
            acc = sums.setdefault((r.sublayer, r.param), [0.0, 0.0])
            acc[0] += float(r.magnitude_sum[Role.CONTEXT])
            acc[1] += float(r.magnitude_sum.double().sum())
    return {key: context / total for key, (context, total) in sums.items()}


# ------------------------------------------------------------------------------ gradflow check
def test_check_qualifies_the_shared_zero_with_the_total_context_share():
    model, batch = tiny_model("albert"), tiny_batch()
    result = check_batch(model, batch)
    assert result.num_blocks == 3 and result.disagreements == []
    assert {s.sublayer for s in result.flagged(3)} == set(ZERO)  # measured per application, as before
    hand = _hand_total_shares(model, batch, {1, 2, 3})
    rows = result.shared_parameters
    assert {(r["sublayer"], r["param"]) for r in rows} == {(s, p) for s in ZERO for p in ("weight", "bias")}
    for row in rows:
        assert row["layers"] == [1, 2, 3]
        assert row["total_context_share"] > 0  # the shared weight IS trained on context (layers 1-2)
        assert row["total_context_share"] == pytest.approx(hand[(row["sublayer"], row["param"])], abs=1e-6)
    note = next(n for n in result.notes if n.startswith("weight sharing"))
    assert "per application" in note and "trained on context through layers 1-2" in note
    assert "over all 3 applications" in note
    weight = {r["sublayer"]: r["total_context_share"] for r in rows if r["param"] == "weight"}
    text = render(result)
    flagged = {line.split()[1]: line for line in text.splitlines() if line.split()[:1] == ["3"] and "*" in line}
    assert set(flagged) == set(ZERO)
    for name, line in flagged.items():
        assert line.rstrip().endswith(f"* per application; shared weight: {format_number(100 * weight[name])}% "
                                      "context over all 3 applications")
    assert f"note: {note}" in text
    assert all(s.shared_layers == (1, 2, 3) for s in result.sublayers)


def test_check_json_has_the_sharing_keys(albert_dir, tiny_corpus, capsys):
    assert main(["check", "--model", str(albert_dir), "--texts", str(tiny_corpus), "--batch-size", "4",
                 "--max-length", "24", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["notes"] and data["notes"][0].startswith("weight sharing")
    assert data["shared_parameters"] and all(
        set(row) == {"sublayer", "param", "layers", "total_context_share"} and row["total_context_share"] > 0
        for row in data["shared_parameters"])
    assert all(s["shared_layers"] == [1, 2, 3] for s in data["sublayers"])


def test_a_model_without_sharing_gets_no_sharing_note():
    result = check_batch(tiny_model("bert"), tiny_batch())
    assert result.shared_parameters == [] and result.notes == []
    assert all(s.shared_layers == () for s in result.sublayers)
    assert "per application" not in render(result) and result.to_dict()["shared_parameters"] == []
    assert weight_sharing(list(tiny_model("bert").base_model.encoder.layer)) == []


# ------------------------------------------------------------------------------ record + report
@pytest.mark.slow
def test_record_meta_and_report_headline_state_the_per_application_zero(albert_atlas_model, tmp_path):
    run_dir = albert_atlas_model / ATLAS_STEP_DIRS["record"]
    meta = json.loads((run_dir / META_FILE).read_text())
    assert meta[WEIGHT_SHARING_META_KEY] == {"shared_layers": [[1, 2, 3]]}
    assert last_block_sharing(meta, 3) == [1, 2, 3] and last_block_sharing({}, 3) == []
    sub = pd.read_csv(run_dir / "sublayers.csv")
    weight = sub[sub["param"] == "weight"]
    by_hand = {s: g.loc[g["role"] == "context", "magnitude_sum"].sum() / g["magnitude_sum"].sum()
               for s, g in weight.groupby("sublayer")}
    shares = shared_context_shares(sub, [1, 2, 3]).set_index("sublayer")
    for name in ZERO:
        assert shares.loc[name, "total_context_share"] == pytest.approx(by_hand[name], abs=1e-12)
        assert by_hand[name] > 0
        assert shares.loc[name, "last_share"] == 0.0
    write_report(run_dir, tmp_path / "report", formats=("png",), n_resamples=50)
    summary = (tmp_path / "report" / "summary.md").read_text()
    headline = summary.split("## Context vs loss")[0]
    assert "- Last block: 6 of 8 sublayers get exactly zero context signal" in headline
    caveat = next(line for line in headline.splitlines() if line.startswith("- Weight sharing:"))
    assert "one module applied at layers 1-3 (3 applications)" in caveat
    assert "per application: exactly 0 at the last depth; the shared weights:" in caveat
    assert "of their gradient comes from context over all 3 applications" in caveat
    for name in ZERO:
        assert f"{name} {format_number(100 * by_hand[name])}%" in caveat
    assert "Weight-shared block: the shares of its last application" in summary


@pytest.mark.slow
def test_a_run_without_sharing_has_no_caveat(tiny_mlm_dir, tiny_corpus, tmp_path):
    run_dir = tmp_path / "bert"
    record_corpus(RecordConfig(out=str(run_dir), model=str(tiny_mlm_dir), texts=str(tiny_corpus), **RECORD))
    assert WEIGHT_SHARING_META_KEY not in json.loads((run_dir / META_FILE).read_text())
    write_report(run_dir, tmp_path / "report", formats=("png",), n_resamples=50)
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "exactly zero context signal" in summary and "Weight sharing" not in summary
    assert "Weight-shared" not in summary


# ------------------------------------------------------------------------------ atlas
def test_atlas_rows_and_figure_carry_the_shared_weights_share(albert_atlas_model):
    info = {"model": "tiny-albert", "family": "albert", "n_layers": 3}
    rows = model_rows(albert_atlas_model, info, n_resamples=50)
    shared = rows[rows["metric"].str.startswith("shared_context_share:")]
    assert set(shared["metric"].str.split(":").str[1]) == {*ZERO, "attn.k", "attn.v"}
    assert (shared["depth_fraction"] == 1.0).all() and (shared["value"] > 0).all()
    last = rows[rows["metric"].str.startswith("context_share:") & (rows["depth_fraction"] == 1.0)]
    assert (last.set_index("metric").loc[[f"context_share:{s}" for s in ZERO], "value"] == 0.0).all()
    other = rows.assign(model="tiny-bert")
    other = other[~other["metric"].str.startswith("shared_")]
    with gradflow_style("single"):
        fig = last_block_bars(pd.concat([rows, other]), "context_share", "share", "t", ["tiny-albert", "tiny-bert"])
        diamonds = [line for line in fig.axes[0].lines if line.get_gid() == "atlas:tiny-albert:shared"]
        assert len(diamonds) == 1 and len(diamonds[0].get_xdata()) == 8
        labels = [t.get_text() for t in fig.legends[0].get_texts()]
        assert "tiny-albert: shared weights, all applications (bar: the last)" in labels
        assert not [line for line in fig.axes[0].lines if (line.get_gid() or "").startswith("atlas:tiny-bert:shared")]
        plt.close(fig)


# ------------------------------------------------------------------------------ explorer
@pytest.mark.slow
def test_explorer_payload_states_the_shared_weights_share(albert_dir, tiny_mlm_dir):
    loaded = load_model(str(albert_dir))
    text = SAMPLE_LINES[0]
    view = channel_view(loaded, text, mask=[3, 7])
    payload = json.loads(json.dumps(view.payload(), allow_nan=False))
    sharing = payload["weight_sharing"]
    assert sharing["layers"] == [1, 2, 3]
    hand = _hand_total_shares(loaded.model, channel_batch(loaded, text, [3, 7]), {1, 2, 3})
    rows = {r["sublayer"]: r for r in sharing["sublayers"]}
    assert set(rows) == {*ZERO, "attn.k", "attn.v"}
    for name in ZERO:
        assert rows[name]["last_share"] == 0.0 and rows[name]["total_context_share"] > 0
        assert rows[name]["total_context_share"] == pytest.approx(hand[(name, "weight")], abs=1e-6)
    paragraph = next(p for p in payload["explanation"] if p.startswith("This model shares"))
    assert "per application" in paragraph and "Over all 3 applications" in paragraph
    twin = channel_view(loaded, text, mask=[3, 7], loss="all-positions").payload()  # no zero to qualify
    assert twin["weight_sharing"]["layers"] == [1, 2, 3]
    assert not any(p.startswith("This model shares") for p in twin["explanation"])
    bert = channel_view(load_model(str(tiny_mlm_dir)), text, mask=[3, 7]).payload()
    assert bert["weight_sharing"] is None and not any(p.startswith("This model shares") for p in bert["explanation"])
