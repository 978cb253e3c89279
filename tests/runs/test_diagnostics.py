"""Representation diagnostics: known answers, streaming = one shot, the corpus job and its figures."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from gradflow.adapters import adapter_for  # noqa: E402
from gradflow.runs.logit_lens import LogitLens  # noqa: E402
from gradflow.runs.representations import (  # noqa: E402
    AnisotropyAccumulator,
    Reservoir,
    RunningMoments,
    frechet_distance,
    mean_pairwise_cosine,
    probe_auroc,
)
from gradflow.errors import DiagnosticsError  # noqa: E402
from gradflow.figures.diagnostics import FIGURES, plot_diagnostics  # noqa: E402
from gradflow.hooks.states import collect_states  # noqa: E402
from gradflow.inputs.masking import MaskedBatch  # noqa: E402
from gradflow.roles import Role  # noqa: E402
from gradflow.runs.diagnose import Diagnostics, diagnose_corpus  # noqa: E402
from gradflow.schema import DIAGNOSTIC_COLUMNS as TABLE_COLUMNS  # noqa: E402
from tiny import tiny_batch, tiny_model  # noqa: E402

# ----------------------------------------------------------------------------------------------
# Probe AUROC and Frechet distance
# ----------------------------------------------------------------------------------------------

def test_probe_auroc_identical_distributions_is_chance():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(600, 8)), rng.normal(size=(600, 8))
    auc, se = probe_auroc(a, b, seed=0)
    assert 0.01 < se < 0.05
    # Hanley-McNeil ignores the probe's own fitting noise: under the null, cross-validated AUROCs
    # spread about 1.35x wider than it says (documented in probe_auroc), hence 4 standard errors
    assert abs(auc - 0.5) < 4 * se


def test_probe_auroc_shifted_distributions_is_near_one():
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(400, 8)), rng.normal(size=(400, 8))
    a[:, 3] += 4.0
    auc, se = probe_auroc(a, b, seed=0)
    assert auc > 0.98 and se < 0.01


def test_probe_auroc_too_few_vectors_is_nan():
    auc, se = probe_auroc(np.zeros((1, 3)), np.ones((5, 3)))
    assert np.isnan(auc) and np.isnan(se)


def test_frechet_distance_known_answers():
    rng = np.random.default_rng(3)
    d = 6
    m = rng.normal(size=(d, d))
    cov = m @ m.T + np.eye(d)
    mu = rng.normal(size=d)
    assert frechet_distance(mu, cov, mu, cov) == pytest.approx(0.0, abs=1e-9)
    shift = rng.normal(size=d)
    assert frechet_distance(mu, cov, mu + shift, cov) == pytest.approx(float(shift @ shift), rel=1e-9)
    s1, s2 = 1.5, 0.5
    assert frechet_distance(mu, s1**2 * np.eye(d), mu, s2**2 * np.eye(d)) == pytest.approx(d * (s1 - s2) ** 2)
    # general covariances: tr(C1 + C2 - 2 (C1 C2)^1/2) with scipy's matrix square root
    from scipy.linalg import sqrtm

    m2 = rng.normal(size=(d, d))
    cov2 = m2 @ m2.T + 0.5 * np.eye(d)
    expected = float(shift @ shift + np.trace(cov + cov2 - 2 * np.real(sqrtm(cov @ cov2))))
    assert frechet_distance(mu, cov, mu + shift, cov2) == pytest.approx(expected, rel=1e-7)


def test_running_moments_streamed_equal_numpy():
    rng = np.random.default_rng(4)
    x = rng.normal(loc=3.0, size=(101, 5))
    moments = RunningMoments()
    for chunk in np.array_split(x, [1, 7, 40, 41]):
        moments.add(chunk)
    assert moments.n == 101
    np.testing.assert_allclose(moments.mean, x.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(moments.covariance(), np.cov(x, rowvar=False), rtol=1e-10)


def test_reservoir_is_a_batching_invariant_uniform_sample():
    x = np.arange(500, dtype=np.float32)[:, None].repeat(2, axis=1)
    one, many = Reservoir(50, (0, 1)), Reservoir(50, (0, 1))
    one.add(x)
    for chunk in np.array_split(x, [3, 4, 100, 333]):
        many.add(chunk)
    assert one.sample().shape == (50, 2) and one.seen == many.seen == 500
    np.testing.assert_array_equal(one.sample(), many.sample())
    assert len(set(one.sample()[:, 0])) == 50
    small = Reservoir(50, (0, 1))
    small.add(x[:10])
    assert sorted(small.sample()[:, 0]) == list(range(10))
    # uniform: the sample's mean index is near the stream's (500 items, 50 kept)
    means = []
    for seed in range(40):
        r = Reservoir(50, (seed,))
        r.add(x)
        means.append(r.sample()[:, 0].mean())
    assert abs(np.mean(means) - 249.5) < 15


# ----------------------------------------------------------------------------------------------
# Anisotropy
# ----------------------------------------------------------------------------------------------

def _brute_force_cosine(x: np.ndarray) -> float:
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    c = u @ u.T
    n = len(x)
    return float((c.sum() - np.trace(c)) / (n * (n - 1)))


def test_mean_pairwise_cosine_formula_vs_brute_force():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(40, 7)) + np.array([2.0, 0, 0, 0, 0, 0, 1.0])
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    assert mean_pairwise_cosine(u.sum(axis=0), len(x)) == pytest.approx(_brute_force_cosine(x), rel=1e-12)
    assert np.isnan(mean_pairwise_cosine(u[0], 1))


def test_anisotropy_accumulator_per_role_vs_brute_force():
    batch = tiny_batch()
    gen = torch.Generator().manual_seed(0)
    hidden = [torch.randn(*batch.roles.shape, 16, generator=gen) + 0.5 for _ in range(2)]
    from gradflow.hooks.states import SiteStates

    acc = AnisotropyAccumulator()
    acc.add(SiteStates(hidden, []), batch)
    frame = acc.frame()
    for layer in (0, 1):
        for role, mask in (("context", batch.roles == Role.CONTEXT), ("loss", batch.roles <= Role.KEPT)):
            row = frame[(frame.layer == layer) & (frame.role == role)].iloc[0]
            assert row.n_positions == int(mask.sum())
            assert row.mean_pairwise_cosine == pytest.approx(_brute_force_cosine(hidden[layer][mask].double().numpy()),
                                                             rel=1e-10)


# ----------------------------------------------------------------------------------------------
# Logit lens
# ----------------------------------------------------------------------------------------------

class _Pass(nn.Module):
    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class _IdentityBlock(nn.Module):
    """A block that returns its input (with an ``attention`` child, where the adapter's mid site is)."""

    def __init__(self):
        super().__init__()
        self.attention = _Pass()

    def forward(self, hidden_states, *args, **kwargs):
        return self.attention(hidden_states)


def identity_bert() -> nn.Module:
    """A tiny BERT whose blocks are identities, one-hot word embeddings and an identity-like head
    tied to them: every layer's output decodes to the input token."""
    hidden = 64
    model = tiny_model("bert", hidden_size=hidden)
    emb, head = model.bert.embeddings, model.cls.predictions
    assert head.decoder.weight is emb.word_embeddings.weight  # tied
    with torch.no_grad():
        emb.word_embeddings.weight.copy_(8.0 * torch.eye(hidden))
        emb.position_embeddings.weight.zero_()
        emb.token_type_embeddings.weight.zero_()
        head.transform.dense.weight.copy_(torch.eye(hidden))
        head.transform.dense.bias.zero_()
        head.decoder.bias.zero_()
    model.bert.encoder.layer = nn.ModuleList([_IdentityBlock() for _ in range(3)])
    return model


def test_logit_lens_recovers_every_context_token_through_identity_blocks():
    model = identity_bert()
    batch = tiny_batch()
    diag = Diagnostics(model, adapter_for(model), max_per_group=20)
    states = collect_states(model, batch)
    for layer in range(1, 4):
        torch.testing.assert_close(states.hidden[layer], states.hidden[0], rtol=0, atol=0)
    diag.add(states, batch)
    assert diag.lens.final_path is None and diag.lens.max_abs_diff == 0.0
    lens = diag.tables()["logit_lens"]
    assert sorted(lens.layer.unique()) == [0, 1, 2, 3]
    for role, expected in (("context", 1.0), ("special", 1.0), ("masked", 0.0), ("random", 0.0)):
        assert (lens[lens.role == role].top1_original == expected).all(), role
    shift = diag.tables()["transformation"]
    assert (shift.rel_change_mean == 0).all()


@pytest.mark.parametrize("family, final", [("modernbert", "final_norm"), ("deberta-v2", None),
                                           ("esm", "encoder.emb_layer_norm_after")])
def test_logit_lens_reproduces_the_model_logits(family, final):
    model = tiny_model(family)
    batch = tiny_batch()
    states = collect_states(model, batch)
    lens = LogitLens(model, adapter_for(model))
    lens.resolve(states.hidden[-1], states.logits, batch.roles != Role.PAD)
    assert lens.final_path == final
    keep = batch.roles != Role.PAD
    torch.testing.assert_close(lens(states.hidden[-1][keep]), states.logits[keep], rtol=1e-5, atol=1e-5)


def test_logit_lens_refuses_an_unknown_head():
    model = tiny_model("bert")
    states = collect_states(model, tiny_batch())
    lens = LogitLens(model, adapter_for(model))
    with pytest.raises(DiagnosticsError, match="cannot reproduce"):
        lens.resolve(states.hidden[-1], states.logits + 1.0, torch.ones(states.logits.shape[:2], dtype=torch.bool))


# ----------------------------------------------------------------------------------------------
# Streaming = one shot
# ----------------------------------------------------------------------------------------------

def _rows(batch: MaskedBatch, rows: slice) -> MaskedBatch:
    return MaskedBatch(batch.input_ids[rows], batch.original_ids[rows], batch.labels[rows], batch.roles[rows],
                       batch.attention_mask[rows], batch.sequence_index[rows])


def test_streaming_equals_one_shot():
    model = tiny_model("bert")
    batch = tiny_batch(b=4, t=12)
    states = collect_states(model, batch)
    adapter = adapter_for(model)
    whole = Diagnostics(model, adapter, max_per_group=7, seed=3)
    whole.add(states, batch)
    streamed = Diagnostics(model, adapter, max_per_group=7, seed=3)
    for start in range(4):
        streamed.add(states.select(slice(start, start + 1)), _rows(batch, slice(start, start + 1)))
    a, b = whole.tables(), streamed.tables()
    for name in TABLE_COLUMNS:
        # Frechet: tr(C1) + tr(C2) - 2 tr(...)^1/2 cancels digits, the moments themselves agree to 1e-12
        pd.testing.assert_frame_equal(a[name], b[name], check_exact=False, rtol=1e-7, atol=1e-12, obj=name)


# ----------------------------------------------------------------------------------------------
# The corpus job
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tiny_mlm_dir):
    from gradflow.models import load_model

    return load_model(str(tiny_mlm_dir))


@pytest.fixture(scope="module")
def diagnosed(loaded, tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("diag")
    tables = diagnose_corpus(loaded, str(tiny_corpus), out, max_length=32, batch_size=4, limit=10, seed=0,
                             max_per_group=100, command="gradflow diagnose --test")
    return out, tables


def test_diagnose_corpus_writes_tables_and_meta(diagnosed, loaded):
    out, tables = diagnosed
    assert set(tables) == set(TABLE_COLUMNS)
    for name, columns in TABLE_COLUMNS.items():
        frame = pd.read_csv(out / f"{name}.csv")
        assert tuple(frame.columns) == columns, name
        assert len(frame) == len(tables[name]) > 0, name
    meta = json.loads((out / "meta.json").read_text())
    assert meta["complete"] is True and meta["seed"] == 0 and meta["masking"]["policy"] == "bert"
    assert meta["counts"]["sequences"] == 10 and meta["command"] == "gradflow diagnose --test"
    assert {"torch", "transformers", "scikit-learn", "gradflow"} <= set(meta["versions"])
    shift = tables["input_shift"]
    assert list(shift.layer) == [1, 2] and (shift.n_sample_loss <= 100).all() and (shift.n_loss > 0).all()
    assert shift.auroc.between(0, 1).all() and (shift.frechet_distance >= 0).all()
    transformation = tables["transformation"]
    assert set(transformation.loc[transformation.last_block, "layer"]) == {2}
    lens = tables["logit_lens"]
    assert set(lens.role) >= {"context", "masked", "loss"} and lens.top1_original.between(0, 1).all()


def test_diagnose_corpus_is_deterministic(diagnosed, loaded, tiny_corpus, tmp_path):
    out, tables = diagnosed
    again = diagnose_corpus(loaded, str(tiny_corpus), tmp_path, max_length=32, batch_size=3, limit=10, seed=0,
                            max_per_group=100)
    for name in TABLE_COLUMNS:
        pd.testing.assert_frame_equal(tables[name], again[name], check_exact=False, rtol=1e-6, atol=1e-9, obj=name)


def test_diagnose_corpus_accepts_a_list_of_texts(loaded, tmp_path):
    tables = diagnose_corpus(loaded, ["the progress of public credit", "the union is preserved"], tmp_path,
                             max_length=32, batch_size=2)
    assert tables["anisotropy"].n_positions.sum() > 0


def test_diagnose_corpus_errors(loaded, tmp_path):
    from gradflow.errors import CorpusError, UsageError

    with pytest.raises(UsageError, match="--max-length 10000 is longer than the 64 positions"):
        diagnose_corpus(loaded, ["text"], tmp_path, max_length=10_000)

    with pytest.raises(CorpusError):
        diagnose_corpus(loaded, ["   "], tmp_path / "empty", max_length=32)


def test_plot_diagnostics_writes_one_figure_each(diagnosed, tmp_path):
    import matplotlib.pyplot as plt

    out, tables = diagnosed
    paths = plot_diagnostics(tables, tmp_path, formats=("png",))
    assert sorted(p.stem for p in paths) == sorted(FIGURES)
    assert all(p.stat().st_size > 0 for p in paths)
    for name, (table, plot) in FIGURES.items():
        drawn = plot(tables[table])
        assert drawn, name
        plt.close("all")
