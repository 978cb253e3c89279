"""Shared fixtures: a tiny BERT MLM saved with a real (tiny) WordPiece tokenizer, built offline, a toy tagging
task of its words, and a one-rank gloo process group."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

SAMPLE_LINES = [
    "The progress of public credit is witnessed by a considerable rise of American stock abroad.",
    "The abundant fruits of another year have blessed our country with plenty and with commerce.",
    "We must ensure that the laws are faithfully executed and that the union is preserved.",
    "Congress will consider the state of the treasury and the revenues of the nation this year.",
]


def build_tiny_mlm_dir(path: Path, layers: int = 2, seed: int = 0) -> Path:
    """Save a random tiny BertForMaskedLM and a WordPiece tokenizer trained on SAMPLE_LINES."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast

    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train_from_iterator(SAMPLE_LINES * 4, vocab_size=300, min_frequency=1)
    tok = BertTokenizerFast(tokenizer_object=wp._tokenizer, do_lower_case=True, unk_token="[UNK]", sep_token="[SEP]",
                            pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=48, max_position_embeddings=64, pad_token_id=tok.pad_token_id)
    BertForMaskedLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def bare_encoder_dir(tmp_path_factory) -> Path:
    """A checkpoint directory with a head-less BertModel (no masked-LM head)."""
    from transformers import BertConfig, BertModel

    path = build_tiny_mlm_dir(tmp_path_factory.mktemp("bare"))
    torch.manual_seed(0)
    BertModel(BertConfig.from_pretrained(path)).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_mlm_dir(tmp_path_factory) -> Path:
    return build_tiny_mlm_dir(tmp_path_factory.mktemp("tiny_mlm"))


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    lines = [" ".join(SAMPLE_LINES[i % 4] for i in range(k, k + 1 + k % 3)) for k in range(24)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def diffusion_run(tiny_mlm_dir, tiny_corpus, tmp_path_factory) -> Path:
    """24 sequences of the tiny 2-block BERT under masked diffusion, t cycling through the grid 0.2, 0.5, 0.8 (8 a
    value): the run the analysis tests of the masking ratio share (tests/analysis/test_mask_ratio.py, test_by_t.py)."""
    from gradflow.cli.main import main

    out = tmp_path_factory.mktemp("diffusion") / "run"
    assert main(["record", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--out", str(out),
                 "--objective", "diffusion", "--mask-ratios", "0.2,0.5,0.8", "--max-length", "24", "--batch-size",
                 "4", "--limit", "24", "--quiet"]) == 0
    return out


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of one rank in this process (removed after the test)."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(autouse=True)
def torch_threads_unchanged():
    """Every test leaves torch's CPU thread count as it found it: a leaked setting changes later tests' float
    reductions (the resume tests compare an in-process run with a subprocess's bytes)."""

    before = torch.get_num_threads()
    yield
    after = torch.get_num_threads()
    torch.set_num_threads(before)
    assert after == before, f"the test left torch.get_num_threads() at {after} (was {before}): restore it"


@pytest.fixture(scope="module")
def toy_task(tmp_path_factory):
    """120 random sentences of the tiny model's words, tagged DET / VERB / NOUN by word (split 96/12/12)."""
    words = ["the", "progress", "of", "public", "credit", "is", "a", "rise", "we", "must", "laws", "are"]
    tags = {"the": "DET", "a": "DET", "is": "VERB", "are": "VERB", "must": "VERB"}
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(120):
        lines += [f"{w}\t{tags.get(str(w), 'NOUN')}" for w in rng.choice(words, size=int(rng.integers(3, 8)))]
        lines.append("")
    path = tmp_path_factory.mktemp("robust") / "toy.conll"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
