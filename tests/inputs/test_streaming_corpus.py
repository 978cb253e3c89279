"""Long documents read and tokenised in bounded pieces give exactly the windows of the whole-document reader.

The reference below is the reader as it was before streaming (a file's lines decoded whole, every
document tokenised whole); pieces, read chunks and the long-line threshold are forced tiny so that
every boundary case occurs many times.
"""

from __future__ import annotations

import io
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gradflow.errors import CorpusError
from gradflow.inputs import streaming
from gradflow.inputs.corpus import CorpusCounts, Document, default_texts, document_windows, iter_windows, read_documents
from gradflow.inputs.streaming import read_lines, streamable

MINI_EN = Path(__file__).resolve().parents[2] / "src" / "gradflow" / "models" / "gradflow-mini-en"
MAX_LENGTH = 24
FAMILIES = ["wordpiece", "mini-en", "bytelevel", "unigram", "prepend"]


def _reference_documents(path: Path, jsonl: bool = False) -> Iterator[Document]:
    """The reader before streaming: binary lines, each decoded whole; blank lines skipped."""
    files = sorted(f for f in path.rglob("*.txt")) if path.is_dir() else [path]
    index = 0
    for f in files:
        with open(f, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                try:
                    line = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as err:
                    raise CorpusError(f"{f}, line {number}: bytes that are not valid UTF-8 ({err.reason} at byte "
                                      f"{err.start}). gradflow reads UTF-8 text only: convert the file (e.g. "
                                      "`iconv -f latin1 -t utf-8`) or remove the line.") from None
                text = json.loads(line)["text"] if jsonl and line.strip() else line
                if text.strip():
                    yield Document(index, text, str(f), number)
                    index += 1


def _reference_windows(tokenizer, documents, limit=None):
    counts, out, sequence = CorpusCounts(), [], 0
    for doc in documents:
        counts.documents += 1
        encodings = document_windows(tokenizer, doc, MAX_LENGTH)
        if not encodings:
            counts.skipped_empty_documents += 1
            continue
        counts.split_documents += len(encodings) > 1
        for w, encoding in enumerate(encodings):
            if limit is not None and sequence >= limit:
                return out, counts
            counts.windows += 1
            out.append((sequence, doc.index, w, encoding))
            sequence += 1
    return out, counts


def _windows(tokenizer, documents, limit=None):
    counts = CorpusCounts()
    got = [(w.sequence_index, w.document_index, w.window_index, w.encoding)
           for w in iter_windows(tokenizer, documents, MAX_LENGTH, counts, limit)]
    return got, counts


def _lines() -> list[str]:
    return Path(default_texts()).read_text(encoding="utf-8").splitlines()


def _build(family: str, tiny_mlm_dir: Path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if family == "wordpiece":
        return AutoTokenizer.from_pretrained(tiny_mlm_dir)
    if family == "mini-en":
        return AutoTokenizer.from_pretrained(MINI_EN)
    lines = _lines()[:300]
    if family == "bytelevel":
        from tokenizers import ByteLevelBPETokenizer
        from tokenizers.processors import RobertaProcessing

        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(lines, vocab_size=400, min_frequency=1,
                                special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
        bpe._tokenizer.post_processor = RobertaProcessing(("</s>", 2), ("<s>", 0))
        return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>",
                                       cls_token="<s>", sep_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                       mask_token="<mask>")
    from tokenizers import SentencePieceUnigramTokenizer, normalizers
    from tokenizers.processors import TemplateProcessing

    unigram = SentencePieceUnigramTokenizer()
    unigram.train_from_iterator(lines, vocab_size=300, special_tokens=["<pad>", "</s>", "<unk>", "<mask>"],
                                unk_token="<unk>")
    unigram._tokenizer.post_processor = TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    if family == "prepend":  # a Llama-style conversion: "▁" prepended to whatever text it is given
        unigram._tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                                              normalizers.Replace(" ", "▁")])
        unigram._tokenizer.pre_tokenizer = None
    return PreTrainedTokenizerFast(tokenizer_object=unigram._tokenizer, eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", mask_token="<mask>")


@pytest.fixture(scope="module", params=FAMILIES)
def tokenizer(request, tiny_mlm_dir):
    return _build(request.param, tiny_mlm_dir)


@pytest.fixture
def tiny_pieces(monkeypatch):
    """Every line of 64 bytes or more streamed, read 37 bytes at a time, tokenised in 37-character pieces."""
    monkeypatch.setattr(streaming, "LONG_LINE_BYTES", 64)
    monkeypatch.setattr(streaming, "READ_BYTES", 37)
    monkeypatch.setattr(streaming, "PIECE_CHARS", 37)


def _long_text(words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    vocab = ["the", "Nation", "union's", "1787", "3.14", "naïve", "café", "—", "“quoted”", "don't", "U.S.",
             "a-b", "日本", "x\u3000y", "Ünïcödé", "[MASK]", "<s>", "!!", "(x)", "$12,345", "e\u0301t\u00e9"]
    spaces = [" "] * 12 + ["  ", "\t", " \t ", "   "]
    return "".join(rng.choice(vocab) + rng.choice(spaces) for _ in range(words)).rstrip()


def test_the_probe_sorts_tokenizers(tokenizer):
    name = type(tokenizer.backend_tokenizer.normalizer).__name__
    prepends = "Prepend" in repr(tokenizer.backend_tokenizer.normalizer)
    assert (streamable(tokenizer) is None) == prepends, name


@pytest.mark.slow
def test_the_committed_sample_in_tiny_pieces(tokenizer, tiny_pieces, tmp_path):
    corpus = tmp_path / "sample.txt"
    lines = _lines()[:40]
    corpus.write_text("\n".join(lines[:20]) + "\n\n" + " ".join(lines[20:]) + "\r\n", encoding="utf-8")
    want = _reference_windows(tokenizer, _reference_documents(corpus))
    assert _windows(tokenizer, read_documents(corpus)) == want
    assert want[1].split_documents > 0


@pytest.mark.slow
@pytest.mark.parametrize("words, piece", [(2_000, 37), (200_000, 997)])
def test_one_long_line(tokenizer, monkeypatch, tmp_path, words, piece):
    if streamable(tokenizer) is None:  # the whole-document path (slow on 200k words): a 20k-word line checks it
        words = min(words, 20_000)
    monkeypatch.setattr(streaming, "PIECE_CHARS", piece)
    corpus = tmp_path / "long.txt"
    corpus.write_text("short line first\n" + _long_text(words) + "\nand a last one\n", encoding="utf-8")
    want = _reference_windows(tokenizer, _reference_documents(corpus))
    got = _windows(tokenizer, read_documents(corpus))
    assert len(got[0]) == len(want[0]) > words // 20
    assert got == want


def test_jsonl_and_a_directory(tokenizer, tiny_pieces, tmp_path):
    records = [{"text": _long_text(300, seed=1)}, {"text": "   "}, {"text": "a short one"}, {"text": _long_text(50)}]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps(r, ensure_ascii=k % 2 == 0) for k, r in enumerate(records)) + "\n",
                     encoding="utf-8")
    assert _windows(tokenizer, read_documents(jsonl)) == _reference_windows(tokenizer,
                                                                           _reference_documents(jsonl, jsonl=True))
    folder = tmp_path / "dir"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text(_long_text(400, seed=2) + "\n" + " " * 100 + "\n", encoding="utf-8")
    (folder / "sub" / "a.txt").write_text("one\n\n" + _long_text(200, seed=3), encoding="utf-8")
    assert _windows(tokenizer, read_documents(folder)) == _reference_windows(tokenizer, _reference_documents(folder))


def test_standard_input(tiny_mlm_dir, tiny_pieces, monkeypatch, tmp_path):
    tokenizer = _build("wordpiece", tiny_mlm_dir)
    corpus = tmp_path / "c.txt"
    corpus.write_text(_long_text(500) + "\nthe nation\n", encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(corpus.read_bytes())))
    assert _windows(tokenizer, read_documents("-")) == _reference_windows(tokenizer, _reference_documents(corpus))


@pytest.mark.parametrize("bad", [b"\xe2\x82x", b"\xff", b"\xe2\x82\n", b"\xe2"])
def test_malformed_utf8_across_a_chunk_boundary(tiny_mlm_dir, tiny_pieces, tmp_path, bad):
    tokenizer = _build("wordpiece", tiny_mlm_dir)
    for at in range(30, 40):  # the bad bytes start before, on and after the 37-byte read boundary
        corpus = tmp_path / f"bad{at}.txt"
        corpus.write_bytes(b"fine\n" + b"word " * 40 + b"x" * at + bad + b" more words here" * 9 * (bad != b"\xe2"))
        with pytest.raises(CorpusError) as want:
            _reference_windows(tokenizer, _reference_documents(corpus))
        with pytest.raises(CorpusError) as got:
            _windows(tokenizer, read_documents(corpus))
        assert str(got.value) == str(want.value) and "line 2" in str(got.value)


def test_limit_reads_only_what_it_needs(tiny_mlm_dir, monkeypatch):
    monkeypatch.setattr(streaming, "PIECE_CHARS", 200)
    monkeypatch.setattr(streaming, "LONG_LINE_BYTES", 1000)
    tokenizer = _build("wordpiece", tiny_mlm_dir)
    text = (_long_text(20_000) + "\n").encode("utf-8")
    read = []

    def chunks():
        for start in range(0, len(text), 100):
            read.append(start)
            if start > 3_000:
                raise AssertionError("read past what the limit needs")
            yield text[start:start + 100]

    documents = (Document(i, line if isinstance(line, str) else "", "<gen>", number,
                          None if isinstance(line, str) else line)
                 for i, (number, line) in enumerate(read_lines(chunks(), "<gen>")))
    got, counts = _windows(tokenizer, documents, limit=5)
    whole = Document(0, text.decode().rstrip("\n"), "<gen>", 1)
    assert got == _reference_windows(tokenizer, [whole], limit=5)[0]
    assert counts.windows == 5 and counts.split_documents == 1 and 0 < max(read) <= 3_000


def test_short_lines_keep_the_whole_document_path(tiny_mlm_dir, tmp_path, monkeypatch):
    tokenizer = _build("wordpiece", tiny_mlm_dir)
    called = []
    monkeypatch.setattr(streaming, "content_tokens", lambda *a, **k: called.append(1))
    docs = list(read_documents(default_texts()))
    assert all(not d.streamed for d in docs)
    assert _windows(tokenizer, iter(docs)) == _reference_windows(tokenizer, _reference_documents(Path(default_texts())))
    assert called == []


def test_text_without_spaces_grows_its_piece(tiny_mlm_dir, tiny_pieces, tmp_path):
    tokenizer = _build("mini-en", tiny_mlm_dir)
    corpus = tmp_path / "cjk.txt"
    corpus.write_text("日本語の文章、" * 300 + " then some words at the end\n", encoding="utf-8")
    assert _windows(tokenizer, read_documents(corpus)) == _reference_windows(tokenizer, _reference_documents(corpus))


def test_in_memory_long_texts_are_streamed(tiny_mlm_dir, tiny_pieces):
    from gradflow.inputs.corpus import open_corpus

    tokenizer = _build("wordpiece", tiny_mlm_dir)
    texts = [_long_text(300), "  ", "the nation"]
    docs, _ = open_corpus(texts)
    docs = list(docs)
    assert [d.streamed for d in docs] == [True, False]
    want = _reference_windows(tokenizer, [Document(d.index, d.text, d.source, d.line) for d in docs])
    assert _windows(tokenizer, iter(docs)) == want
