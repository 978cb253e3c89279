"""gradflow.analysis.mask_ratio's sequence selection (issue 59, point 3): bins of t decided by meta.json, and the
sequences left out of the by-t table counted by reason.

Synthetic masked-diffusion runs (``synthetic_runs.write_run(mask_ratios=...)``): each sequence's inner tokens are
masked with probability t, none random or kept; a sequence that drew no masked token has an all-zero gradient.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from gradflow.analysis import load_run, mask_ratio_bins, ratio_by_mask_ratio
from gradflow.analysis.mask_ratio import (
    DEFAULT_BINS,
    LEFT_OUT_REASONS,
    MAX_GRID_VALUES,
    mask_ratio_drawn,
    mask_ratio_selection,
)
from gradflow.roles import LOSS_ROLES
from synthetic_runs import write_run

DRAWN = (0.05, 0.15, 0.3, 0.45, 0.5, 0.62, 0.7, 0.85, 0.9, 0.95)
"""Ten t drawn per sequence: fewer than MAX_GRID_VALUES distinct values, and no sequence without a loss position."""


def _meta(path):
    return json.loads((path / "meta.json").read_text())


def _rewrite_meta(path, change):
    meta = _meta(path)
    change(meta["masking"])
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("masking, drawn", [
    ({"policy": "diffusion", "t": "uniform", "ratio": None, "ratios": []}, True),
    ({"policy": "diffusion", "t": "grid", "ratio": None, "ratios": [0.1, 0.5]}, False),
    ({"policy": "diffusion", "t": "fixed", "ratio": 0.3, "ratios": []}, False),
    ({"policy": "diffusion", "ratios": None}, True),
    ({"policy": "diffusion", "ratios": [0.2, 0.8]}, False),
    ({"policy": "diffusion", "ratio": 0.3}, None),
    ({"policy": "diffusion"}, None),
    ({"policy": "bert", "rate": 0.15}, None),
], ids=["t uniform is drawn", "a grid is not", "a fixed t is not", "ratios null is drawn", "a ratios list is a grid",
        "no ratios key: not known", "an older run: not known", "not diffusion: not known"])
def test_meta_json_says_whether_t_was_drawn(masking, drawn):
    assert mask_ratio_drawn({"masking": masking}) is drawn
    assert mask_ratio_drawn({}) is None


def test_a_drawn_run_with_few_sequences_gets_equal_width_bins(tmp_path):
    """Ten drawn t (at most MAX_GRID_VALUES distinct) were binned a bin per value and called a grid; now the five
    equal-width bins of [0, 1], as for any drawn run."""
    assert len(set(DRAWN)) <= MAX_GRID_VALUES
    run = load_run(write_run(tmp_path / "drawn", num_layers=2, n_sequences=10, mask_ratios=DRAWN))
    selection = mask_ratio_selection(run)
    assert (selection.scheme, selection.drawn) == ("equal", True)
    assert np.allclose(selection.lows, np.linspace(0, 0.8, DEFAULT_BINS))
    assert np.allclose(selection.highs, np.linspace(0.2, 1, DEFAULT_BINS))
    assert selection.members == ((0, 1), (2,), (3, 4), (5, 6), (7, 8, 9)) and selection.left_out == ()
    table = ratio_by_mask_ratio(run, n_resamples=20)
    assert sorted(table["t_low"].unique()) == pytest.approx([0, 0.2, 0.4, 0.6, 0.8])
    assert (table["t_low"] < table["t_high"]).all()
    assert ratio_by_mask_ratio(run, bins=2, n_resamples=20)["t_low"].unique().tolist() == [0.0, 0.5]  # overrides


def test_a_grid_run_is_binned_by_its_values_however_many(tmp_path):
    grid = [round(0.05 * (k + 1), 2) for k in range(14)]  # 14 values: more than MAX_GRID_VALUES
    assert len(grid) > MAX_GRID_VALUES
    run = load_run(write_run(tmp_path / "grid", num_layers=2, n_sequences=28, mask_ratios=grid * 2, t_drawn=False))
    selection = mask_ratio_selection(run)
    assert (selection.scheme, selection.drawn) == ("values", False)
    assert list(selection.lows) == list(selection.highs) == grid
    assert all(len(m) == 2 for m in selection.members)
    edges = mask_ratio_selection(run, bins=[0.0, 0.5, 1.0])
    assert edges.scheme == "edges" and edges.lows == (0.0, 0.5)


def test_an_older_run_keeps_the_count_rule(tmp_path):
    """meta.json without ``t`` and ``ratios``: at most MAX_GRID_VALUES distinct t are a bin each, as before."""
    path = write_run(tmp_path / "old", num_layers=2, n_sequences=10, mask_ratios=DRAWN)
    _rewrite_meta(path, lambda masking: [masking.pop(k) for k in ("t", "ratios", "ratio")])
    selection = mask_ratio_selection(load_run(path))
    assert (selection.scheme, selection.drawn) == ("values", None)
    assert list(selection.lows) == sorted(DRAWN)
    index, low, _ = mask_ratio_bins(np.array(DRAWN), drawn=None)
    assert low.tolist() == sorted(DRAWN) and index.tolist() == list(range(10))
    index, low, high = mask_ratio_bins(np.array(DRAWN), drawn=True)
    assert np.allclose(low, [0, 0.2, 0.4, 0.6, 0.8]) and index.tolist() == [0, 0, 1, 2, 2, 3, 3, 4, 4, 4]
    index, low, high = mask_ratio_bins(np.linspace(0.01, 0.99, 20), drawn=False)
    assert low.size == 20 and (low == high).all()


def _has(run_dir, roles):
    seq = pd.read_parquet(run_dir / "sequences.parquet")
    seq = seq[(seq["point"] == "out") & seq["role"].isin(roles) & (seq["n_positions"] > 0)]
    return set(seq["sequence_index"])


def test_sequences_without_loss_are_left_out_and_counted(tmp_path):
    """t = 0.001 on a short sequence draws no masked token (no loss position; an all-zero gradient that would pull
    its bin's context mean down): left out, by reason. t = 1 masks every token (no context position) but its bin
    [0.8, 1] has context from t = 0.85: it stays, its loss positions pooled into the bin's loss mean."""
    ratios = (0.001, 0.12, 0.18, 0.3, 0.35, 0.5, 0.55, 0.7, 0.75, 0.85, 1.0)
    path = write_run(tmp_path / "run", num_layers=2, n_sequences=len(ratios), seq_len=16, mask_ratios=ratios)
    assert 0 not in _has(path, LOSS_ROLES) and 10 not in _has(path, ("context",))  # the premises
    assert set(range(1, 10)) <= _has(path, LOSS_ROLES) & _has(path, ("context",))
    run = load_run(path)
    selection = mask_ratio_selection(run)
    assert selection.left_out == (("no_loss", 1),) and selection.n_left_out == 1
    assert selection.n_sequences == 11 and list(LEFT_OUT_REASONS) == ["outside", "no_loss", "no_context"]
    assert selection.members == ((1, 2), (3, 4), (5, 6), (7, 8), (9, 10))
    table = ratio_by_mask_ratio(run, n_resamples=20)
    first = table[(table["layer"] == 0) & (table["t_low"] == 0)].iloc[0]
    assert first["n_sequences"] == 2  # sequence 0 is not in its bin
    kept = run.sequences[run.sequences["sequence_index"].isin([1, 2]) & (run.sequences["point"] == "out")
                         & (run.sequences["layer"] == 0)]
    context = kept[kept["role"] == "context"]
    loss = kept[kept["role"].isin(LOSS_ROLES)]
    expected = (context["grad_norm_sum"].sum() / context["n_positions"].sum()) / (
        loss["grad_norm_sum"].sum() / loss["n_positions"].sum())
    assert first["ratio"] == pytest.approx(expected, rel=1e-12)
    last = table[np.isclose(table["t_low"], 0.8) & (table["layer"] == 0)].iloc[0]
    assert last["n_sequences"] == 2  # t = 1 stays in [0.8, 1]: the bin has context from t = 0.85
    both = run.sequences[run.sequences["sequence_index"].isin([9, 10]) & (run.sequences["point"] == "out")
                         & (run.sequences["layer"] == 0)]
    loss_both = both[both["role"].isin(LOSS_ROLES)]
    assert last["loss_mean"] == pytest.approx(loss_both["grad_norm_sum"].sum() / loss_both["n_positions"].sum(),
                                              rel=1e-12)
    assert last["n_context"] == both.loc[both["role"] == "context", "n_positions"].sum()


def test_a_bin_without_any_context_position_is_counted_as_left_out(tmp_path):
    """Edges [0, 0.95, 1]: the last bin holds t = 1 alone, which masks every token: no ratio there, so its sequence
    is left out with that reason, never silently."""
    ratios = (0.3, 0.35, 0.6, 0.65, 1.0)
    path = write_run(tmp_path / "run", num_layers=2, n_sequences=5, seq_len=12, mask_ratios=ratios)
    selection = mask_ratio_selection(load_run(path), bins=[0.0, 0.95, 1.0])
    assert selection.left_out == (("no_context", 1),)
    assert selection.members == ((0, 1, 2, 3), ())
    table = ratio_by_mask_ratio(load_run(path), bins=[0.0, 0.95, 1.0], n_resamples=20)
    assert table["t_low"].unique().tolist() == [0.0]


def test_a_sequence_outside_every_bin_is_counted_first(tmp_path):
    ratios = (0.001, 0.3, 0.35, 0.6, 0.65, 1.0)
    path = write_run(tmp_path / "run", num_layers=2, n_sequences=6, seq_len=12, mask_ratios=ratios)
    selection = mask_ratio_selection(load_run(path), bins=[0.2, 0.5, 0.7])
    assert selection.left_out == (("outside", 2),)  # t = 0.001 and t = 1: outside before their other reasons
    assert selection.members == ((1, 2), (3, 4))
