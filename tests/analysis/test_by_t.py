"""gradflow.analysis.by_t: a masked-diffusion run's sequences selected by t, and what a run pools over t.

A tiny BERT recorded under ``--objective diffusion`` on a grid of t (``diffusion_run`` of the conftest: 24 sequences,
8 a value of t): a selection keeps exactly the sequences of
its value or bin (their rows in sequences.parquet, their t), a selection that keeps nothing names the run's t,
and the scope of a run says what its numbers pool.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from gradflow.analysis import RunError, load_run, role_ratios
from gradflow.analysis.by_t import TSelection, parse_t_selection, select_by_t, sublayers_selected, t_scope
from gradflow.schema import MASK_RATIOS_FILE
from synthetic_runs import write_run


@pytest.mark.parametrize("text, low, high", [("0.15", 0.15, 0.15), ("0.1,0.2", 0.1, 0.2), (" 0.5 , 1 ", 0.5, 1.0),
                                             ("1", 1.0, 1.0)], ids=["a value", "a bin", "spaces", "t = 1"])
def test_a_value_or_a_bin_is_parsed(text, low, high):
    selection = parse_t_selection(text)
    assert (selection.low, selection.high) == (low, high)


@pytest.mark.parametrize("text, named", [("0", "'0'"), ("1.5", "'1.5'"), ("x", "'x'"), ("0.2,0.1", "empty"),
                                         ("0.1,0.2,0.3", "a bin LOW,HIGH"), ("nan", "'nan'"), ("", "a bin LOW,HIGH")],
                         ids=["zero", "above one", "not a number", "reversed bin", "three values", "nan", "empty"])
def test_a_bad_selection_is_named(text, named):
    with pytest.raises(ValueError, match=named):
        parse_t_selection(text)


def test_contains_matches_a_grid_value_and_a_half_open_bin_closed_at_one():
    ratios = np.array([0.1, 0.15, 0.2, 0.15 + 1e-12, 0.9999, 1.0])
    assert TSelection(0.15, 0.15).contains(ratios).tolist() == [False, True, False, True, False, False]
    assert TSelection(0.1, 0.2).contains(ratios).tolist() == [True, True, False, True, False, False]
    assert TSelection(0.9, 1.0).contains(ratios).tolist() == [False, False, False, False, True, True]
    assert (TSelection(0.15, 0.15).describe(), TSelection(0.1, 0.2).describe(), TSelection(0.9, 1.0).describe()) == (
        "t = 0.15", "t in [0.1, 0.2)", "t in [0.9, 1]")


def test_a_selection_keeps_exactly_the_sequences_of_its_t(diffusion_run):
    run = load_run(diffusion_run)
    ratios = pd.read_parquet(diffusion_run / MASK_RATIOS_FILE)
    chosen = select_by_t(run, parse_t_selection("0.5"))
    members = set(ratios.loc[ratios["mask_ratio"] == 0.5, "sequence_index"])
    assert len(members) == 8
    assert set(chosen.sequences["sequence_index"]) == members
    assert (chosen.mask_ratios["mask_ratio"] == 0.5).all() and len(chosen.mask_ratios) == 8
    whole = run.sequences[run.sequences["sequence_index"].isin(members)]
    assert len(chosen.sequences) == len(whole)  # every row of those sequences, no other
    binned = select_by_t(run, parse_t_selection("0.4,0.9"))
    assert set(binned.sequences["sequence_index"]) == set(ratios.loc[ratios["mask_ratio"] >= 0.4, "sequence_index"])


def test_the_selected_ratio_is_the_ratio_of_those_sequences_alone(diffusion_run):
    """The context / loss ratio of a selected run, from its kept sequences' sums by hand (pooled by positions)."""
    run = load_run(diffusion_run)
    chosen = select_by_t(run, TSelection(0.2, 0.2))
    ratios = role_ratios(chosen, roles=("context",), n_resamples=50)
    seq = chosen.sequences[(chosen.sequences["point"] == "out") & (chosen.sequences["layer"] == 1)]
    context = seq[seq["role"] == "context"]
    loss = seq[seq["role"].isin(["masked", "random", "kept"])]
    expected = (context["grad_norm_sum"].sum() / context["n_positions"].sum()) / (
        loss["grad_norm_sum"].sum() / loss["n_positions"].sum())
    assert ratios.loc[ratios["layer"] == 1, "ratio"].item() == pytest.approx(expected, rel=1e-12)
    pooled = role_ratios(run, roles=("context",), n_resamples=50)
    assert pooled.loc[pooled["layer"] == 1, "ratio"].item() != pytest.approx(expected, rel=1e-3)


def test_a_selection_that_keeps_nothing_names_the_run_s_values(diffusion_run):
    with pytest.raises(RunError, match=r"no sequence has t = 0.15; its sequences have t in \{0.2, 0.5, 0.8\}"):
        select_by_t(load_run(diffusion_run), TSelection(0.15, 0.15))


def test_a_run_without_t_cannot_be_selected_and_has_no_scope(tmp_path):
    run = load_run(write_run(tmp_path / "mlm", num_layers=2, n_sequences=4))
    with pytest.raises(RunError, match="no mask_ratios.parquet"):
        select_by_t(run, TSelection(0.5, 0.5))
    assert t_scope(run) is None and t_scope(run, TSelection(0.5, 0.5)) is None


def test_the_scope_says_what_a_run_pools(diffusion_run):
    run = load_run(diffusion_run)
    assert t_scope(run) == "pooled over t 0.2\u20130.8"
    assert t_scope(run, TSelection(0.5, 0.5)) == "t = 0.5"
    assert t_scope(select_by_t(run, TSelection(0.5, 0.5))) == "t = 0.5"


def test_the_selected_sublayer_shares_are_those_of_the_kept_sequences(diffusion_run):
    """The last block's context share of a selected run, by hand from the kept sequences' rows of
    sublayer_sequences.parquet (magnitude sums); the whole run's sublayers.csv pools every t."""
    from gradflow.analysis import last_block_deficit

    run = load_run(diffusion_run)
    assert sublayers_selected(run)
    chosen = select_by_t(run, TSelection(0.2, 0.2))
    members = set(chosen.mask_ratios["sequence_index"])
    rows = pd.read_parquet(diffusion_run / "sublayer_sequences.parquet")
    rows = rows[rows["sequence_index"].isin(members) & (rows["param"] == "weight")]
    rows = rows[rows["layer"] == rows["layer"].max()]  # the last block (block i is layer i + 1)
    for sublayer in ("attn.k", "attn.v"):
        part = rows[rows["sublayer"] == sublayer]
        expected = part.loc[part["role"] == "context", "magnitude_sum"].sum() / part["magnitude_sum"].sum()
        got = last_block_deficit(chosen).set_index("sublayer").loc[sublayer, "share"]
        assert got == pytest.approx(expected, rel=1e-12)
        assert got != pytest.approx(last_block_deficit(run).set_index("sublayer").loc[sublayer, "share"], rel=1e-6)
    deficit = last_block_deficit(chosen).set_index("sublayer")
    assert deficit.loc["attn.q", "exact_zero"] and deficit.loc["attn.q", "share"] == 0.0


def test_the_scope_of_drawn_t_is_rounded(diffusion_run):
    run = load_run(diffusion_run)
    ratios = run.mask_ratios.assign(mask_ratio=np.linspace(0.0022318507950484716, 0.9993158844140422, 24))
    assert t_scope(replace(run, mask_ratios=ratios)) == "pooled over t 0.00223\u20130.999"
