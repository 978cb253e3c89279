"""Faults injected into `gradflow record` (issue 28): a full disk, a corrupt checkpoint, an input that vanishes
mid-run; and the invariants resuming relies on, as Hypothesis properties (merging accumulators in any split
equals one pass; a sequence's masking does not depend on batch size, padding, shard or world size)."""

from __future__ import annotations

import errno
import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradflow.cli import main
from gradflow.inputs.corpus import open_corpus
from gradflow.inputs.masking import BertMasking
from gradflow.inputs.pipeline import masked_batches
from gradflow.roles import ALL_ROLES, TOKEN_ROLES
from gradflow.runs.aggregate import SiteAggregator, SublayerAggregator
from gradflow.runs.checkpoint import latest_checkpoint, rank_dir
from gradflow.runs.files import SequenceWriter
from gradflow.runs.job import RoleTally
from test_resume import args, assert_same_run, interrupted, reference_run

PROPERTY = settings(max_examples=25, deadline=None)


@pytest.fixture
def reference(tmp_path_factory, tiny_mlm_dir) -> Path:
    return reference_run(tmp_path_factory, tiny_mlm_dir)  # the committed sample's first 24 windows


def test_full_disk_names_the_directory_and_keeps_the_checkpoint(tmp_path, reference, tiny_mlm_dir,
                                                                 monkeypatch, capsys):
    real = SequenceWriter.checkpoint
    calls = {"n": 0}

    def full(self):
        calls["n"] += 1
        if calls["n"] == 5:  # the third checkpoint's first table: two checkpoints (16 sequences) are durable
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self)

    monkeypatch.setattr(SequenceWriter, "checkpoint", full)
    out = tmp_path / "full"
    assert main(args(tiny_mlm_dir, None, out)) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "No space left on device" in err and "16 sequences" in err and "--resume" in err
    assert "Traceback" not in err
    assert latest_checkpoint(rank_dir(out, 0)).state["progress"]["sequences"] == 16
    monkeypatch.setattr(SequenceWriter, "checkpoint", real)
    assert main(args(tiny_mlm_dir, None, out, "--resume")) == 0
    assert_same_run(reference, out)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_checkpoint_is_refused_and_the_previous_used(damage, tmp_path, reference, tiny_mlm_dir,
                                                             monkeypatch):
    out = interrupted(tmp_path, tiny_mlm_dir, None, monkeypatch)
    newest = max(rank_dir(out, 0).glob("checkpoint-*.gfc"))
    data = bytearray(newest.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    newest.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="refused"):
        previous = latest_checkpoint(rank_dir(out, 0))
    assert previous.state["progress"]["sequences"] == 8 and previous.path != newest
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(args(tiny_mlm_dir, None, out, "--resume")) == 0
    assert_same_run(reference, out)


def test_vanished_input_is_a_clear_error_and_progress_is_kept(tmp_path, tiny_mlm_dir, tiny_corpus, monkeypatch,
                                                                capsys):
    from gradflow.runs import record_tables as record  # the per-sequence rows are made there

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = tiny_corpus.read_text().splitlines()
    for i in range(4):
        (corpus / f"{i}.txt").write_text("\n".join(lines[6 * i: 6 * i + 6]) + "\n")
    ref = tmp_path / "ref"
    assert main(args(tiny_mlm_dir, corpus, ref)) == 0
    last = corpus / "1.txt"  # read from about the 12th window on, after the first checkpoint
    kept = last.read_bytes()
    real, calls = record.sequence_rows, {"n": 0}

    def vanish(batch_record):
        calls["n"] += 1
        if calls["n"] == 1:
            last.unlink()
        return real(batch_record)

    monkeypatch.setattr(record, "sequence_rows", vanish)
    out = tmp_path / "run"
    assert main(args(tiny_mlm_dir, corpus, out)) == 2
    err = capsys.readouterr().err
    assert "could not read the corpus" in err and "--resume" in err and "Traceback" not in err, err
    meta = json.loads((out / "meta.json").read_text())
    assert meta["complete"] is False and meta["progress"]["sequences"] >= 8
    monkeypatch.setattr(record, "sequence_rows", real)
    last.write_bytes(kept)
    assert main(args(tiny_mlm_dir, corpus, out, "--resume")) == 0
    assert_same_run(ref, out)


# ---- properties -------------------------------------------------------------------------------------------------

def _site_record(seed: int, batch: int, length: int, sites: int = 3) -> SimpleNamespace:
    gen = torch.Generator().manual_seed(seed)
    roles = torch.randint(0, 6, (batch, length), generator=gen)
    grad = torch.rand(sites, batch, length, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(
        -6, 3, (sites, batch, length), generator=gen)
    grad[grad < 1e-5] = 0.0
    act = torch.rand(sites, batch, length, generator=gen, dtype=torch.float64) * 100
    return SimpleNamespace(roles=roles, grad_norm=grad, act_norm=act)


def _new_sites() -> SiteAggregator:
    return SiteAggregator(("a", "b", "c"), (0, 1, 1), ("out", "mid", "out"))


splits = st.lists(st.integers(1, 5), min_size=1, max_size=5)


@PROPERTY
@given(seeds=st.lists(st.integers(0, 10_000), min_size=2, max_size=8), cuts=splits, data=st.data())
def test_site_merge_in_any_split_equals_one_pass(seeds, cuts, data):
    records = [_site_record(s, 1 + s % 3, 2 + s % 5) for s in seeds]
    whole = _new_sites()
    for r in records:
        whole.add(r)
    parts, i = [], 0
    for cut in cuts + [len(records)]:
        part = _new_sites()
        for r in records[i: i + cut]:
            part.add(r)
        parts.append(part)
        i += cut
    order = data.draw(st.permutations(range(len(parts))))
    merged = _new_sites()
    for k in order:
        merged.merge(parts[k])
    np.testing.assert_array_equal(merged.count, whole.count)
    np.testing.assert_array_equal(merged.grad_hist, whole.grad_hist)
    np.testing.assert_array_equal(merged.act_hist, whole.act_hist)
    for name in ("grad_mean", "grad_m2", "act_mean", "act_m2"):
        np.testing.assert_allclose(getattr(merged, name), getattr(whole, name), rtol=1e-9, atol=1e-12)


def _sublayer_record(seed: int) -> SimpleNamespace:
    gen = np.random.default_rng(seed)
    subs = []
    for depth, sublayer in ((0, "attn.q"), (1, "ffn.in")):
        n = torch.tensor(gen.integers(0, 4, len(ALL_ROLES)), dtype=torch.float64)
        subs.append(SimpleNamespace(depth=depth, sublayer=sublayer, param="weight", n_positions=n,
                                    n_nonzero=torch.minimum(n, torch.tensor(gen.integers(0, 4, len(ALL_ROLES)))),
                                    magnitude_sum=torch.tensor(gen.random(len(ALL_ROLES))),
                                    contribution_norm=torch.tensor(gen.random(len(ALL_ROLES)))))
    return SimpleNamespace(sublayers=subs)


@PROPERTY
@given(seeds=st.lists(st.integers(0, 10_000), min_size=2, max_size=8), cut=st.integers(1, 7), reverse=st.booleans())
def test_sublayer_and_role_merge_in_any_split_equals_one_pass(seeds, cut, reverse):
    records = [_sublayer_record(s) for s in seeds]
    whole, head, tail = SublayerAggregator(), SublayerAggregator(), SublayerAggregator()
    for i, r in enumerate(records):
        whole.add(r)
        (head if i < cut else tail).add(r)
    first, second = (tail, head) if reverse else (head, tail)
    first.merge(second)
    assert set(first.sums) == set(whole.sums)
    for key, value in whole.sums.items():
        np.testing.assert_allclose(first.sums[key], value, rtol=1e-9, atol=1e-12)
    tallies = [RoleTally() for _ in range(3)]
    one = RoleTally()
    for i, seed in enumerate(seeds):
        roles = torch.randint(0, len(TOKEN_ROLES), (1 + seed % 3, 4), generator=torch.Generator().manual_seed(seed))
        one.add(roles)
        tallies[i % 3].add(roles)
    merged = RoleTally()
    for t in (tallies[::-1] if reverse else tallies):
        merged.merge(t)
    assert merged == one


@pytest.fixture(scope="module")
def tokenizer(tiny_mlm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_mlm_dir)


def _rows(tokenizer, texts, batch_size: int, world: int, max_length: int) -> dict[int, tuple]:
    rows = {}
    for rank in range(world):
        docs, _ = open_corpus(list(texts))
        for batch in masked_batches(tokenizer, docs, BertMasking(seed=3), max_length, batch_size, rank=rank,
                                    world_size=world):
            for b, index in enumerate(batch.sequence_index.tolist()):
                real = batch.attention_mask[b].bool()
                rows[index] = (batch.input_ids[b][real].tolist(), batch.roles[b][real].tolist())
    return rows


@PROPERTY
@given(batch_size=st.integers(1, 6), world=st.integers(1, 4), max_length=st.sampled_from([12, 24]))
def test_masking_of_a_sequence_is_independent_of_batching_and_sharding(tokenizer, tiny_corpus, batch_size, world,
                                                                       max_length):
    texts = tiny_corpus.read_text().splitlines()[:8]
    assert _rows(tokenizer, texts, batch_size, world, max_length) == _rows(tokenizer, texts, 1, 1, max_length)
