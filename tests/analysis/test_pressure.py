"""Counterfactual context pressure (issue 14, part 2): the per-sequence sublayer table, the metric, its report.

Tiny random BERTs (2 blocks, hidden 32) recorded on the tiny corpus; the acceptance test trains one
with the MLM loss, measures its last block's context pressure under the all-positions loss, trains
it a few steps on every position and measures again.
"""

from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from gradflow import schema as S
from gradflow.analysis import context_pressure, load_run, read_sublayer_sequences
from gradflow.errors import RunError, UsageError
from gradflow.roles import LOSS_ROLES
from gradflow.runs.record import RecordConfig, record_corpus

KEYS = ["layer", "sublayer", "param", "role"]


def _record(out, model, texts, loss, loaded=None, **kwargs):
    options = dict(max_length=24, batch_size=8, quiet=True)
    config = RecordConfig(out=str(out), model=str(model), texts=str(texts), loss=loss, **{**options, **kwargs})
    record_corpus(config, loaded=loaded)
    return load_run(out)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: on a busy 2-core machine a second torch thread only adds synchronisation (10-40x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(one_thread, tmp_path_factory, tiny_mlm_dir, tiny_corpus):
    root = tmp_path_factory.mktemp("pressure")
    return {loss: _record(root / loss, tiny_mlm_dir, tiny_corpus, loss, limit=24) for loss in ("mlm", "all-positions")}


def test_table_follows_schema_and_sums_to_sublayers_csv(runs):
    for run in runs.values():
        path = run.path / S.SUBLAYER_SEQUENCES_FILE
        assert pq.read_schema(path).remove_metadata().equals(S.arrow_schema(S.SUBLAYER_SEQUENCE_DTYPES))
        table = read_sublayer_sequences(run, param=None)
        assert set(table["param"]) == {"weight", "bias"} and "pad" not in set(table["role"])
        assert table["sequence_index"].nunique() == run.sequences["sequence_index"].nunique()
        summed = table.groupby(KEYS, as_index=False)[["n_positions", "magnitude_sum"]].sum()
        csv = run.sublayers[run.sublayers["role"] != "pad"]
        joined = csv.merge(summed, on=KEYS, how="outer", suffixes=("", "_seq"), validate="one_to_one")
        assert not joined.isna().any().any()
        assert (joined["n_positions"] == joined["n_positions_seq"]).all()
        # sublayers.csv sums each batch in float32 (kept byte-identical); the table sums in float64
        np.testing.assert_allclose(joined["magnitude_sum_seq"], joined["magnitude_sum"], rtol=2e-6, atol=1e-30)


def test_metric_equals_hand_computation(runs):
    run = runs["all-positions"]
    got = context_pressure(run, n_resamples=50).set_index(["layer", "sublayer"])
    table = pd.read_parquet(run.path / S.SUBLAYER_SEQUENCES_FILE)
    table = table[table["param"] == "weight"]
    group = np.where(table["role"] == "context", "context", np.where(table["role"].isin(LOSS_ROLES), "loss", ""))
    sums = table.assign(group=group).query("group != ''").groupby(["layer", "sublayer", "group"])[
        ["magnitude_sum", "n_positions"]].sum()
    per_position = (sums["magnitude_sum"] / sums["n_positions"]).unstack("group")
    pressure = per_position["context"] / per_position["loss"]
    assert len(got) == len(pressure) == 16  # 2 blocks x 8 BERT sublayers
    np.testing.assert_allclose(got.loc[pressure.index, "pressure"], pressure, rtol=1e-12)
    np.testing.assert_allclose(got.loc[pressure.index, "context_per_position"], per_position["context"], rtol=1e-12)
    counts = sums["n_positions"].unstack("group")
    assert (got.loc[counts.index, "n_context"] == counts["context"]).all()
    assert (got.loc[counts.index, "n_loss"] == counts["loss"]).all()
    for sub in ("attn.q", "ffn.out"):
        assert got.loc[(2, sub), "last_block"] and not got.loc[(1, sub), "last_block"]
        assert got.loc[(2, sub), "earlier_mean"] == pytest.approx(pressure[(1, sub)], rel=1e-12)
        assert got.loc[(2, sub), "vs_earlier"] == pytest.approx(pressure[(2, sub)] / pressure[(1, sub)], rel=1e-12)
        assert np.isnan(got.loc[(1, sub), "vs_earlier"])
    assert tuple(context_pressure(run, n_resamples=10).columns) == S.PRESSURE_COLUMNS


def test_mlm_loss_gives_exactly_zero_last_block_context_pressure(runs):
    run = runs["mlm"]
    got = context_pressure(run, n_resamples=100)
    last = got[got["last_block"]].set_index("sublayer")
    after = list(run.meta["after_mixing_sublayers"])
    assert set(after) == {"attn.q", "attn.out", "attn.norm", "ffn.in", "ffn.out", "ffn.norm"}
    assert (last.loc[after, ["pressure", "ci_low", "ci_high", "context_per_position", "vs_earlier"]] == 0.0).all().all()
    assert (last.loc[["attn.k", "attn.v"], "pressure"] > 0).all()  # context keys and values still feed loss positions
    assert (got.loc[~got["last_block"], "pressure"] > 0).all()


def test_cis_bracket_the_point_estimate_and_are_seeded(runs):
    for run in runs.values():
        got = context_pressure(run, n_resamples=300, seed=3)
        for value, low, high in (("pressure", "ci_low", "ci_high"), ("vs_earlier", "vs_earlier_ci_low",
                                                                        "vs_earlier_ci_high")):
            ok = got[value].notna()
            assert ok.any()
            assert (got.loc[ok, low] <= got.loc[ok, value]).all() and (got.loc[ok, value] <= got.loc[ok, high]).all()
        pd.testing.assert_frame_equal(got, context_pressure(run, n_resamples=300, seed=3))
    wide = context_pressure(runs["all-positions"], n_resamples=300, confidence=0.99)
    narrow = context_pressure(runs["all-positions"], n_resamples=300, confidence=0.5)
    assert ((wide["ci_high"] - wide["ci_low"]) >= (narrow["ci_high"] - narrow["ci_low"])).all()


def test_bad_inputs_raise_clear_errors(runs, tmp_path, tiny_mlm_dir, tiny_corpus):
    run = runs["all-positions"]
    with pytest.raises(UsageError, match="n_resamples"):
        context_pressure(run, n_resamples=0)
    with pytest.raises(UsageError, match="confidence"):
        context_pressure(run, confidence=1.0)
    with pytest.raises(UsageError, match="param"):
        context_pressure(run, param="gain")
    record_corpus(RecordConfig(out=str(tmp_path / "norms"), model=str(tiny_mlm_dir), texts=str(tiny_corpus),
                               loss="all-positions", sublayers=False, limit=4, max_length=24, quiet=True))
    assert not (tmp_path / "norms" / S.SUBLAYER_SEQUENCES_FILE).exists()  # --norms-only writes no such table
    older = tmp_path / "older"
    shutil.copytree(run.path, older)
    (older / S.SUBLAYER_SEQUENCES_FILE).unlink()
    with pytest.raises(RunError, match="no sublayer_sequences.parquet.*--loss all-positions"):
        context_pressure(load_run(older))
    damaged = tmp_path / "damaged"
    shutil.copytree(run.path, damaged)
    pd.read_parquet(damaged / S.SUBLAYER_SEQUENCES_FILE).drop(columns="magnitude_sum").to_parquet(
        damaged / S.SUBLAYER_SEQUENCES_FILE)
    with pytest.raises(RunError, match="magnitude_sum"):
        context_pressure(load_run(damaged))


def _train(loaded, texts, loss: str, steps: int, seed: int = 0) -> None:
    """``steps`` Adam steps on ``loss`` (BERT corruption, batches of 16 windows of 24 tokens); eval mode after."""
    from gradflow.inputs.corpus import read_documents
    from gradflow.inputs.masking import BertMasking
    from gradflow.inputs.pipeline import masked_batches
    from gradflow.losses import get_loss

    model, fn = loaded.model, get_loss(loss, "batch")
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    step = epoch = 0
    while step < steps:
        policy = BertMasking(seed=1000 + epoch)  # new masks every pass over the corpus
        for batch in masked_batches(loaded.tokenizer, read_documents(str(texts)), policy, 24, 16):
            value = fn(model(**batch.model_inputs()).logits, batch)
            optimizer.zero_grad()
            value.backward()
            optimizer.step()
            step += 1
            if step == steps:
                break
        epoch += 1
    model.eval()


def test_all_positions_training_relieves_the_last_blocks_context_pressure(tmp_path, tiny_mlm_dir, tiny_corpus):
    """Acceptance: an MLM-trained model's last block is under context pressure; 20 all-positions steps lower it."""
    from gradflow.models import load_model

    loaded = load_model(str(tiny_mlm_dir))
    _train(loaded, tiny_corpus, "mlm", steps=60)

    def last_block(name: str) -> pd.DataFrame:
        run = _record(tmp_path / name, tiny_mlm_dir, tiny_corpus, "all-positions", loaded=loaded, limit=32,
                      batch_size=16)
        got = context_pressure(run, n_resamples=300)
        return got[got["last_block"]].set_index("sublayer")

    before = last_block("after_mlm")
    # 20 steps, not 10: on a foreign CPU (CI, AMD EPYC) 10 steps left attn.q at 0.61x of its pressure, against
    # 0.29-0.33x here; 20 steps gave 0.17-0.23x here over four training seeds (the margin below is for such CPUs)
    _train(loaded, tiny_corpus, "all-positions", steps=20)
    after = last_block("after_all_positions")
    mixed = ["attn.q", "attn.out", "attn.norm", "ffn.in", "ffn.out", "ffn.norm"]
    assert (before.loc[mixed, "pressure"] > 0.5).all()  # context positions send about as much as loss positions
    assert (after.loc[mixed, "pressure"] < 0.6 * before.loc[mixed, "pressure"]).all()
    assert (after.loc[mixed, "ci_high"] < before.loc[mixed, "ci_low"]).all()


@pytest.mark.slow
def test_report_has_pressure_only_under_all_positions(runs, tmp_path):
    from gradflow.figures.report import write_comparison, write_report

    paths = write_report(runs["all-positions"].path, tmp_path / "ap", formats=("png",), n_resamples=50)
    names = {p.name for p in paths}
    assert {"context_pressure.png", "context_pressure.csv"} <= names
    summary = (tmp_path / "ap" / "summary.md").read_text()
    assert "## Counterfactual context pressure: last block (layer 2)" in summary
    assert "![context_pressure](context_pressure.png)" in summary
    table = pd.read_csv(tmp_path / "ap" / "tables" / "context_pressure.csv")
    assert tuple(table.columns) == ("label", *S.PRESSURE_COLUMNS)
    write_report(runs["mlm"].path, tmp_path / "mlm", formats=("png",), n_resamples=50)
    assert not (tmp_path / "mlm" / "context_pressure.png").exists()
    assert "context pressure" not in (tmp_path / "mlm" / "summary.md").read_text()
    twin = tmp_path / "twin"
    shutil.copytree(runs["all-positions"].path, twin)
    write_comparison([runs["all-positions"].path, twin], ["a", "b"], tmp_path / "cmp", formats=("png",),
                     n_resamples=50)
    assert (tmp_path / "cmp" / "compare_context_pressure.png").exists()
    assert "| sublayer | a: pressure [95% CI]" in (tmp_path / "cmp" / "summary.md").read_text()


def test_pressure_bars_draw_cis_earlier_blocks_and_exact_zeros(runs):
    import matplotlib.pyplot as plt

    from gradflow.figures.pressure import pressure_bars

    tables = {label: context_pressure(run, n_resamples=50) for label, run in runs.items()}
    drawn = pressure_bars(tables)
    gids = {a.get_gid() for a in drawn}
    assert {"pressure:mlm", "pressure:all-positions", "ci:mlm", "earlier:all-positions", "mean:mlm",
            "pressure:mlm:zero", "reference"} <= gids
    assert drawn[0].axes.get_yscale() == "log"
    plt.close("all")
