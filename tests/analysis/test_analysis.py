"""gradflow.analysis on synthetic run tables with known answers."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pandas as pd
import pytest

from gradflow import analysis as A
from gradflow import schema as S
from gradflow.analysis import RunError
from synthetic_runs import default_context_ratios, make_run_tables, write_run, write_tables

B = 300  # bootstrap resamples in tests: enough for the checks, light on CPU


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> A.Run:
    return A.load_run(write_run(tmp_path_factory.mktemp("run") / "a", num_layers=4, n_sequences=60))


# ---------------------------------------------------------------------------------------------- loading

def test_load_run_reads_all_tables(run):
    assert run.complete and run.num_layers == 4 and run.tokenizer_hash == "tok-a"
    assert set(A.CHANNEL_COLUMNS) <= set(run.channels.columns)
    assert set(A.SEQUENCE_COLUMNS) <= set(run.sequences.columns)
    assert run.sequences["sequence_index"].nunique() == 60


def test_missing_run_dir_is_run_error(tmp_path):
    with pytest.raises(RunError, match="does not exist"):
        A.load_run(tmp_path / "nope")


def test_missing_file_is_named(tmp_path):
    root = write_run(tmp_path / "r", num_layers=2, n_sequences=5)
    (root / "sequences.parquet").unlink()
    with pytest.raises(RunError, match="lacks sequences.parquet"):
        A.load_run(root)


def test_missing_column_is_named(tmp_path):
    tables = make_run_tables(num_layers=2, n_sequences=5)
    tables["channels"] = tables["channels"].drop(columns=["grad_norm_q95"])
    with pytest.raises(RunError, match="grad_norm_q95"):
        A.load_run(write_tables(tmp_path / "r", tables))


def test_bad_meta_and_unknown_role(tmp_path):
    root = write_run(tmp_path / "r", num_layers=2, n_sequences=5)
    meta = json.loads((root / "meta.json").read_text())
    del meta["tokenizer"]
    (root / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(RunError, match="tokenizer"):
        A.load_run(root)
    tables = make_run_tables(num_layers=2, n_sequences=5)
    tables["sublayers"].loc[0, "role"] = "bogus"
    with pytest.raises(RunError, match="bogus"):
        A.load_run(write_tables(tmp_path / "s", tables))


# ---------------------------------------------------------------------------------------------- statistics

def test_bootstrap_ratio_exact_point_and_degenerate_ci():
    # every sequence: numerator mean 2, denominator mean 4 -> ratio 0.5 in every resample
    n = np.array([3.0, 5.0, 2.0, 7.0])
    point, low, high = A.bootstrap_ratio(2 * n, n, 4 * n[::-1], n[::-1], n_resamples=50, seed=1)
    assert point == pytest.approx(0.5) and low == pytest.approx(0.5) and high == pytest.approx(0.5)


def test_bootstrap_ratio_is_ratio_of_pooled_means():
    num_s, num_n = np.array([1.0, 9.0]), np.array([1.0, 3.0])     # pooled mean 10 / 4
    den_s, den_n = np.array([2.0, 2.0]), np.array([2.0, 2.0])     # pooled mean 1
    point, low, high = A.bootstrap_ratio(num_s, num_n, den_s, den_n, n_resamples=200, seed=0)
    assert point == pytest.approx(2.5)
    assert low <= point <= high


def test_one_sequence_has_no_interval_not_a_zero_width_one():
    point, low, high = A.bootstrap_ratio(np.array([2.0]), np.array([1.0]), np.array([4.0]), np.array([1.0]),
                                         n_resamples=50, seed=0)
    assert point == pytest.approx(0.5) and np.isnan(low) and np.isnan(high)
    assert A.bootstrap_sums(np.ones((1, 3)), 20).shape == (20, 3)


def test_bootstrap_is_seeded():
    x = np.random.default_rng(0).random((30, 3))
    assert np.array_equal(A.bootstrap_sums(x, 40, seed=3), A.bootstrap_sums(x, 40, seed=3))
    assert not np.array_equal(A.bootstrap_sums(x, 40, seed=3), A.bootstrap_sums(x, 40, seed=4))


def test_bootstrap_ci_covers_truth_in_most_repetitions():
    """Seeded simulation: true ratio 0.5; the 95% CI should cover it in most repetitions."""
    rng = np.random.default_rng(12345)
    covered, reps = 0, 40
    for rep in range(reps):
        n_seq = 50
        n_ctx = rng.integers(10, 30, n_seq)
        n_loss = rng.integers(1, 6, n_seq)
        effect = rng.lognormal(0, 0.3, n_seq)
        ctx = np.array([(0.5 * e * rng.lognormal(0, 0.5, k)).sum() for e, k in zip(effect, n_ctx)])
        loss = np.array([(1.0 * e * rng.lognormal(0, 0.5, k)).sum() for e, k in zip(effect, n_loss)])
        _, low, high = A.bootstrap_ratio(ctx, n_ctx, loss, n_loss, n_resamples=400, seed=rep)
        covered += low <= 0.5 <= high
    assert covered / reps >= 0.85


def test_holm_known_values():
    adj = A.holm([0.01, 0.04, 0.03, 0.005])
    assert np.allclose(adj, [0.03, 0.06, 0.06, 0.02])
    with_nan = A.holm([0.01, np.nan, 0.02])
    assert np.isnan(with_nan[1]) and np.allclose(with_nan[[0, 2]], [0.02, 0.02])
    assert A.holm([0.9, 0.8]).max() <= 1.0


def test_rank_biserial_and_mann_whitney():
    x, y = np.arange(10, 20.0), np.arange(0, 10.0)
    u, p = A.mann_whitney(x, y)
    assert A.rank_biserial(u, 10, 10) == pytest.approx(1.0)
    assert p < 1e-3
    assert A.mann_whitney(np.ones(5), np.ones(4)) == (10.0, 1.0)
    assert np.isnan(A.mann_whitney(np.array([]), y)[1])


def test_mann_whitney_calibrated_on_equal_samples():
    rng = np.random.default_rng(7)
    small = sum(A.mann_whitney(rng.lognormal(0, 1, 40), rng.lognormal(0, 1, 40))[1] < 0.05 for _ in range(60))
    assert small <= 8  # about 5% expected


# ---------------------------------------------------------------------------------------------- channel metrics

def test_context_ratio_matches_direct_computation(run):
    got = A.context_ratio(run, n_resamples=B).set_index("layer")
    seq = run.sequences[run.sequences["point"] == "out"]
    for layer in range(run.num_layers + 1):
        d = seq[seq["layer"] == layer]
        ctx = d[d["role"] == "context"]
        loss = d[d["role"].isin(["masked", "random", "kept"])]
        expected = (ctx["grad_norm_sum"].sum() / ctx["n_positions"].sum()) / (
            loss["grad_norm_sum"].sum() / loss["n_positions"].sum())
        assert got.loc[layer, "ratio"] == pytest.approx(expected)
        assert got.loc[layer, "ci_low"] <= got.loc[layer, "ratio"] <= got.loc[layer, "ci_high"]
    assert (got["reference"] == "loss").all()


def test_context_ratio_near_truth_and_zero_in_last_block(tmp_path):
    r = A.load_run(write_run(tmp_path / "big", num_layers=4, n_sequences=150, seed=3))
    got = A.context_ratio(r, n_resamples=B).set_index("layer")
    truth = default_context_ratios(4)
    assert np.allclose(got["ratio"].to_numpy()[:-1], truth[:-1], rtol=0.12)
    assert (got["ci_low"].to_numpy()[:-1] < truth[:-1] * 1.12).all()
    assert got.loc[4, "ratio"] == 0 and got.loc[4, "ci_low"] == 0 and got.loc[4, "ci_high"] == 0


def test_role_ratios_masked_near_one_and_columns(run):
    rat = A.role_ratios(run, n_resamples=B)
    assert tuple(rat.columns) == S.ANALYSIS_COLUMNS["role_ratios"]
    assert set(rat["role"]) == {"masked", "random", "kept", "context", "special"}
    masked = rat[rat["role"] == "masked"]
    assert np.allclose(masked["ratio"], 1.0, atol=0.15)
    special = rat[rat["role"] == "special"]
    assert np.allclose(special["ratio"], 0.3, rtol=0.25)


def test_role_profile_includes_pooled_loss(run):
    prof = A.role_profile(run, n_resamples=B)
    assert {"loss", "context", "masked", "pad"} <= set(prof["role"])
    at0 = prof[prof["layer"] == 0].set_index("role")
    n_loss = sum(at0.loc[r, "n_positions"] for r in ("masked", "random", "kept"))
    assert at0.loc["loss", "n_positions"] == n_loss
    assert at0.loc["pad", "grad_norm_mean"] == 0 and at0.loc["pad", "zero_fraction"] == 1
    assert (prof["ci_low"] <= prof["grad_norm_mean"] + 1e-12).all()


def test_layer_tests_detect_known_difference(run):
    tests = A.layer_tests(run)
    assert len(tests) == run.num_layers + 1
    deep = tests[tests["layer"] >= 2]
    assert (deep["p_holm"] < 1e-3).all() and (deep["rank_biserial"] < -0.5).all()
    assert (tests["p_holm"] >= tests["p_value"]).all()
    assert tests.iloc[-1]["rank_biserial"] == pytest.approx(-1.0)  # context is exactly 0 in the last block


def test_layer_tests_not_significant_on_known_equal(tmp_path):
    r = A.load_run(write_run(tmp_path / "eq", num_layers=3, n_sequences=50, noise=0.05,
                             context_ratios=[1.0] * 4, loss="all-positions"))
    tests = A.layer_tests(r)
    assert (tests["p_value"] > 0.05).all()
    assert (tests["rank_biserial"].abs() < 0.3).all()


def test_channel_quantiles(run):
    q = A.channel_quantiles(run)
    assert tuple(q.columns) == S.ANALYSIS_COLUMNS["channel_quantiles"]
    assert (q["q05"] <= q["median"]).all() and (q["median"] <= q["q95"]).all()


# ---------------------------------------------------------------------------------------------- sublayers

def test_sublayer_shares_known_values(run):
    shares = A.sublayer_shares(run)
    ctx = shares[shares["role"] == "context"]
    early = ctx[ctx["layer"] < 4]
    assert np.allclose(early["share"], 0.6) and np.allclose(early["coverage"], 1.0)
    total = shares[shares["role"] != "loss"].groupby(["layer", "sublayer"])["share"].sum()
    assert np.allclose(total, 1.0)
    loss = shares[shares["role"] == "loss"].set_index(["layer", "sublayer"])["share"]
    parts = shares[shares["role"].isin(["masked", "random", "kept"])].groupby(["layer", "sublayer"])["share"].sum()
    assert np.allclose(loss.sort_index(), parts.sort_index())


def test_context_share_and_coverage_zero_after_mixing_in_last_block(run):
    cs = A.context_share(run)
    last = cs[cs["layer"] == 4].set_index("sublayer")
    for sub in ("attn.q", "attn.out", "ffn.in", "ffn.out", "ffn.norm"):
        assert last.loc[sub, "share"] == 0 and last.loc[sub, "coverage"] == 0
    assert last.loc["attn.k", "share"] == pytest.approx(0.6)


def test_last_block_deficit(run):
    d = A.last_block_deficit(run).set_index("sublayer")
    assert (d["layer"] == 4).all() and (d["n_earlier"] == 3).all()
    assert d.loc["attn.q", "ratio_to_earlier"] == 0 and bool(d.loc["attn.q", "exact_zero"])
    assert d.loc["attn.v", "ratio_to_earlier"] == pytest.approx(1.0) and not bool(d.loc["attn.v", "exact_zero"])
    assert d.loc["ffn.in", "earlier_mean"] == pytest.approx(0.6)
    assert list(d.index[:3]) == ["attn.q", "attn.k", "attn.v"]


def test_every_analysis_table_has_the_schema_columns(run):
    tables = {"role_profile": A.role_profile(run, n_resamples=20), "role_ratios": A.role_ratios(run, n_resamples=20),
              "layer_tests": A.layer_tests(run), "sublayer_shares": A.sublayer_shares(run),
              "last_block": A.last_block_deficit(run), "channel_quantiles": A.channel_quantiles(run),
              "context_share": A.context_share(run)}
    expected = {**S.ANALYSIS_COLUMNS, "context_share": S.ANALYSIS_COLUMNS["sublayer_shares"]}
    for name, frame in tables.items():
        assert tuple(frame.columns) == expected[name], name
        assert len(frame) > 0, name
    # a test with no sequences of either role is empty, with the columns all the same (was: no columns)
    empty = A.layer_tests(run, role="relpos", against="relpos")
    assert empty.empty and tuple(empty.columns) == S.ANALYSIS_COLUMNS["layer_tests"]


def test_relpos_role_is_accepted(tmp_path):
    r = A.load_run(write_run(tmp_path / "rel", num_layers=2, n_sequences=6, relpos=True))
    shares = A.sublayer_shares(r)
    assert "relpos" in set(shares["role"])
    total = shares[shares["role"] != "loss"].groupby(["layer", "sublayer"])["share"].sum()
    assert np.allclose(total, 1.0)


def test_inconsistent_tables_warn(tmp_path):
    tables = make_run_tables(num_layers=2, n_sequences=5)
    tables["channels"]["grad_norm_mean"] *= 2
    with pytest.warns(RuntimeWarning, match="disagrees"):
        A.load_run(write_tables(tmp_path / "r", tables))


# ---------------------------------------------------------------------------------------------- comparison

def test_compare_identical_runs_gives_zero_difference(tmp_path):
    a = A.load_run(write_run(tmp_path / "a", num_layers=3, n_sequences=30))
    b = A.load_run(write_run(tmp_path / "b", num_layers=3, n_sequences=30))
    comp = A.compare_runs([a, b], ["a", "b"], n_resamples=B)
    d = comp.ratio_differences
    assert d["paired"].all() and set(d["label"]) == {"b"} and set(d["baseline"]) == {"a"}
    assert np.allclose(d["difference"], 0) and np.allclose(d["ci_low"], 0) and np.allclose(d["ci_high"], 0)
    assert np.allclose(comp.shares["share_difference"], 0)


def test_comparison_tables_have_the_schema_columns(tmp_path):
    a = A.load_run(write_run(tmp_path / "a", num_layers=2, n_sequences=8))
    b = A.load_run(write_run(tmp_path / "b", num_layers=2, n_sequences=8, seed=3))
    comp = A.compare_runs([a, b], ["a", "b"], n_resamples=20)
    fields = {"layer_tests": "tests"}
    for name, columns in S.COMPARISON_TABLES.items():
        if name != "context_pressure":  # drawn by gradflow.figures.pressure, not a Comparison field
            frame = getattr(comp, fields.get(name, name))
            assert tuple(frame.columns) == columns and len(frame) > 0, name


def test_compare_detects_known_difference(tmp_path):
    truth = default_context_ratios(3)
    shifted = truth + np.r_[0.3, 0.3, 0.3, 0.0]
    a = A.load_run(write_run(tmp_path / "a", num_layers=3, n_sequences=60, seed=1))
    b = A.load_run(write_run(tmp_path / "b", num_layers=3, n_sequences=60, seed=2, context_ratios=shifted))
    comp = A.compare_runs([a, b], ["base", "shifted"], n_resamples=B)
    d = comp.ratio_differences[comp.ratio_differences["role"] == "context"].set_index("layer")
    for layer in (0, 1, 2):
        assert d.loc[layer, "ci_low"] > 0.1
        assert d.loc[layer, "ci_low"] <= d.loc[layer, "difference"] <= d.loc[layer, "ci_high"]
    assert set(comp.ratios["label"]) == {"base", "shifted"}
    assert {"label", "relative_depth"} <= set(comp.profiles.columns)
    assert set(comp.last_block["label"]) == {"base", "shifted"}


def test_compare_all_positions_loss_lifts_last_block(tmp_path):
    a = A.load_run(write_run(tmp_path / "a", num_layers=3, n_sequences=30))
    b = A.load_run(write_run(tmp_path / "b", num_layers=3, n_sequences=30, loss="all-positions"))
    comp = A.compare_runs([a, b], ["mlm", "all"], n_resamples=B)
    last = comp.last_block.set_index(["label", "sublayer"])
    assert last.loc[("all", "attn.q"), "share_difference"] == pytest.approx(0.6)


def test_compare_rejects_different_tokenizers_and_bad_labels(tmp_path):
    a = A.load_run(write_run(tmp_path / "a", num_layers=2, n_sequences=5))
    b = A.load_run(write_run(tmp_path / "b", num_layers=2, n_sequences=5, tokenizer_hash="tok-b"))
    with pytest.raises(RunError, match="different tokenizers"):
        A.compare_runs([a, b], n_resamples=10)
    with pytest.raises(RunError, match="labels"):
        A.compare_runs([a, a], ["x"], n_resamples=10)
    with pytest.raises(RunError, match="unique"):
        A.compare_runs([a, a], ["x", "x"], n_resamples=10)


def test_no_warnings_on_clean_run(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = A.load_run(write_run(tmp_path / "c", num_layers=2, n_sequences=8))
        A.role_ratios(r, n_resamples=20)
        A.layer_tests(r)
        A.last_block_deficit(r)
        assert isinstance(A.sublayer_shares(r, param=None), pd.DataFrame)
