"""Weight snapshots of the pretraining recipe (analyses/pretraining/recipe/snapshots.py): log-spaced steps,
the weights of the step they name, and the same bytes after a stop and resume."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from analyses.pretraining.recipe.checkpoint import load_checkpoint
from analyses.pretraining.recipe.config import RunConfig
from analyses.pretraining.recipe.snapshots import read_index, snapshot_steps
from analyses.pretraining.recipe.train import EXIT_DONE, EXIT_STOPPED, run
from safetensors.torch import load_file

STEPS = 16


def test_snapshot_steps_are_log_spaced_distinct_and_end_at_the_last_step():
    assert snapshot_steps(40_000, 8) == (312, 625, 1250, 2500, 5000, 10000, 20000, 40000)
    assert snapshot_steps(16, 4) == (2, 4, 8, 16)
    assert snapshot_steps(24, 8) == (1, 2, 4, 6, 10, 15, 24)  # collisions at small step counts merge
    assert snapshot_steps(7, 0) == ()
    assert snapshot_steps(7, 1) == (7,)
    with pytest.raises(ValueError, match="n >= 0"):
        snapshot_steps(10, -1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(1)
    words = ["".join(rng.choice("abcdefghiklmnoprstu") for _ in range(rng.randint(2, 6))) for _ in range(120)]
    for split, n_docs in (("train", 40), ("valid", 8)):
        docs = [" ".join(rng.choice(words) for _ in range(rng.randint(30, 90))) for _ in range(n_docs)]
        (root / f"{split}.txt").write_text("\n".join(docs) + "\n")
    return root


def config(corpus: Path, out: Path, **extra: object) -> RunConfig:
    return RunConfig.from_arch("tiny", corpus=str(corpus), out=str(out), tokenizer=str(corpus / "tokenizer"),
                               vocab_size=256, steps=STEPS, warmup=2, batch_size=4, lr=3e-3, eval_every=8,
                               checkpoint_every=5, log_every=100, valid_windows=8, threads=1, snapshots=4, **extra)


@pytest.fixture(scope="module")
def straight(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("straight")
    assert run(config(corpus, out)) == EXIT_DONE
    return out


def test_snapshots_hold_the_weights_of_their_step(straight: Path):
    rows = read_index(straight)
    assert [int(r["step"]) for r in rows] == [2, 4, 8, 16]
    assert all(len(r["sha256"]) == 64 for r in rows) and len({r["sha256"] for r in rows}) == 4
    assert [int(r["tokens"]) for r in rows] == sorted(int(r["tokens"]) for r in rows)
    last = load_file(str(straight / "snapshots" / rows[-1]["file"]))
    final = load_checkpoint(straight)["model"]
    assert set(last) <= set(final)
    for name, tensor in last.items():
        assert torch.equal(tensor, final[name].float()), name


def test_a_stopped_and_resumed_run_writes_the_same_snapshot_bytes(corpus: Path, straight: Path, tmp_path: Path):
    out = tmp_path / "resumed"
    assert run(config(corpus, out, stop_after=6)) == EXIT_STOPPED
    assert [int(r["step"]) for r in read_index(out)] == [2, 4]
    assert run(config(corpus, out)) == EXIT_DONE
    assert read_index(out) == read_index(straight)


@pytest.mark.slow
def test_sparse_recipe_loss_and_gradients_are_the_dense_ones(corpus: Path, straight: Path):
    """--sparse (the last block's query side at the loss rows only): the recipe's loss and every gradient
    equal its dense loss's on a real batch of the run (float32, relative 1e-5)."""
    from analyses.pretraining.recipe.data import SpecialIds, TokenStream, load_windows, train_tokenizer
    from analyses.pretraining.recipe.model import build_model, mlm_loss, sparse_mlm_loss

    cfg = config(corpus, straight)
    tokenizer = train_tokenizer(corpus, corpus / "tokenizer", cfg.vocab_size)
    special = SpecialIds.of(tokenizer)
    windows = load_windows(tokenizer, corpus / "train.txt", cfg.max_len, straight / "cache")
    stream = TokenStream(windows, cfg.batch_size, cfg.seed, special, False, cfg.batch_size * cfg.max_len // 4)
    batch = stream.batch(3)
    model = build_model(cfg, len(tokenizer), special.pad)
    dense = mlm_loss(model, batch)[0]
    sparse = sparse_mlm_loss(model, batch)
    assert abs(sparse.item() - dense.item()) <= 1e-5 * dense.item()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    grads_dense = torch.autograd.grad(dense, params, allow_unused=True)
    grads_sparse = torch.autograd.grad(sparse, params, allow_unused=True)
    for (name, _), g_dense, g_sparse in zip(named, grads_dense, grads_sparse):
        assert (g_dense is None) == (g_sparse is None), name
        if g_dense is not None:
            assert float((g_sparse - g_dense).norm()) <= 1e-5 * float(g_dense.norm()) + 1e-9, name


def test_sparse_run_trains_and_alltoken_is_refused(corpus: Path, tmp_path: Path):
    assert run(config(corpus, tmp_path / "sparse", sparse=True, stop_after=4)) == EXIT_STOPPED
    assert run(config(corpus, tmp_path / "sparse", sparse=True)) == EXIT_DONE
    with pytest.raises(ValueError, match="alltoken"):
        config(corpus, tmp_path / "x", sparse=True, loss="alltoken")


def test_a_checkpoint_without_a_newer_field_resumes_at_its_default():
    from analyses.pretraining.recipe.config import identity_diff

    new = RunConfig.from_arch("tiny", corpus="c", out="o").identity()
    stored = {k: v for k, v in new.items() if k != "sparse"}
    assert identity_diff(stored, new) == []
    assert identity_diff(stored, {**new, "sparse": True}) == ["sparse: False -> True"]
