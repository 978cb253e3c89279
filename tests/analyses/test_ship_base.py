"""Shipping a resumable-recipe run (analyses/pretraining/ship_base.py): float16 weights, held-out top-1, cards.

A tiny run (2 layers, hidden 32) on a synthetic corpus with a test split, shipped into a temporary package folder.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pandas as pd
import pytest
import torch
from analyses.pretraining import pretrain_base, ship_base
from analyses.pretraining.recipe.data import SpecialIds, load_windows, validation_batches
from analyses.pretraining.recipe.train import EXIT_DONE, EXIT_STOPPED
from safetensors.torch import load_file
from transformers import BertTokenizerFast

from gradflow.errors import UsageError
from gradflow.models import load_model

TINY = ["--arch", "tiny", "--vocab-size", "256", "--warmup", "2", "--batch-size", "4", "--lr", "3e-3",
        "--eval-every", "4", "--checkpoint-every", "4", "--log-every", "1", "--valid-windows", "16", "--threads", "1"]


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two finished tiny runs (mlm, alltoken) of 8 steps, shipped; and one stopped run."""
    root = tmp_path_factory.mktemp("ship")
    corpus = root / "corpus"
    corpus.mkdir()
    rng = random.Random(1)
    words = ["".join(rng.choice("abcdefghiklmnoprstu") for _ in range(rng.randint(2, 6))) for _ in range(120)]
    for split, n_docs in (("train", 40), ("valid", 8), ("test", 8)):
        docs = [" ".join(rng.choice(words) for _ in range(rng.randint(30, 90))) for _ in range(n_docs)]
        (corpus / f"{split}.txt").write_text("\n".join(docs) + "\n")
    runs = []
    for loss in ("mlm", "alltoken"):
        out = root / f"tiny-{loss}"
        code = pretrain_base.main(["--corpus", str(corpus), "--out", str(out), "--tokenizer", str(corpus / "tok"),
                                   "--loss", loss, "--steps", "8", *TINY])
        assert code == EXIT_DONE
        runs.append(out)
    stopped = root / "tiny-stopped"
    assert pretrain_base.main(["--corpus", str(corpus), "--out", str(stopped), "--tokenizer", str(corpus / "tok"),
                               "--steps", "8", "--stop-after", "4", *TINY]) == EXIT_STOPPED
    package, figures = root / "package", root / "figures"
    cards = ship_base.ship(runs, package, figures, test_windows=12, sample_limit=6)
    return {"runs": runs, "package": package, "figures": figures, "cards": cards, "corpus": corpus,
            "stopped": stopped}


def test_weights_are_the_runs_in_float16(shipped: dict) -> None:
    for run in shipped["runs"]:
        dest = shipped["package"] / run.name
        ship_base.check_float16(dest)
        full = load_file(run / "model" / "model.safetensors")
        half = load_file(dest / "model.safetensors")
        assert full.keys() == half.keys()
        for name, value in full.items():
            assert torch.equal(value.half(), half[name]), name
        assert json.loads((dest / "config.json").read_text())["dtype"] == "float16"


def test_test_split_top1_matches_a_hand_count(shipped: dict) -> None:
    """The card's test-split top-1 equals argmax == target counted by hand over the same masked windows."""
    run = shipped["runs"][0]
    dest = shipped["package"] / run.name
    loaded = load_model(str(dest))
    tokenizer = BertTokenizerFast.from_pretrained(dest)
    windows = load_windows(tokenizer, shipped["corpus"] / "test.txt", 32, run / "cache")
    correct = total = 0
    with torch.no_grad():
        for batch in validation_batches(windows, 12, 0, SpecialIds.of(tokenizer)):
            logits = loaded.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            rows = batch.rows[batch.targets != -100]
            flat = logits.reshape(-1, logits.shape[-1])[rows]
            correct += int((flat.argmax(-1) == batch.targets[batch.targets != -100]).sum())
            total += int(rows.numel())
    held = shipped["cards"][run.name]["held_out"]
    assert held["test_positions"] == total > 0
    assert held["test_top1"] == pytest.approx(correct / total, abs=1e-12)
    assert 0.0 <= held["sample_top1"] <= 1.0 and held["sample_positions"] > 0


def test_cards_and_curves(shipped: dict) -> None:
    cards, figures = shipped["cards"], shipped["figures"]
    assert list(cards) == [run.name for run in shipped["runs"]]
    for run in shipped["runs"]:
        card = json.loads((shipped["package"] / run.name / "recipe.json").read_text())
        meta = json.loads((run / "meta.json").read_text())
        assert card["tokens_seen"] == meta["tokens_seen"] > 0 and card["steps_done"] == 8
        assert card["shape"] == {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "max_len": 32}
        elapsed = float(pd.read_csv(run / "training_log.csv")["elapsed_s"].iloc[-1])  # 8 tiny steps: under 0.05 s
        assert card["final"] == meta["final"] and card["wall_s"] == round(elapsed, 1) >= 0  # on a fast CPU
        assert card["cpu_s"] == pytest.approx(meta["segments"][0]["cpu_s"]) and card["cpu_s"] >= 0
        assert (card["commands"], card["commands_without_cpu_s"]) == (1, 0)
        text = (shipped["package"] / run.name / "recipe.json").read_text()
        assert str(ship_base.ROOT) not in text and "pretrain_base" in card["command_line"]  # the repository's
        # own paths (the interpreter in .venv, a corpus under data/) are written relative to it
    table = (figures / "cards.md").read_text().splitlines()
    assert len(table) == 2 + len(cards) and all(f"`{name}`" in "\n".join(table) for name in cards)
    for suffix in ("pdf", "png", "csv"):
        assert (figures / f"pretraining_curves.{suffix}").stat().st_size > 0


def test_an_unfinished_run_is_refused_with_what_to_do(shipped: dict, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="has not finished training.*rerun its pretrain_base command"):
        ship_base.ship([shipped["runs"][0], shipped["stopped"]], tmp_path / "package", tmp_path / "figures", 4)
    assert not (tmp_path / "package").exists()  # nothing written for any model
    with pytest.raises(UsageError, match="no meta.json"):
        ship_base.finished_run(tmp_path)


@pytest.mark.slow
def test_a_shipped_recipe_run_reproduces_its_log(shipped: dict, capsys: pytest.CaptureFixture) -> None:
    """check_reproduce re-trains the first steps from the card and gets the shipped losses bit for bit."""
    from analyses.pretraining import check_reproduce

    code = check_reproduce.main(["--model", "tiny-mlm", "--package", str(shipped["package"]), "--steps", "5",
                                 "--corpus", str(shipped["corpus"]), "--rtol", "0"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and report["steps_compared"] == 5 and report["bit_identical"], report


def test_a_model_shipped_earlier_joins_the_cards_untouched(shipped: dict, tmp_path: Path) -> None:
    """--shipped: the first model's run folder may be gone; its files stay byte for byte, its row and curve stay."""
    import pandas as pd
    import shutil

    package, figures = tmp_path / "package", tmp_path / "figures"
    shutil.copytree(shipped["package"] / "tiny-mlm", package / "tiny-mlm")
    before = {p.name: p.read_bytes() for p in (package / "tiny-mlm").iterdir()}
    cards = ship_base.ship([shipped["runs"][1]], package, figures, test_windows=12, sample_limit=6,
                           shipped=("tiny-mlm",))
    assert list(cards) == ["tiny-mlm", "tiny-alltoken"]
    assert {p.name: p.read_bytes() for p in (package / "tiny-mlm").iterdir()} == before
    assert cards["tiny-mlm"] == shipped["cards"]["tiny-mlm"]
    assert cards["tiny-alltoken"]["held_out"] == shipped["cards"]["tiny-alltoken"]["held_out"]
    assert (figures / "cards.md").read_text() == (shipped["figures"] / "cards.md").read_text()
    curves = pd.read_csv(figures / "pretraining_curves.csv")
    assert curves.equals(pd.read_csv(shipped["figures"] / "pretraining_curves.csv"))
    # both run folders gone (a fresh clone): the cards and curves are redrawn from the package alone
    redrawn = tmp_path / "redrawn"
    assert ship_base.ship([], package, redrawn, 12, shipped=("tiny-mlm", "tiny-alltoken")) == cards
    assert (redrawn / "cards.md").read_text() == (shipped["figures"] / "cards.md").read_text()
    assert pd.read_csv(redrawn / "pretraining_curves.csv").equals(curves)


def test_shipped_models_are_checked(shipped: dict, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a shipped recipe model.*ship its run with --run"):
        ship_base.ship([shipped["runs"][1]], tmp_path / "package", tmp_path / "figures", 4, shipped=("tiny-mlm",))
    with pytest.raises(UsageError, match="nothing to ship"):
        ship_base.ship([], tmp_path / "package", tmp_path / "figures", 4)
    with pytest.raises(UsageError, match="given both as --run and --shipped"):
        ship_base.ship([shipped["runs"][0]], shipped["package"], tmp_path / "figures", 4, shipped=("tiny-mlm",))
    assert not (tmp_path / "package").exists()
