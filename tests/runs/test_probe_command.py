"""`gradflow probe`: labelled-file reading, exact word features, the job's tables, and bad input (exit 2)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from gradflow.cli.main import main
from gradflow.errors import TaskError
from gradflow.hooks.sites import SiteLayer
from gradflow.inputs.labelled import load_labelled, read_conll, read_jsonl
from gradflow.models import load_model
from gradflow.runs.probe import ProbeConfig, run_probes
from gradflow.runs.probe_features import (WordPooling, _Item, extract_split, pool_words, site_states,
                                          tokenised_words, word_pooling)
from gradflow.schema import PROBE_COLUMNS, PROBE_DIFFERENCE_COLUMNS, PROBE_DROP_COLUMNS, PROBE_WORD_COLUMNS
from tiny import FAMILIES, tiny_batch, tiny_model

WORDS = ["the", "progress", "of", "public", "credit", "is", "witnessed", "by", "a", "rise", "we", "must", "ensure",
         "that", "laws", "are", "executed", "congress", "will", "consider", "treasury", "nation", "year", "union"]
TAGS = {"the": "DET", "of": "ADP", "by": "ADP", "a": "DET", "that": "ADP", "is": "VERB", "are": "VERB",
        "will": "VERB", "must": "VERB", "we": "PRON"}


def _conll(path, sentences: int = 60, seed: int = 0):
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(sentences):
        for w in rng.choice(WORDS, size=int(rng.integers(3, 9))):
            lines.append(f"{w}\t{TAGS.get(str(w), 'NOUN')}")
        lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------ reading files
def test_conll_and_jsonl_read_the_same_sentences(tmp_path):
    conll = _conll(tmp_path / "a.conll", 5)
    sentences = read_conll(conll)
    rows = [{"tokens": list(w), "labels": list(lab)} for w, lab in zip(sentences.words, sentences.labels)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    assert read_jsonl(tmp_path / "a.jsonl") == sentences
    assert len(sentences) == 5 and sentences.num_words == sum(len(w) for w in sentences.words)


def test_single_file_is_split_by_whole_sentences(tmp_path):
    task = load_labelled(_conll(tmp_path / "a.conll", 50), seed=3)
    assert (len(task.train), len(task.validation), len(task.test)) == (40, 5, 5)
    everything = sorted(task.train.words + task.validation.words + task.test.words)
    assert everything == sorted(read_conll(tmp_path / "a.conll").words)


def test_malformed_conll_line_names_its_number(tmp_path):
    path = tmp_path / "bad.conll"
    path.write_text("the\tDET\ncat\tNOUN\n\nsat NOUN\n", encoding="utf-8")
    with pytest.raises(TaskError, match=r"bad.conll:4: expected 'word<TAB>label'"):
        read_conll(path)


def test_jsonl_with_fewer_labels_than_words_names_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"tokens": ["a"], "labels": ["DET"]}\n{"tokens": ["a", "b"], "labels": ["DET"]}\n', "utf-8")
    with pytest.raises(TaskError, match=r"bad.jsonl:2: 1 labels for 2 tokens"):
        read_jsonl(path)


# ------------------------------------------------------------------------------------ features
def test_first_subword_features_equal_the_models_hidden_states(tiny_mlm_dir, tmp_path):
    loaded = load_model(str(tiny_mlm_dir))
    sentences = read_conll(_conll(tmp_path / "a.conll", 6))
    labels = {lab: i for i, lab in enumerate(sorted({t for s in sentences.labels for t in s}))}
    feats = extract_split(loaded, sentences, labels, tmp_path, "test", dtype="float32", batch_size=4)
    last = [s for s in feats.features if s.endswith(".out")][-1]
    rows = []
    for ids, positions in tokenised_words(loaded.tokenizer, sentences, 128):
        with torch.no_grad():
            hidden = loaded.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        rows += [hidden[-1][0, p[0]] for p in positions if p]
    expected = torch.stack(rows).numpy()
    assert feats.features[last].shape == expected.shape
    np.testing.assert_allclose(np.asarray(feats.features[last]), expected, rtol=1e-5, atol=1e-5)
    assert feats.labels.size == sentences.num_words - feats.dropped


@pytest.mark.parametrize("family", FAMILIES)
def test_stopping_the_forward_after_the_last_site_keeps_every_state_bit_for_bit(family):
    """site_states skips what follows the last site (the MLM head); every site's state, mid points included,
    is the very tensor the whole forward gives, for every supported family."""
    model = tiny_model(family)
    sites = SiteLayer(model, None, mid=True)
    inputs = tiny_batch().model_inputs()
    early = site_states(model, sites, inputs)
    whole = site_states(model, sites, inputs, stop_early=False)
    assert list(early) and set(early) == set(whole) == set(sites.names)
    for name in sites.names:
        assert torch.equal(early[name], whole[name]), name


def test_gathered_first_subword_features_equal_the_pooling_matmul():
    """pool_words gathers the first sub-word's row: bit for bit a 0/1 matmul; mean pooling averages the sub-words."""
    batch = [_Item([2, 5, 6, 7, 3], [(0, 0, (1, 2)), (0, 1, ()), (0, 2, (3,))]), _Item([2, 8, 3], [(1, 0, (1,))])]
    hidden = torch.randn(2 * 5, 7, dtype=torch.float32)
    first, mean = word_pooling(batch, 5, "first"), word_pooling(batch, 5, "mean")
    assert first.keys == mean.keys == [(0, 0), (0, 2), (1, 0)] and first.weights is None
    onehot = torch.zeros(3, 10)
    onehot[torch.arange(3), first.rows] = 1.0
    assert first.rows.tolist() == [1, 3, 6]
    assert torch.equal(pool_words(hidden, first), onehot @ hidden)
    torch.testing.assert_close(pool_words(hidden, mean)[0], (hidden[1] + hidden[2]) / 2, rtol=0, atol=1e-6)
    assert torch.equal(pool_words(hidden, mean)[1:], hidden[[3, 6]])
    empty = word_pooling([_Item([2, 3], [(0, 0, ())])], 2, "first")
    assert isinstance(empty, WordPooling) and pool_words(torch.randn(2, 7), empty).shape == (0, 7)


def test_masked_regime_reads_the_masked_word(tiny_mlm_dir, tmp_path):
    loaded = load_model(str(tiny_mlm_dir))
    sentences = read_conll(_conll(tmp_path / "a.conll", 2))
    labels = {lab: i for i, lab in enumerate(sorted({t for s in sentences.labels for t in s}))}
    feats = extract_split(loaded, sentences, labels, tmp_path, "test", regime="masked", dtype="float32")
    ids, positions = next(iter(tokenised_words(loaded.tokenizer, sentences, 128)))
    copy = list(ids)
    for p in positions[1]:
        copy[p] = loaded.tokenizer.mask_token_id
    with torch.no_grad():
        hidden = loaded.model(input_ids=torch.tensor([copy]), output_hidden_states=True).hidden_states
    last = [s for s in feats.features if s.endswith(".out")][-1]
    np.testing.assert_allclose(np.asarray(feats.features[last][1]), hidden[-1][0, positions[1][0]].numpy(),
                               rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ the job
@pytest.fixture(scope="module")
def probe_run(tiny_mlm_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("probe")
    data = _conll(folder / "toy.conll", 80)
    run = run_probes(ProbeConfig(model=str(tiny_mlm_dir), task=str(data), out=str(folder / "out"),
                                 regimes=("unmasked", "masked"), n_resamples=200, cs=(0.1, 1.0)))
    return run


@pytest.mark.slow
def test_probe_tables_are_complete_and_consistent(probe_run):
    probes, drops = probe_run.probes, probe_run.drops
    assert tuple(probes.columns) == PROBE_COLUMNS and tuple(drops.columns) == PROBE_DROP_COLUMNS
    assert len(probes) == 2 * 3  # 2 regimes x (embeddings + 2 blocks)
    assert np.all((probes["ci_low"] <= probes["accuracy"]) & (probes["accuracy"] <= probes["ci_high"]))
    np.testing.assert_allclose(probes["selectivity"], probes["accuracy"] - probes["control_accuracy"])
    np.testing.assert_allclose(probes["compression"], probes["uniform_code_bits"] / probes["code_length_bits"])
    assert list(probes.loc[probes.regime == "unmasked", "depth_fraction"]) == [0.0, 0.5, 1.0]
    for row in drops.itertuples():
        assert row.ci_low <= row.last_layer_drop <= row.ci_high
    acc = probes[probes.regime == "unmasked"].set_index("layer")["accuracy"]
    drop = drops[(drops.regime == "unmasked") & (drops.metric == "accuracy")].iloc[0]
    assert drop.last_layer_drop == pytest.approx(acc[2] - max(acc[0], acc[1]))
    on_disk = pd.read_csv(probe_run.out / "probes.csv")
    assert len(on_disk) == len(probes)
    meta = json.loads((probe_run.out / "meta.json").read_text())
    assert meta["complete"] is True and meta["kind"] == "probe"
    assert meta["counts"]["unmasked"]["test"]["words"] == meta["counts"]["masked"]["test"]["words"]
    assert not list(probe_run.out.glob(".features*"))  # the feature files are removed


def test_interrupted_probe_keeps_rows_and_says_incomplete(tiny_mlm_dir, tmp_path, monkeypatch):
    import gradflow.runs.probe as job

    calls = {"n": 0}
    real = job.fit_probe

    def stop_on_fourth(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(job, "fit_probe", stop_on_fourth)
    data = _conll(tmp_path / "toy.conll", 40)
    with pytest.raises(KeyboardInterrupt):
        run_probes(ProbeConfig(model=str(tiny_mlm_dir), task=str(data), out=str(tmp_path / "out"), n_resamples=50,
                               cs=(1.0,), code_length=False))
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["complete"] is False and "KeyboardInterrupt" in meta["error"]
    assert len(pd.read_csv(tmp_path / "out" / "probes.csv")) == 1  # the one site fitted before the stop


# ------------------------------------------------------------------------------------ bad input: exit 2
def _exit(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


def test_unknown_task_exits_2(capsys, tmp_path, tiny_mlm_dir):
    code, err = _exit(capsys, ["probe", "--model", str(tiny_mlm_dir), "--task", "brown-sentiment", "--out",
                               str(tmp_path / "o")])
    assert code == 2 and err.startswith("gradflow: error: unknown task 'brown-sentiment'") and "\n" not in err
    assert not (tmp_path / "o").exists()


def test_malformed_label_file_exits_2_with_line_number(capsys, tmp_path, tiny_mlm_dir):
    bad = tmp_path / "bad.conll"
    bad.write_text("the\tDET\n\nthe\tDET\ncat NOUN\n", encoding="utf-8")
    code, err = _exit(capsys, ["probe", "--model", str(tiny_mlm_dir), "--task", str(bad), "--out", str(tmp_path / "o")])
    assert code == 2 and "bad.conll:4:" in err and "\n" not in err
    assert not (tmp_path / "o").exists()


def test_fewer_labels_than_words_exits_2(capsys, tmp_path, tiny_mlm_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": ["the", "cat"], "labels": ["DET"]}\n', encoding="utf-8")
    code, err = _exit(capsys, ["probe", "--model", str(tiny_mlm_dir), "--task", str(bad), "--out", str(tmp_path / "o")])
    assert code == 2 and "bad.jsonl:1: 1 labels for 2 tokens" in err


def test_empty_split_exits_2(capsys, tmp_path, tiny_mlm_dir):
    folder = tmp_path / "task"
    folder.mkdir()
    _conll(folder / "train.conll", 10)
    _conll(folder / "validation.conll", 3)
    (folder / "test.conll").write_text("\n\n", encoding="utf-8")
    code, err = _exit(capsys, ["probe", "--model", str(tiny_mlm_dir), "--task", str(folder), "--out",
                               str(tmp_path / "o")])
    assert code == 2 and "the test split has no sentences" in err
    assert not (tmp_path / "o").exists()


def test_model_without_tokenizer_exits_2(capsys, tmp_path, tiny_mlm_dir):
    from transformers import AutoModelForMaskedLM

    bare = tmp_path / "bare"
    AutoModelForMaskedLM.from_pretrained(tiny_mlm_dir).save_pretrained(bare)
    code, err = _exit(capsys, ["probe", "--model", str(bare), "--task", str(_conll(tmp_path / "a.conll", 20)),
                               "--out", str(tmp_path / "o")])
    assert code == 2 and "tokenizer" in err and "\n" not in err
    assert not (tmp_path / "o" / "meta.json").exists()


def test_compare_refuses_a_mix_of_probe_and_record_dirs(capsys, probe_run, tmp_path):
    record = tmp_path / "rec"
    record.mkdir()
    code, err = _exit(capsys, ["compare", str(probe_run.out), str(record), "--out", str(tmp_path / "c")])
    assert code == 2 and "cannot compare probe directories" in err


def test_compare_draws_probe_directories(capsys, probe_run, tmp_path):
    code, _ = _exit(capsys, ["compare", str(probe_run.out), str(probe_run.out), "--labels", "a", "b",
                             "--out", str(tmp_path / "c"), "--format", "png"])
    assert code == 0
    assert (tmp_path / "c" / "probes_toy.png").stat().st_size > 10_000
    both = pd.read_csv(tmp_path / "c" / "probes_compared.csv")
    assert set(both["label"]) == {"a", "b"}


def test_per_word_results_reproduce_the_tables_exactly(probe_run):
    words = pd.read_parquet(probe_run.out / "probe_words.parquet")
    assert tuple(words.columns) == PROBE_WORD_COLUMNS
    probes = probe_run.probes
    for (regime, layer), rows in words.groupby(["regime", "layer"]):
        accuracy = probes[(probes.regime == regime) & (probes.layer == layer)]["accuracy"].item()
        assert rows["correct"].mean() == accuracy  # the same words, the same probe: equal, not close
        assert len(rows) == probes[(probes.regime == regime) & (probes.layer == layer)]["n_tokens"].item()
        assert not rows.duplicated(["sentence", "word"]).any()


def test_compare_pairs_the_drops_of_probe_directories(capsys, probe_run, tmp_path):
    code = main(["compare", str(probe_run.out), str(probe_run.out), "--labels", "a", "b",
                 "--out", str(tmp_path / "c"), "--format", "png"])
    out = capsys.readouterr().out
    assert code == 0 and "last-layer accuracy drop, b - a: +0.0000 [+0.0000, +0.0000]" in out
    table = pd.read_csv(tmp_path / "c" / "probe_drop_differences.csv")
    assert tuple(table.columns) == PROBE_DIFFERENCE_COLUMNS
    assert list(table["regime"]) == ["unmasked", "masked"] and (table[["difference", "ci_low", "ci_high"]] == 0).all().all()


def test_paired_drop_difference_uses_only_the_words_both_kept(probe_run, tmp_path):
    import shutil

    from gradflow.analysis.probe_tables import probe_drop_differences
    from gradflow.analysis.probes import drop_difference_ci, last_layer_drop

    other = tmp_path / "other"
    shutil.copytree(probe_run.out, other)
    words = pd.read_parquet(other / "probe_words.parquet")
    rng = np.random.default_rng(0)
    flipped = words.assign(correct=words["correct"] ^ (rng.random(len(words)) < 0.2))
    kept = flipped[flipped["word"] != 0]  # as if another tokenizer had cut every first word off
    kept.to_parquet(other / "probe_words.parquet", index=False)
    result = probe_drop_differences([probe_run.out, other], ["base", "other"], n_resamples=300)
    row = result.table[result.table.regime == "unmasked"].iloc[0]
    base = words[(words.regime == "unmasked") & (words.word != 0)]
    mine = kept[kept.regime == "unmasked"]
    layers = sorted(base["layer"].unique())
    expected = (last_layer_drop([mine[mine.layer == k]["correct"].mean() for k in layers])
                - last_layer_drop([base[base.layer == k]["correct"].mean() for k in layers]))
    assert row.difference == pytest.approx(expected, abs=1e-12)
    assert row.n_words == len(mine) // len(layers) and row.ci_low <= row.difference <= row.ci_high
    assert row.ci_high - row.ci_low > 0
    point, low, high = drop_difference_ci([np.ones(4, bool), np.zeros(4, bool)], [np.ones(4, bool)] * 3,
                                          np.array([0, 0, 1, 1]), n_resamples=50)
    assert (point, low, high) == (-1.0, -1.0, -1.0)  # a: last layer 0 vs best 1; b: no drop
    (other / "probe_words.parquet").unlink()
    missing = probe_drop_differences([probe_run.out, other], ["base", "other"])
    assert missing.table.empty and "has no probe_words.parquet" in missing.notes[0]


def test_each_task_is_paired_with_its_own_baseline(probe_run, tmp_path):
    import shutil

    from gradflow.analysis.probe_tables import probe_drop_differences

    copies = []
    for name, task in (("pos-b", None), ("ner-a", "other-task"), ("ner-b", "other-task")):
        shutil.copytree(probe_run.out, tmp_path / name)
        if task:
            meta = json.loads((tmp_path / name / "meta.json").read_text())
            meta["task"]["name"] = task
            (tmp_path / name / "meta.json").write_text(json.dumps(meta))
        copies.append(tmp_path / name)
    result = probe_drop_differences([probe_run.out, *copies], ["pos-a", "pos-b", "ner-a", "ner-b"], n_resamples=50)
    pairs = set(zip(result.table["label"], result.table["baseline"]))
    assert pairs == {("pos-b", "pos-a"), ("ner-b", "ner-a")} and result.notes == ()
    assert set(result.table["task"]) == {"toy", "other-task"}


def test_report_of_a_probe_directory_draws_its_figure(capsys, probe_run, tmp_path):
    assert main(["report", str(probe_run.out), "--out", str(tmp_path / "r"), "--format", "png"]) == 0
    assert (tmp_path / "r" / "probes_toy.png").stat().st_size > 10_000
