"""inputs.pipeline: the same batches as the hand-written loop it replaced; shards partition the corpus."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradflow.inputs.corpus import (
    CorpusCounts,
    Document,
    batches,
    default_texts,
    iter_windows,
    open_corpus,
    read_documents,
    shard,
)
from gradflow.inputs.masking import BertMasking, MaskedBatch, mask_batch
from gradflow.inputs.pipeline import masked_batches

FIELDS = ("input_ids", "original_ids", "labels", "roles", "attention_mask", "sequence_index")
MAX_LENGTH = 24


@pytest.fixture(scope="module")
def tokenizer(tiny_mlm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_mlm_dir)


def _old_loop(tokenizer, corpus: Path, policy, batch_size: int, limit=None, rank=0, world=1, counts=None):
    """The loop record, diagnose and evaluation each spelled out before the pipeline."""
    windows = iter_windows(tokenizer, read_documents(corpus), MAX_LENGTH, counts or CorpusCounts(), limit)
    for group in batches(shard(windows, rank, world), batch_size):
        yield mask_batch(tokenizer, policy=policy, indices=[w.sequence_index for w in group],
                         encodings=[w.encoding for w in group], max_length=MAX_LENGTH)


def _same(a: MaskedBatch, b: MaskedBatch) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS)


@pytest.mark.parametrize("batch_size, limit, rank, world, whole_word", [
    (4, None, 0, 1, False), (3, 10, 0, 1, True), (5, None, 1, 2, False), (2, 17, 2, 3, False),
])
def test_same_batches_as_the_old_loop(tokenizer, tiny_corpus, batch_size, limit, rank, world, whole_word):
    policy = BertMasking(rate=0.3, whole_word=whole_word, seed=7)
    old_counts, new_counts = CorpusCounts(), CorpusCounts()
    old = list(_old_loop(tokenizer, tiny_corpus, policy, batch_size, limit, rank, world, old_counts))
    new = list(masked_batches(tokenizer, read_documents(tiny_corpus), policy, MAX_LENGTH, batch_size, limit=limit,
                              rank=rank, world_size=world, counts=new_counts))
    assert len(old) == len(new) > 0
    assert all(_same(a, b) for a, b in zip(old, new))
    assert old_counts == new_counts


def _rows(batches_: list[MaskedBatch]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Sequence index -> (input ids, roles) without padding."""
    out = {}
    for batch in batches_:
        for b, index in enumerate(batch.sequence_index.tolist()):
            n = int(batch.attention_mask[b].sum())
            out[index] = (batch.input_ids[b, :n], batch.roles[b, :n])
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_shards_partition_the_corpus_and_keep_each_masking(tokenizer, tiny_corpus, world):
    policy = BertMasking(seed=1)
    counts = CorpusCounts()
    whole = _rows(list(masked_batches(tokenizer, read_documents(tiny_corpus), policy, MAX_LENGTH, 4, counts=counts)))
    assert sorted(whole) == list(range(counts.windows))
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for rank in range(world):
        part = _rows(list(masked_batches(tokenizer, read_documents(tiny_corpus), policy, MAX_LENGTH, 3, rank=rank,
                                         world_size=world)))
        assert all(index % world == rank for index in part)
        assert not set(part) & set(seen)
        seen.update(part)
    assert sorted(seen) == sorted(whole)
    for index, (ids, roles) in whole.items():
        assert torch.equal(seen[index][0], ids) and torch.equal(seen[index][1], roles)


def test_limit_counts_windows_before_sharding(tokenizer, tiny_corpus):
    got = [i for rank in range(2) for b in masked_batches(tokenizer, read_documents(tiny_corpus), BertMasking(),
                                                           MAX_LENGTH, 4, limit=7, rank=rank, world_size=2)
           for i in b.sequence_index.tolist()]
    assert sorted(got) == list(range(7))


def test_nothing_is_read_until_iterated(tokenizer):
    read: list[int] = []

    def documents():
        for i, text in enumerate(["the nation", "the union"]):
            read.append(i)
            yield Document(i, text, "<test>", i + 1)

    stream = masked_batches(tokenizer, documents(), BertMasking(), MAX_LENGTH, 8)
    assert read == []
    assert len(next(stream).sequence_index) == 2 and read == [0, 1]


def test_open_corpus_forms(tmp_path):
    docs, source = open_corpus(["the nation", "  ", "the union"])
    assert [d.text for d in docs] == ["the nation", "the union"] and source == "<3 texts>"
    path = tmp_path / "c.txt"
    path.write_text("a\n\nb\n", encoding="utf-8")
    docs, source = open_corpus(path)
    assert [d.text for d in docs] == ["a", "b"] and source == str(path)
    docs, source = open_corpus(None)
    assert source == default_texts() and Path(source).is_file() and next(docs).text


def test_default_texts_still_importable_from_the_record_job():
    from gradflow.runs.record import default_texts as from_record

    assert from_record() == default_texts()
