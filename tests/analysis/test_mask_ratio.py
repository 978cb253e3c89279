"""gradflow.analysis.mask_ratio: the context / loss ratio per layer and masking ratio t of a masked-diffusion run.

A tiny BERT recorded under ``--objective diffusion`` on a grid of t: the table is recomputed by hand from
sequences.parquet and mask_ratios.parquet (point, CI and counts), the last block's output is an exact zero,
bins are the grid's values or equal-width bins of [0, 1], and a damaged mask_ratios.parquet is refused.
"""

from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pytest

from gradflow.analysis import RunError, bootstrap_ratio, load_run, mask_ratio_bins, ratio_by_mask_ratio
from gradflow.analysis.stats import bootstrap_sums, percentile_interval
from gradflow.roles import LOSS_ROLES
from gradflow.schema import ANALYSIS_COLUMNS, MASK_RATIOS_FILE, REPORT_TABLES
from synthetic_runs import write_run

GRID = (0.2, 0.5, 0.8)  # diffusion_run's grid (tests/conftest.py); checked by the first test
LAYERS = 2
N_RESAMPLES = 400


@pytest.fixture(scope="module")
def table(diffusion_run):
    return ratio_by_mask_ratio(load_run(diffusion_run), n_resamples=N_RESAMPLES, seed=0)


def _per_sequence(run_dir, members, layer):
    """Per-sequence (context sum, context count, loss sum, loss count) at block output ``layer``, by index."""
    seq = pd.read_parquet(run_dir / "sequences.parquet")
    seq = seq[(seq["point"] == "out") & (seq["layer"] == layer) & seq["sequence_index"].isin(members)]
    seq = seq.assign(group=np.where(seq["role"] == "context", "context",
                                    np.where(seq["role"].isin(LOSS_ROLES), "loss", "other")))
    sums = seq.pivot_table(index="sequence_index", columns="group", values=["grad_norm_sum", "n_positions"],
                           aggfunc="sum", fill_value=0).sort_index()
    return (sums[("grad_norm_sum", "context")].to_numpy(float), sums[("n_positions", "context")].to_numpy(float),
            sums[("grad_norm_sum", "loss")].to_numpy(float), sums[("n_positions", "loss")].to_numpy(float))


def test_run_reads_each_sequences_ratio(diffusion_run):
    run = load_run(diffusion_run)
    assert list(run.mask_ratios.columns) == ["sequence_index", "mask_ratio"]
    assert run.mask_ratios["sequence_index"].tolist() == list(range(24))
    assert run.mask_ratios["mask_ratio"].tolist() == list(GRID) * 8
    assert load_run(write_run(diffusion_run.parent / "mlm", num_layers=2, n_sequences=4)).mask_ratios is None


def test_one_bin_recomputed_by_hand(diffusion_run, table):
    """t = 0.5, layer 1: the pooled ratio, its bootstrap CI (the same resamples) and the counts, by hand."""
    ratios = pd.read_parquet(diffusion_run / MASK_RATIOS_FILE)
    members = ratios.loc[ratios["mask_ratio"] == 0.5, "sequence_index"]
    assert len(members) == 8
    c_sum, c_n, l_sum, l_n = _per_sequence(diffusion_run, members, layer=1)
    expected = (c_sum.sum() / c_n.sum()) / (l_sum.sum() / l_n.sum())
    point, low, high = bootstrap_ratio(c_sum, c_n, l_sum, l_n, n_resamples=N_RESAMPLES, seed=0)
    row = table[(table["layer"] == 1) & (table["t_mid"] == 0.5)].iloc[0]
    assert row["ratio"] == pytest.approx(expected, rel=1e-12) and point == pytest.approx(expected, rel=1e-12)
    assert row["ci_low"] == pytest.approx(low, rel=1e-9) and row["ci_high"] == pytest.approx(high, rel=1e-9)
    assert row["ci_low"] < row["ratio"] < row["ci_high"]
    assert row["context_mean"] == pytest.approx(c_sum.sum() / c_n.sum(), rel=1e-12)
    assert row["loss_mean"] == pytest.approx(l_sum.sum() / l_n.sum(), rel=1e-12)
    assert (row["n_context"], row["n_loss"], row["n_sequences"]) == (c_n.sum(), l_n.sum(), 8)
    assert (row["t_low"], row["t_high"], row["site"]) == (0.5, 0.5, "blocks.0.out")


def test_numerator_denominator_and_share_recomputed_by_hand(diffusion_run, table):
    """t = 0.5, layer 1: the context mean, the loss mean and the context share with their CIs, by hand from the
    same resamples of the bin's sequences (percentile intervals of bootstrap_sums with the table's seed)."""
    ratios = pd.read_parquet(diffusion_run / MASK_RATIOS_FILE)
    members = ratios.loc[ratios["mask_ratio"] == 0.5, "sequence_index"]
    c_sum, c_n, l_sum, l_n = _per_sequence(diffusion_run, members, layer=1)
    reps = bootstrap_sums(np.stack([c_sum, c_n, l_sum, l_n], axis=-1), n_resamples=N_RESAMPLES, seed=0)
    row = table[(table["layer"] == 1) & (table["t_mid"] == 0.5)].iloc[0]
    assert row["n_sequences"] == len(members) == 8  # every sequence of the bin has context and loss positions
    with np.errstate(invalid="ignore"):  # a resample without context positions has no context mean (NaN, left out)
        context_reps = reps[:, 0] / reps[:, 1]
    for column, point, replicates in (("context", c_sum.sum() / c_n.sum(), context_reps),
                                      ("loss", l_sum.sum() / l_n.sum(), reps[:, 2] / reps[:, 3]),
                                      ("share", c_sum.sum() / (c_sum.sum() + l_sum.sum()),
                                       reps[:, 0] / (reps[:, 0] + reps[:, 2]))):
        low, high = percentile_interval(replicates)
        value = row["context_share" if column == "share" else f"{column}_mean"]
        assert value == pytest.approx(point, rel=1e-12)
        assert row[f"{column}_ci_low"] == pytest.approx(low, rel=1e-9)
        assert row[f"{column}_ci_high"] == pytest.approx(high, rel=1e-9)
        assert row[f"{column}_ci_low"] < value < row[f"{column}_ci_high"]
    assert 0 < row["context_share"] < 1
    assert row["ratio"] == pytest.approx(row["context_mean"] / row["loss_mean"], rel=1e-12)


def test_the_last_block_is_an_exact_zero_at_every_t(table):
    assert tuple(table.columns) == ANALYSIS_COLUMNS["mask_ratio_profile"] == REPORT_TABLES["mask_ratio_profile"]
    assert len(table) == (LAYERS + 1) * len(GRID) and table["t_mid"].tolist() == list(GRID) * (LAYERS + 1)
    last = table[table["layer"] == LAYERS]
    assert last["exact_zero"].all() and (last["ratio"] == 0.0).all() and (last["context_mean"] == 0.0).all()
    assert (last["ci_low"] == 0.0).all() and (last["ci_high"] == 0.0).all() and (last["loss_mean"] > 0).all()
    assert (last["context_share"] == 0.0).all() and (last["share_ci_high"] == 0.0).all()
    assert (last["context_ci_high"] == 0.0).all()
    earlier = table[table["layer"] < LAYERS]
    assert not earlier["exact_zero"].any() and (earlier["ratio"] > 0).all() and (earlier["ci_low"] > 0).all()
    assert (table["n_sequences"] == 8).all()


def test_a_bin_keeps_its_sequences_without_context_in_its_loss_mean(diffusion_run, table):
    """t = 0.8 masks every token of the shortest sequences: they have no context position, but their bin has, so
    they stay: their loss positions are pooled into the bin's loss mean and its share."""
    ratios = pd.read_parquet(diffusion_run / MASK_RATIOS_FILE)
    members = ratios.loc[ratios["mask_ratio"] == 0.8, "sequence_index"]
    c_sum, c_n, l_sum, l_n = _per_sequence(diffusion_run, members, 0)
    assert (c_n == 0).any() and (c_n > 0).any() and (l_n > 0).all()  # the premise
    row = table[(table["layer"] == 0) & (table["t_mid"] == 0.8)].iloc[0]
    assert row["loss_mean"] == pytest.approx(l_sum.sum() / l_n.sum(), rel=1e-12)
    assert row["context_share"] == pytest.approx(c_sum.sum() / (c_sum.sum() + l_sum.sum()), rel=1e-12)


def test_edges_pool_several_ratios_into_one_bin(diffusion_run):
    """bins=[0, 0.5, 1]: t = 0.2 alone, then t = 0.5 and 0.8 pooled by positions over their 16 sequences."""
    table = ratio_by_mask_ratio(load_run(diffusion_run), bins=[0.0, 0.5, 1.0], n_resamples=50)
    assert table[["t_low", "t_high"]].drop_duplicates().values.tolist() == [[0.0, 0.5], [0.5, 1.0]]
    ratios = pd.read_parquet(diffusion_run / MASK_RATIOS_FILE)
    members = ratios.loc[ratios["mask_ratio"] >= 0.5, "sequence_index"]
    c_sum, c_n, l_sum, l_n = _per_sequence(diffusion_run, members, layer=0)
    row = table[(table["layer"] == 0) & (table["t_low"] == 0.5)].iloc[0]
    assert row["ratio"] == pytest.approx((c_sum.sum() / c_n.sum()) / (l_sum.sum() / l_n.sum()), rel=1e-12)
    assert (row["n_sequences"], row["t_mid"]) == (16, 0.75)


def test_a_bin_without_context_has_no_rows(diffusion_run, tmp_path):
    """t = 1 masks every token: no context position, so no ratio (the other bins keep theirs)."""
    run_dir = tmp_path / "run"
    shutil.copytree(diffusion_run, run_dir)
    ratios = pd.read_parquet(run_dir / MASK_RATIOS_FILE)
    ratios.assign(mask_ratio=ratios["mask_ratio"].replace(0.8, 1.0)).to_parquet(run_dir / MASK_RATIOS_FILE)
    seq = pd.read_parquet(run_dir / "sequences.parquet")
    at_one = ratios.loc[ratios["mask_ratio"] == 0.8, "sequence_index"]
    seq[~(seq["sequence_index"].isin(at_one) & (seq["role"] == "context"))].to_parquet(run_dir / "sequences.parquet")
    with pytest.warns(RuntimeWarning, match="disagrees"):  # channels.csv still counts the context rows taken out
        run = load_run(run_dir)
    table = ratio_by_mask_ratio(run, n_resamples=20)
    assert sorted(table["t_mid"].unique()) == [0.2, 0.5]


def test_bins_are_the_grid_or_equal_width_bins():
    index, low, high = mask_ratio_bins(np.array([0.5, 0.1, 0.5, 0.9]))
    assert index.tolist() == [1, 0, 1, 2] and low.tolist() == high.tolist() == [0.1, 0.5, 0.9]
    drawn = np.array([0.001, 0.05, 0.2, 0.21, 0.39, 0.4, 0.55, 0.61, 0.7, 0.79, 0.8, 0.95, 1.0])  # 13 values
    index, low, high = mask_ratio_bins(drawn)
    assert np.allclose(low, [0, 0.2, 0.4, 0.6, 0.8]) and np.allclose(high, [0.2, 0.4, 0.6, 0.8, 1.0])
    assert index.tolist() == [0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 4, 4, 4]  # [low, high), the last bin closed
    index, low, _ = mask_ratio_bins(drawn, bins=2)
    assert low.tolist() == [0.0, 0.5] and index.tolist() == [0] * 6 + [1] * 7
    index, _, _ = mask_ratio_bins(drawn, bins=[0.1, 0.5])
    assert index.tolist() == [-1, -1, 0, 0, 0, 0, -1, -1, -1, -1, -1, -1, -1]  # outside every bin: left out
    for bad in (0, [0.5, 0.2], [0.3]):
        with pytest.raises(ValueError, match="bins|edges"):
            mask_ratio_bins(drawn, bins=bad)


def test_a_run_without_mask_ratios_is_refused(tmp_path):
    run = load_run(write_run(tmp_path / "mlm", num_layers=2, n_sequences=4))
    with pytest.raises(RunError, match="no mask_ratios.parquet.*--objective diffusion"):
        ratio_by_mask_ratio(run)


def _damage(path, how):
    ratios = pd.read_parquet(path)
    if how == "bytes":
        path.write_bytes(b"PAR1 not a parquet file")
    elif how == "column":
        ratios.rename(columns={"mask_ratio": "t"}).to_parquet(path)
    elif how == "range":
        ratios.assign(mask_ratio=ratios["mask_ratio"].where(ratios.index != 3, 1.5)).to_parquet(path)
    elif how == "nan":
        ratios.assign(mask_ratio=ratios["mask_ratio"].where(ratios.index != 0, np.nan)).to_parquet(path)
    elif how == "text":
        ratios.assign(mask_ratio=ratios["mask_ratio"].astype(str) + "x").to_parquet(path)
    elif how == "twice":
        pd.concat([ratios, ratios.iloc[[5]]]).to_parquet(path)
    elif how == "missing":
        ratios.iloc[:-2].to_parquet(path)


@pytest.mark.parametrize("how, message", [
    ("bytes", r"Could not read .*mask_ratios.parquet.*damaged"),
    ("column", r"mask_ratios.parquet.* lacks the columns mask_ratio"),
    ("range", r"1 masking ratio is not in \(0, 1\] \(first: 1.5 at sequence 3\)"),
    ("nan", r"not in \(0, 1\] \(first: nan at sequence 0\)"),
    ("text", r"column 'mask_ratio' is not float64"),
    ("twice", r"sequence 5 has more than one masking ratio"),
    ("missing", r"has no masking ratio for 2 sequences of sequences.parquet \(first: 22\)"),
])
def test_a_damaged_mask_ratios_file_is_refused(diffusion_run, tmp_path, how, message):
    run_dir = tmp_path / "run"
    shutil.copytree(diffusion_run, run_dir)
    _damage(run_dir / MASK_RATIOS_FILE, how)
    with pytest.raises(RunError, match=message):
        load_run(run_dir)
