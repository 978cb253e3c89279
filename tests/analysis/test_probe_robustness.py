"""Issue 31: the MLP probe family, the probe training size decoupled from the test split, the sweep's rule."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from gradflow.analysis.mlp_probe import fit_mlp_probe
from gradflow.analysis.probes import ProbeResult, fit_probe, last_layer_drop, last_layer_drop_ci, sentence_bootstrap_ci
from gradflow.cli.main import main
from gradflow.errors import TaskError, UsageError
from gradflow.inputs.labelled import LabelledSentences, LabelledSplits
from gradflow.runs.probe import ProbeConfig, limited_splits, run_probes


def _xor(n: int, seed: int, width: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """(n, width) features whose label is the XOR of the signs of the first two: no linear probe can read it."""
    x = np.random.default_rng(seed).normal(size=(n, width))
    return x, ((x[:, 0] > 0) ^ (x[:, 1] > 0)).astype(np.int64)


def _fit(family, seed: int = 0, **kwargs) -> ProbeResult:
    (a, ya), (b, yb), (c, yc) = _xor(800, 1), _xor(300, 2), _xor(300, 3)
    return family(a, ya, b, yb, c, yc, seed=seed, **kwargs)


# ------------------------------------------------------------------------------------ the MLP probe
def test_mlp_learns_a_task_the_logistic_probe_cannot():
    mlp, logistic = _fit(fit_mlp_probe, max_epochs=30, batch_size=32, Cs=(1.0,)), _fit(fit_probe)
    assert mlp.accuracy > 0.9
    assert logistic.accuracy < 0.65  # XOR: a linear read-out is near chance
    assert mlp.correct.shape == (300,) and mlp.correct.dtype == bool
    assert mlp.accuracy == mlp.correct.mean()
    assert mlp.best_c == 1.0 and set(mlp.val_accuracy) == {1.0}


def test_mlp_is_reproducible_with_a_seed_and_leaves_torch_as_it_was():
    threads = torch.get_num_threads()
    state = torch.random.get_rng_state()
    a, b = _fit(fit_mlp_probe, seed=3, max_epochs=5), _fit(fit_mlp_probe, seed=3, max_epochs=5)
    np.testing.assert_array_equal(a.predictions, b.predictions)
    assert (a.accuracy, a.best_c, a.val_accuracy) == (b.accuracy, b.best_c, b.val_accuracy)
    assert set(a.val_accuracy) == {0.1, 10.0} and a.val_accuracy[a.best_c] == max(a.val_accuracy.values())
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.random.get_rng_state(), state)  # initialisation drew from its own seeded generator


def test_mlp_predicts_in_the_label_space_of_train():
    (a, ya), (b, yb), (c, yc) = _xor(400, 1), _xor(200, 2), _xor(200, 3)
    result = fit_mlp_probe(a, ya * 5 + 3, b, yb * 5 + 3, c, yc * 5 + 3, max_epochs=30)
    assert set(np.unique(result.predictions)) <= {3, 8}
    np.testing.assert_array_equal(result.correct, result.predictions == yc * 5 + 3)
    assert result.majority_accuracy == pytest.approx(max(np.mean(yc == 0), np.mean(yc == 1)))


def test_mlp_rejects_bad_inputs_like_the_logistic_probe():
    x, y = _xor(50, 0)
    with pytest.raises(UsageError, match="at least 2 distinct labels"):
        fit_mlp_probe(x, np.zeros(50, dtype=int), x, y, x, y)
    with pytest.raises(UsageError, match="same width"):
        fit_mlp_probe(x, y, x[:, :3], y, x, y)
    with pytest.raises(UsageError, match="at least one regularisation"):
        fit_mlp_probe(x, y, x, y, x, y, Cs=())


def test_drop_functions_accept_mlp_results():
    """Layer 1 carries the label, layer 2 (the last) only noise: a clear negative drop with a CI below 0."""
    rng = np.random.default_rng(0)
    sentences = np.repeat(np.arange(150), 4)  # 600 test words in 150 sentences
    labels = {s: rng.integers(0, 3, size=n) for s, n in (("train", 600), ("val", 300), ("test", 600))}

    def layer(signal: float) -> dict[str, np.ndarray]:
        means = 3 * signal * rng.normal(size=(3, 6))  # one mean per label, shared by the splits
        return {s: means[y] + rng.normal(size=(y.size, 6)) for s, y in labels.items()}

    correct = {}
    for i, signal in enumerate((0.3, 1.0, 0.0)):
        f = layer(signal)
        result = fit_mlp_probe(f["train"], labels["train"], f["val"], labels["val"], f["test"], labels["test"],
                               max_epochs=20)
        correct[i] = result.correct
        low, high = sentence_bootstrap_ci(result.correct, sentences, 200)
        assert low <= result.accuracy <= high
    drop = last_layer_drop({i: c.mean() for i, c in correct.items()})
    low, high = last_layer_drop_ci(correct, sentences, 300)
    assert drop < -0.2 and low <= drop <= high and high < 0


# ------------------------------------------------------------------------------------ training size vs test split
def _splits(n: int = 20) -> LabelledSplits:
    def part(prefix: str) -> LabelledSentences:
        words = tuple((f"{prefix}{i}", "x") for i in range(n))
        return LabelledSentences(words, tuple(("A", "B") for _ in range(n)))

    return LabelledSplits("toy", part("tr"), part("va"), part("te"), ("A", "B"), "toy")


def test_train_limit_changes_train_only():
    task = _splits()
    runs = [limited_splits(task, 6, t) for t in (None, 2, 15, "all")]
    assert [len(r.train) for r in runs] == [6, 2, 15, 20]
    for r in runs:
        assert r.test == task.test.head(6) and r.validation == task.validation.head(6)
        assert r.train.words == task.train.words[: len(r.train)]  # a prefix: smaller runs nest in larger ones
    assert len(limited_splits(task, None, 3).test) == 20
    for bad in (0, -1, "most", 2.5, True):
        with pytest.raises(TaskError, match="train_limit"):
            limited_splits(task, 6, bad)


@pytest.mark.slow
def test_mlp_runs_with_different_train_sizes_score_the_same_test_words(tiny_mlm_dir, toy_task, tmp_path, capsys):
    outs = []
    for size in ("20", "all"):
        out = tmp_path / f"run-{size}"
        code = main(["probe", "--model", str(tiny_mlm_dir), "--task", str(toy_task), "--probe", "mlp", "--limit", "8",
                     "--train-limit", size, "--no-code-length", "--resamples", "50", "--out", str(out), "--quiet",
                     "--format", "png"])
        assert code == 0
        outs.append(out)
    assert "last_layer_drop" in capsys.readouterr().out
    metas = [json.loads((o / "meta.json").read_text()) for o in outs]
    assert [m["counts"]["unmasked"]["train"]["sentences"] for m in metas] == [20, 96]  # 80% of 120, all of train
    assert metas[0]["counts"]["unmasked"]["test"] == metas[1]["counts"]["unmasked"]["test"]
    assert metas[0]["options"]["probe"] == "mlp" and metas[0]["options"]["cs"] == [0.1, 10.0]
    assert metas[1]["options"]["train_limit"] == "all" and metas[0]["complete"] is True
    words = [pd.read_parquet(o / "probe_words.parquet")[["layer", "sentence", "word"]] for o in outs]
    pd.testing.assert_frame_equal(words[0], words[1])
    drops = pd.read_csv(outs[0] / "probe_drops.csv")
    probes = pd.read_csv(outs[0] / "probes.csv").set_index("layer")["accuracy"]
    assert drops.iloc[0].last_layer_drop == pytest.approx(probes[2] - max(probes[0], probes[1]))


def test_logistic_default_cs_are_recorded(tiny_mlm_dir, toy_task, tmp_path):
    run = run_probes(ProbeConfig(model=str(tiny_mlm_dir), task=str(toy_task), out=str(tmp_path / "o"), limit=6,
                                 n_resamples=20, code_length=False))
    meta = json.loads((run.out / "meta.json").read_text())
    assert meta["options"]["cs"] == [0.001, 0.01, 0.1, 1.0, 10.0] and meta["options"]["probe"] == "logistic"
    assert set(run.probes["best_c"]) <= set(meta["options"]["cs"])


def test_bad_probe_options_exit_2(tiny_mlm_dir, toy_task, tmp_path, capsys):
    for flag, value in (("--train-limit", "0"), ("--train-limit", "half"), ("--probe", "forest")):
        with pytest.raises(SystemExit) as exit_:
            main(["probe", "--model", str(tiny_mlm_dir), "--task", str(toy_task), flag, value,
                  "--out", str(tmp_path / "o")])
        assert exit_.value.code == 2 and flag in capsys.readouterr().err
    with pytest.raises(TaskError, match="unknown probe family 'forest'"):
        run_probes(ProbeConfig(model=str(tiny_mlm_dir), task=str(toy_task), out=str(tmp_path / "o"), probe="forest"))
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------ the sweep's rule
def _row(family: str, size: str, drop: float, low: float, high: float) -> dict:
    return {"model": "m", "task": "t", "family": family, "train_size": size, "last_layer_drop": drop,
            "ci_low": low, "ci_high": high}


def test_the_plans_rule_calls_a_drop_only_when_both_families_agree():
    from analyses.probes.robustness import verdict

    sizes, families = ["all", "300", "1500"], ["logistic", "mlp"]
    drop = [_row(f, s, -0.01, -0.02, -0.005) for f in families for s in ("1500", "all")]
    assert verdict(pd.DataFrame(drop), families, sizes) == "drop"
    flipped = [*drop[:3], _row("mlp", "all", 0.001, -0.002, 0.004)]
    assert verdict(pd.DataFrame(flipped), families, sizes) == "no drop"
    sign_at_1500 = [_row("logistic", "1500", 0.001, -0.01, 0.01), *drop[1:]]
    assert verdict(pd.DataFrame(sign_at_1500), families, sizes) == "no drop"
    assert verdict(pd.DataFrame(drop[:2]), families, sizes) == "undecided (missing mlp-all, mlp-1500)"


def test_probe_figures_name_the_family_in_their_title():
    from pathlib import Path

    from gradflow.analysis.probe_tables import load_probe_dirs
    from gradflow.figures.probes import probe_family_words

    root = Path(__file__).resolve().parents[2] / "figures" / "probes" / "robustness"
    mlp, logistic = root / "mini-en-brown-pos-mlp-300", root / "mini-en-brown-pos-logistic-300"
    assert load_probe_dirs([mlp, logistic]).families == ("mlp", "logistic")
    assert probe_family_words(load_probe_dirs([mlp]).families) == "MLP probes"
    assert probe_family_words(load_probe_dirs([logistic]).families) == "linear probes"
    assert probe_family_words(("mlp", "logistic")) == "probes (MLP, linear)"
    assert probe_family_words(()) == "linear probes"  # a run from before the option: logistic


# ------------------------------------------------------------------------------------ the sweep drivers
def test_robustness_sweep_runs_only_the_unfinished_runs_jobs_at_a_time(monkeypatch, tmp_path):
    import threading

    from analyses.probes import robustness

    ran, threads = [], set()

    def fake_run(command, threads_per_run):
        ran.append(command[command.index("--out") + 1])
        threads.add(threading.get_ident())
        return 0.0

    monkeypatch.setattr(robustness, "run", fake_run)
    monkeypatch.setattr(robustness, "finished", lambda command: "-300" in command[command.index("--out") + 1])
    monkeypatch.setattr(robustness, "write_tables", lambda *args: None)
    monkeypatch.setattr("sys.argv", ["robustness", "--models", "a=m1", "b=m2", "--sizes", "300", "4500",
                                     "--out", str(tmp_path), "--jobs", "2"])
    assert robustness.main() == 0
    assert sorted(ran) == sorted(f"{tmp_path}/{label}-brown-pos-{family}-4500" for label in "ab"
                                 for family in ("logistic", "mlp"))
    assert robustness.SIZES == ("300", "600", "1500", "4500")  # plan deviation 5
    assert robustness.largest_size(["300", "4500", "1500"]) == "4500"
    assert robustness.largest_size(["4500", "all"]) == "all"


def test_probe_pair_runs_only_the_named_labels(monkeypatch, capsys):
    from analyses.probes import run

    commands = []
    monkeypatch.setattr(run, "run_all", lambda c, jobs: commands.extend(c))
    monkeypatch.setattr(run, "compare", lambda *args: None)
    monkeypatch.setattr(run, "write_tables", lambda *args: None)
    monkeypatch.setattr(run, "gradflow", lambda *args, **kw: pytest.fail(f"unexpected gradflow {args}"))
    monkeypatch.setattr("sys.argv", ["run", "--pair", "mini12-en", "--labels", "mini12-en", "--out", "x"])
    assert run.main() == 0
    models = {c[c.index("--model") + 1] for c in commands}
    outs = sorted(c[c.index("--out") + 1] for c in commands)
    assert models == {"gradflow-mini12-en"}
    assert outs == ["x/runs/mini12-en-brown-pos", "x/runs/mini12-en-brown-pos-masked", "x/runs/mini12-en-brown-propn"]
    monkeypatch.setattr("sys.argv", ["run", "--pair", "mini12-en", "--labels", "nope"])
    with pytest.raises(SystemExit) as exit_:
        run.main()
    assert exit_.value.code == 2 and "--labels nope: not a model of the pair mini12-en" in capsys.readouterr().err


@pytest.mark.parametrize("folder, models, sizes", [
    ("figures/probes/robustness", {"mini-en": "gradflow-mini-en", "twin": "gradflow-mini-en-alltoken"}, None),
    ("figures/twelve-blocks/probes/robustness", {"mini12-en": "gradflow-mini12-en",
                                                 "twin": "gradflow-mini12-en-alltoken"}, None),
    ("figures/objectives/probes", {"mask40": "gradflow-mini-en-mask40", "diffusion": "gradflow-mini-en-diffusion"},
     ["1500", "4500"]),  # the sizes of make objectives-probes (plan Part 2)
    ("figures/objectives/diffusion-v1/probes", {"diffusion": "gradflow-mini-en-diffusion"}, ["1500", "4500"]),
])
def test_the_committed_drop_tables_are_what_the_committed_runs_give(folder, models, sizes, tmp_path):
    from analyses.probes import robustness

    committed = robustness.ROOT / folder
    if not (committed / "last_layer_drops.csv").exists():
        pytest.skip(f"{folder} is not committed")
    for run in committed.iterdir():  # the runs linked, not copied; the tables written fresh beside them
        if run.is_dir():
            (tmp_path / run.name).symlink_to(run, target_is_directory=True)
    robustness.write_tables(str(tmp_path), models, ["brown-pos", "brown-propn"], list(robustness.FAMILIES),
                            sizes or list(robustness.SIZES))
    fresh, kept = pd.read_csv(tmp_path / "last_layer_drops.csv"), pd.read_csv(committed / "last_layer_drops.csv")
    pd.testing.assert_frame_equal(fresh, kept, rtol=1e-9, check_dtype=False)  # wall_s too: read from each run's meta
    assert (tmp_path / "last_layer_drops.md").read_text() == (committed / "last_layer_drops.md").read_text()
