"""The probe feature cache (gradflow/runs/feature_cache.py, ``gradflow probe --feature-cache``).

A run served from the cache writes byte-identical tables to a run that extracts everything; validation and test
are extracted once for runs that differ only in the training size; another model or setting gets another entry.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from gradflow.inputs.labelled import read_conll
from gradflow.models import load_model
from gradflow.runs import feature_cache
from gradflow.runs.probe import ProbeConfig, run_probes
from gradflow.runs.probe_features import extract_split


def _run(model: Path, task: Path, out: Path, train_limit: int, cache: Path | None):
    return run_probes(ProbeConfig(model=str(model), task=str(task), out=str(out), limit=8, train_limit=train_limit,
                                  n_resamples=30, code_length=False,
                                  feature_cache=str(cache) if cache else None))


def _entries(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir() if (p / feature_cache.COMPLETE).is_file()}


def test_cached_runs_write_the_tables_of_uncached_ones(tiny_mlm_dir, toy_task, tmp_path):
    cache = tmp_path / "cache"
    first = _run(tiny_mlm_dir, toy_task, tmp_path / "a", 20, cache)
    assert len(_entries(cache)) == 3  # train, validation, test
    second = _run(tiny_mlm_dir, toy_task, tmp_path / "b", 30, cache)
    assert len(_entries(cache)) == 4  # only the new training split was extracted
    plain = _run(tiny_mlm_dir, toy_task, tmp_path / "c", 30, None)
    for name in ("probes.csv", "probe_drops.csv"):
        assert (second.out / name).read_bytes() == (plain.out / name).read_bytes(), name
    pd.testing.assert_frame_equal(pd.read_parquet(second.out / "probe_words.parquet"),
                                  pd.read_parquet(plain.out / "probe_words.parquet"))
    assert first.probes.shape == second.probes.shape
    meta = json.loads((second.out / "meta.json").read_text())
    assert meta["options"]["feature_cache"] == str(cache) and meta["complete"] is True
    assert not [p for p in cache.iterdir() if p.name.startswith(".partial-")]
    assert not list((second.out).glob(".features-*"))  # nothing left in the run directory


def test_the_key_follows_the_weights_the_rows_and_the_settings(tiny_mlm_dir, tmp_path):
    loaded = load_model(str(tiny_mlm_dir))
    digest = feature_cache.model_digest(loaded.model)
    assert digest == feature_cache.model_digest(load_model(str(tiny_mlm_dir)).model)
    rows = [([2, 5, 3], [(0, 0, (1,))])]
    key = feature_cache.feature_key(digest, rows, {"pooling": "first"})
    assert key == feature_cache.feature_key(digest, [([2, 5, 3], [(0, 0, (1,))])], {"pooling": "first"})
    assert key != feature_cache.feature_key(digest, [([2, 6, 3], [(0, 0, (1,))])], {"pooling": "first"})
    assert key != feature_cache.feature_key(digest, rows, {"pooling": "mean"})
    with torch.no_grad():
        next(loaded.model.parameters()).view(-1)[0] += 1e-6
    assert feature_cache.model_digest(loaded.model) != digest


def test_a_cached_split_is_bit_for_bit_the_extracted_one_and_a_partial_entry_is_ignored(tiny_mlm_dir, toy_task,
                                                                                          tmp_path):
    loaded = load_model(str(tiny_mlm_dir))
    sentences = read_conll(toy_task)
    labels = {lab: i for i, lab in enumerate(sorted({t for s in sentences.labels for t in s}))}
    plain = extract_split(loaded, sentences, labels, tmp_path, "test", batch_size=4)
    cache = tmp_path / "cache"
    (cache / ".partial-stale-1").mkdir(parents=True)  # a killed run's leftovers are never read
    made = extract_split(loaded, sentences, labels, tmp_path / "unused", "test", batch_size=4, cache=cache)
    read = extract_split(loaded, sentences, labels, tmp_path / "unused", "test", batch_size=4, cache=cache)
    assert len(_entries(cache)) == 1 and not (tmp_path / "unused").exists()
    for features in (made, read):
        assert features.features.keys() == plain.features.keys()
        for site in plain.features:
            assert np.array_equal(np.asarray(features.features[site]), np.asarray(plain.features[site])), site
        assert np.array_equal(features.labels, plain.labels) and np.array_equal(features.sentence, plain.sentence)
        assert features.word_types == plain.word_types and features.dropped == plain.dropped
    other = extract_split(loaded, sentences, labels, tmp_path, "t2", batch_size=5, cache=cache)
    assert len(_entries(cache)) == 2 and np.array_equal(other.labels, plain.labels)  # another batch size, its own


def test_the_sweep_ignores_the_cache_option_when_it_resumes(tmp_path, monkeypatch):
    from analyses.probes import run

    monkeypatch.setattr(run, "ROOT", tmp_path)
    command = ["probe", "--model", "m", "--feature-cache", "build/probe-features", "--out", "o"]
    (tmp_path / "o").mkdir()
    meta = {"complete": True, "command": "gradflow probe --model m --out o"}  # a run made before the option
    (tmp_path / "o" / "meta.json").write_text(json.dumps(meta))
    assert run.finished(command)
    assert run.without_feature_cache(["a", "--feature-cache=x", "b", "--feature-cache", "y", "c"]) == ["a", "b", "c"]
    meta["command"] = "gradflow probe --model other --out o"
    (tmp_path / "o" / "meta.json").write_text(json.dumps(meta))
    assert not run.finished(command)
