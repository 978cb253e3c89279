"""A long .jsonl record's text field is decoded as it streams in: the text, windows and errors of ``json.loads``.

The decoder (:func:`gradflow.inputs.jsonl_text.record_text`) is checked against ``json.loads`` on
records cut at arbitrary points (inside escapes, between the halves of surrogate pairs) and on
mutated records (refused exactly when ``json.loads`` refuses them); the reader's windows against
the whole-record reference of ``test_streaming_corpus`` with reads and pieces forced tiny.
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradflow.errors import CorpusError
from gradflow.inputs import corpus, streaming
from gradflow.inputs.corpus import read_documents
from gradflow.inputs.jsonl_text import record_text
from test_streaming_corpus import (
    FAMILIES,
    _build,
    _lines,
    _long_text,
    _reference_documents,
    _reference_windows,
    _windows,
)


@pytest.fixture(scope="module", params=FAMILIES)
def tokenizer(request, tiny_mlm_dir):
    return _build(request.param, tiny_mlm_dir)


@pytest.fixture
def tiny_pieces(monkeypatch):
    """Every line of 64 bytes or more streamed, read 37 bytes at a time, tokenised in 37-character pieces."""
    for name in ("LONG_LINE_BYTES", "READ_BYTES", "PIECE_CHARS"):
        monkeypatch.setattr(streaming, name, 64 if name == "LONG_LINE_BYTES" else 37)


PROPERTY = settings(max_examples=150, deadline=None)
TRICKY = ["😀", "\ud83d", "\ude00", "\ud83d\ude00", '"', "\\", "\\u", "\n", "\t", "\x00", "\x1f", "é", "/", " ",
          "a", "text", "{", "}"]
"""Pieces of text that make escapes, surrogate pairs (whole and lone) and quotes dense."""
texts = st.lists(st.one_of(st.sampled_from(TRICKY), st.text(max_size=6)), max_size=30).map("".join)
others = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | texts,
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                      max_leaves=8)


def _cut(line: str, cuts: list[int]) -> Iterator[str]:
    at = 0
    for cut in sorted(c % (len(line) + 1) for c in cuts):
        yield line[at:cut]
        at = cut
    yield line[at:]


def _record(before: dict, text: str, after: dict, ascii_only: bool) -> str:
    fields = {**{k: v for k, v in before.items() if k != "text"}, "text": text}
    fields.update((k, v) for k, v in after.items() if k not in fields)
    return json.dumps(fields, ensure_ascii=ascii_only)


@pytest.mark.slow
@PROPERTY
@given(st.dictionaries(texts, others, max_size=3), texts, st.dictionaries(texts, others, max_size=3),
       st.booleans(), st.lists(st.integers(0, 10_000), max_size=12))
def test_the_text_of_a_record_cut_anywhere(before, text, after, ascii_only, cuts):
    line = _record(before, text, after, ascii_only)
    chunks = list(record_text(_cut(line, cuts), "r, line 1"))
    assert "".join(chunks) == json.loads(line)["text"]
    assert all(chunks)


class _Object(list):
    """A JSON object as its (key, value) pairs (duplicates kept)."""


def _expected(line: str) -> str | None:
    """The text json.loads gives a record, or None where it refuses it (or the stream must: a second text)."""
    try:
        record = json.loads(line, object_pairs_hook=_Object)
    except ValueError:
        return None
    if not isinstance(record, _Object):
        return None
    values = [v for k, v in record if k == "text"]
    strings = [i for i, v in enumerate(values) if isinstance(v, str)]
    return values[-1] if strings == [len(values) - 1] else None


def _scanned(line: str, cuts: list[int]) -> str | None:
    try:
        return "".join(record_text(_cut(line, cuts), "r, line 1"))
    except CorpusError as err:
        assert str(err).startswith("r, line 1: ")
        return None


@PROPERTY
@given(st.dictionaries(texts, others, max_size=2), texts, st.booleans(),
       st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(["", *'{}[]",:\\ u0tn1-eE.d8'])), min_size=1,
                max_size=3), st.lists(st.integers(0, 10_000), max_size=6))
def test_a_mutated_record_is_refused_exactly_when_json_loads_refuses_it(before, text, ascii_only, edits, cuts):
    line = _record(before, text, {}, ascii_only)
    for at, char in edits:  # delete ("") or insert a character
        at %= len(line)
        line = line[:at] + char + line[at + (char == ""):]
    assert _scanned(line, cuts) == _expected(line)


@pytest.mark.parametrize("line", ['{"text": "a', '{"text": 1}', '{"a": 1}', "[1]", '"text"', '{"text": "a"} x',
                                  '{"text": "a\\x"}', '{"text": "a\\ud83', '{"t": 01, "text": "a"}', '{"text": "a",}',
                                  '{"a": [1,], "text": "b"}', '{"text": "ok"', '{"text": "a", "text": "b"}'])
def test_bad_records_get_one_sentence(line):
    with pytest.raises(CorpusError, match=r"^c.jsonl, line 4: [^\n]*\.$") as err:
        list(record_text([line], "c.jsonl, line 4"))
    assert "Traceback" not in str(err.value)


def test_memory_does_not_grow_with_the_text():
    """A 32 MiB record, nearly all text: the decoder holds a few pieces, never the text."""
    block = json.dumps("the nation's “union” \\ \n 😀 é " * 10_000)[1:-1]
    pieces = 32 * (1 << 20) // len(block)

    def line() -> Iterator[str]:
        yield '{"id": 7, "text": "'
        for _ in range(pieces):
            yield block
        yield '", "meta": {"source": "synthetic"}}'

    chars = 0
    tracemalloc.start()
    try:
        for chunk in record_text(line(), "big.jsonl, line 1"):
            chars += len(chunk)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert chars == pieces * len(json.loads(f'"{block}"'))
    assert peak < 8 * len(block) < (1 << 20) * 32 / 4  # measured: 2.9 MB (5 blocks) for any record length


def _jsonl(tmp_path, records: list[dict], ascii_only: bool = True):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=ascii_only) + "\n" for r in records), encoding="utf-8")
    return path


def test_long_records_give_the_windows_of_the_whole_record(tokenizer, tiny_pieces, tmp_path):
    noisy = _long_text(300, seed=4).replace("—", "\n\t—\"\\").replace("日本", "日本😀")
    records = [{"id": 1, "text": _long_text(300, seed=1)}, {"text": "   ", "n": [1, 2.5, None]},
               {"text": "a short one"}, {"meta": {"tags": ["x", {"y": "z \\ \""}]}, "text": noisy, "end": True},
               {"text": " \n\t " * 40}, {"text": _long_text(50), "id": 9}]
    for ascii_only in (True, False):
        path = _jsonl(tmp_path, records, ascii_only)
        want = _reference_windows(tokenizer, _reference_documents(path, jsonl=True))
        assert _windows(tokenizer, read_documents(path)) == want
        assert want[1].split_documents >= 3


@pytest.mark.slow
def test_the_committed_sample_as_records(tokenizer, tiny_pieces, tmp_path):
    lines = _lines()[:24]
    records = [{"text": line, "line": k} for k, line in enumerate(lines) if line.strip()]
    records.append({"text": "\n".join(lines[:12])})
    path = _jsonl(tmp_path, records)
    assert _windows(tokenizer, read_documents(path)) == _reference_windows(tokenizer,
                                                                          _reference_documents(path, jsonl=True))


def test_a_bad_long_record_names_its_line(tiny_mlm_dir, tiny_pieces, tmp_path):
    wordpiece = _build("wordpiece", tiny_mlm_dir)
    good = json.dumps({"text": _long_text(100)})
    for bad, what in [(good[:-40], "not closed"), (good[:-1] + ', "text": "again"}', "two \"text\" fields"),
                      (good.replace('"text"', '"body"'), "no string \"text\""), (good + " {}", "more after")]:
        path = tmp_path / "bad.jsonl"
        path.write_text('{"text": "fine"}\n' + bad + "\n", encoding="utf-8")
        with pytest.raises(CorpusError, match=f"bad.jsonl, line 2: .*{what}"):
            _windows(wordpiece, read_documents(path))


def test_limit_reads_only_what_it_needs(tiny_mlm_dir, monkeypatch, tmp_path):
    monkeypatch.setattr(streaming, "PIECE_CHARS", 200)
    monkeypatch.setattr(streaming, "LONG_LINE_BYTES", 1000)
    monkeypatch.setattr(streaming, "READ_BYTES", 100)
    wordpiece = _build("wordpiece", tiny_mlm_dir)
    path = _jsonl(tmp_path, [{"meta": "x" * 500, "text": _long_text(20_000).replace(" ", " \n", 500)}])
    read = []

    def counted(handle):
        for chunk in streaming.file_chunks(handle):
            read.append(len(chunk))
            yield chunk

    monkeypatch.setattr(corpus, "file_chunks", counted)
    got, counts = _windows(wordpiece, read_documents(path), limit=5)
    assert got == _reference_windows(wordpiece, _reference_documents(path, jsonl=True), limit=5)[0]
    assert counts.windows == 5 and counts.split_documents == 1
    assert 0 < sum(read) <= 4_000 < path.stat().st_size // 20
